"""What every policy-gradient loss shares: the student's per-position terms
computed tile by tile from hidden states, and the final aggregation with its
standard metrics (used by GRPO and by on-policy distillation)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from mopd_jax.models import decoder
from mopd_jax.objectives import grpo
from mopd_jax.ops.logprobs import entropy, log_softmax
from mopd_jax.reductions import masked_sum_count
from mopd_jax.rollout import sampler


def over_positions(fn: Callable, tile: int, *arrays: jax.Array) -> dict:
  """``fn`` on tiles of ``tile`` completion positions, one tile at a time.

  ``arrays`` are [B, T, ...]; ``fn`` maps their [B, tile, ...] slices to a
  dict of [B, tile] arrays. A scan with rematerialisation keeps one tile's
  intermediates (e.g. [B, tile, vocab] logits) alive, forward and backward;
  the batch axis stays whole, so its sharding is untouched. ``T`` is padded
  to a multiple of ``tile`` (the padding's outputs are dropped).
  """
  length = arrays[0].shape[1]
  tiles = -(-length // tile)

  def split(a):
    a = jnp.pad(a, [(0, 0), (0, tiles * tile - length)] + [(0, 0)] * (
        a.ndim - 2))
    return jnp.moveaxis(a.reshape((a.shape[0], tiles, tile) + a.shape[2:]),
                        1, 0)

  @jax.checkpoint
  def body(_, xs):
    return None, fn(*xs)

  _, out = jax.lax.scan(body, None, [split(a) for a in arrays])
  return {k: jnp.moveaxis(v, 0, 1).reshape(v.shape[1], tiles * tile)[:, :length]
          for k, v in out.items()}


def student_positions(params, cfg, mb: dict, temperature: float, tile: int,
                      per_position: Callable | None = None,
                      extra: tuple = ()) -> dict:
  """The sampling policy's terms at every completion position, [B, T] each.

  ``z = h W_out / temperature`` tile by tile; always ``logp`` (of the sampled
  token) and ``entropy``; ``per_position(z, *extra_tiles)`` adds its own
  entries (``extra``: further [B, T, ...] inputs tiled alongside).
  """
  h = sampler.completion_hidden(params, cfg, mb["prompt"], mb["prompt_mask"],
                                mb["completion"], mb["mask"])
  w = decoder.output_weight(params, cfg)

  def fn(h_tile, y_tile, *extra_tiles):
    z = jnp.einsum("btd,dv->btv", h_tile, w.astype(h_tile.dtype),
                   preferred_element_type=jnp.float32) / temperature
    ls = log_softmax(z)
    out = dict(logp=jnp.take_along_axis(ls, y_tile[..., None], -1)[..., 0],
               entropy=entropy(z))
    if per_position is not None:
      out.update(per_position(z, *extra_tiles))
    return out

  return over_positions(fn, tile, h, mb["completion"], *extra)


def finish(per_token: jax.Array, clipped: jax.Array, stats: dict, mb: dict,
           rl, max_new_tokens: int, metrics: dict | None = None):
  """``(loss, metrics)`` of a per-token loss: adds ``beta`` times the
  ``rl.kl_estimator`` KL to the reference (``mb["ref_logp"]``), aggregates
  over ``mask * keep`` by ``rl.aggregation``, and reports clip fraction,
  entropy and the k3 drift from ``pi_old`` as ``(sum, count)`` pairs."""
  mask = mb["mask"] * mb["keep"][:, None]
  logp = stats["logp"]
  metrics = dict(metrics or {})
  metrics.update(
      clip_fraction=masked_sum_count(clipped, mask),
      entropy=masked_sum_count(stats["entropy"], mask),
      kl_to_old=masked_sum_count(grpo.kl_penalty(logp, mb["old_logp"], "k3"),
                                 mask))
  if rl.beta > 0:
    kl = grpo.kl_penalty(logp, mb["ref_logp"], rl.kl_estimator)
    per_token = per_token + rl.beta * kl
    metrics["kl"] = masked_sum_count(kl, mask)
  total, count = grpo.aggregate(per_token, mask, rl.aggregation,
                                max_new_tokens)
  metrics["loss"] = (total, count)
  return total / jnp.maximum(count, 1.0), metrics
