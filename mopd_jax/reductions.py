"""Masked ``(sum, count)`` reductions.

Every loss and metric is carried as a pair so that micro-batches, devices and
hosts combine exactly (sum the pairs, divide once); padding never enters a mean.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp


def masked_sum_count(values: jax.Array, mask: jax.Array):
  """``(sum_i m_i x_i, sum_i m_i)`` in float32."""
  mask = mask.astype(jnp.float32)
  return jnp.sum(values.astype(jnp.float32) * mask), jnp.sum(mask)


def safe_mean(total, count):
  """``total / count``, and 0 where nothing was counted."""
  return jnp.where(count > 0, total / jnp.maximum(count, 1e-9), 0.0)


def means(pairs: Mapping[str, tuple]) -> dict[str, float]:
  """Turn ``{name: (sum, count)}`` into ``{name: mean}`` Python floats."""
  return {k: float(safe_mean(s, c)) for k, (s, c) in pairs.items()}
