"""Naive references of the fused vocabulary ops: materialised ``[N, V]`` logits.

Used by the tests (in float64 under ``jax.enable_x64``) and by the benchmark
as the baseline; never by training code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def logits(h, w, scale=1.0):
  """``scale * h @ w``, accumulated in float32 (or float64 for float64)."""
  acc = jnp.promote_types(h.dtype, jnp.float32)
  return scale * jnp.dot(h, w, preferred_element_type=acc)


def token_logprobs(h, w, targets, scale=1.0):
  """``(log softmax(z)[y], H(softmax(z)))``; ``targets`` ``[N]`` or ``[N, K]``."""
  logp = jax.nn.log_softmax(logits(h, w, scale), axis=-1)
  picked = jnp.take_along_axis(logp, targets.reshape(len(h), -1), axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return picked.reshape(targets.shape), entropy


def kl(h, w, teacher_h, teacher_w, scale=1.0, teacher_scale=None):
  """``(KL(pi||T), KL(T||pi), H(T))`` per row, summed over the vocabulary."""
  teacher_scale = scale if teacher_scale is None else teacher_scale
  logp = jax.nn.log_softmax(logits(h, w, scale), axis=-1)
  logq = jax.nn.log_softmax(logits(teacher_h, teacher_w, teacher_scale),
                            axis=-1)
  p, q = jnp.exp(logp), jnp.exp(logq)
  return (jnp.sum(p * (logp - logq), axis=-1),
          jnp.sum(q * (logq - logp), axis=-1), -jnp.sum(q * logq, axis=-1))


def topk_logprobs(h, w, k, scale=1.0):
  """The ``k`` largest ``log softmax(z)`` of each row and their ids."""
  return jax.lax.top_k(jax.nn.log_softmax(logits(h, w, scale), axis=-1), k)


def rel_err(x, reference) -> float:
  """``max |x - ref| / max |ref|``, in float64: error relative to the scale."""
  x = np.asarray(x, np.float64)
  reference = np.asarray(reference, np.float64)
  return float(np.max(np.abs(x - reference)) / np.max(np.abs(reference)))
