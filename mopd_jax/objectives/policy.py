"""What every policy-gradient loss shares: the student's per-position terms
from hidden states with the fused vocabulary ops, and the final aggregation
with its standard metrics (used by GRPO and by on-policy distillation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mopd_jax.models import decoder
from mopd_jax.objectives import grpo
from mopd_jax.ops import vocab
from mopd_jax.reductions import masked_sum_count
from mopd_jax.rollout import sampler


def student_positions(params, cfg, mb: dict, temperature: float,
                      ops: vocab.VocabOps) -> dict:
  """The sampling policy at every completion position, from hidden states.

  ``logp`` (of the sampled token) and ``entropy`` [B, T] of
  ``softmax(h W_out / temperature)`` by the fused vocabulary op (no
  [B, T, V] logits), and ``h`` [B, T, D], ``w`` [D, V], ``scale`` for
  further vocabulary terms; ``ops`` are the op's options (``impl``,
  ``block_v``).
  """
  h = sampler.completion_hidden(params, cfg, mb["prompt"], mb["prompt_mask"],
                                mb["completion"], mb["mask"])
  w = decoder.output_weight(params, cfg).astype(h.dtype)
  scale = 1.0 / temperature
  logp, ent = vocab.token_logprobs(h, w, mb["completion"], mask=mb["mask"],
                                   scale=scale, with_entropy=True, ops=ops)
  return {"logp": logp, "entropy": ent, "h": h, "w": w, "scale": scale}


def aggregate_loss(per_token: jax.Array, clipped: jax.Array, stats: dict, mb: dict,
           rl, max_new_tokens: int, metrics: dict | None = None):
  """``(loss, metrics)`` of a per-token loss ``L_t``:

  ``L_t + beta KL_t(pi || pi_ref) - entropy_coef H_t(pi)``

  with ``KL_t`` the ``rl.kl_estimator`` of the KL to the reference
  (``mb["ref_logp"]``) and ``H_t`` the policy's entropy at the position,
  aggregated over ``mask * keep`` by ``rl.aggregation``; reports clip
  fraction, entropy and the k3 drift from ``pi_old`` as ``(sum, count)``
  pairs."""
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
  if rl.entropy_coef > 0:
    per_token = per_token - rl.entropy_coef * stats["entropy"]
  total, count = grpo.aggregate(per_token, mask, rl.aggregation,
                                max_new_tokens)
  metrics["loss"] = (total, count)
  return total / jnp.maximum(count, 1.0), metrics
