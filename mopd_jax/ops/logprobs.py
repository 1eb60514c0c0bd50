"""Log-probabilities of chosen tokens from materialised logits (the sampler
has one row per sequence per step; training losses use ``ops.vocab``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """``log softmax(logits)[..., tokens]`` = ``z_y - logsumexp(z)``, in float32."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)
