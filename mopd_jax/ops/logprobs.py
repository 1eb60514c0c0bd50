"""Log-probabilities and entropies from logits (reference XLA path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """``log softmax(logits)[..., tokens]`` = ``z_y - logsumexp(z)``, in float32."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def next_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Log-prob of ``tokens[:, t]`` under the prediction made at ``t - 1``.

  Returns [B, T-1]: entry ``t-1`` scores token ``t`` (the usual shift).
  """
  return token_logprobs(logits[:, :-1], tokens[:, 1:])


def log_softmax(z: jax.Array) -> jax.Array:
  """``z - logsumexp(z)`` over the last axis, in float32."""
  return jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)


def entropy(z: jax.Array) -> jax.Array:
  """``H = -sum_v p_v log p_v`` over the last axis (-inf logits allowed)."""
  logp = log_softmax(z)
  return -jnp.sum(jnp.exp(logp) * jnp.where(jnp.isfinite(logp), logp, 0.0),
                  axis=-1)
