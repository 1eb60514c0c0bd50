"""Supervised next-token loss on demonstrations."""

from __future__ import annotations

from mopd_jax.models import decoder
from mopd_jax.ops.logprobs import next_token_logprobs
from mopd_jax.reductions import masked_sum_count


def sft_loss(params, cfg, batch):
  """``(sum_t -m_t log pi(y_t | y_<t), sum_t m_t)`` over the loss mask ``m``."""
  logits, _ = decoder.apply(params, cfg, batch["tokens"], batch["segment_ids"])
  logp = next_token_logprobs(logits, batch["tokens"])
  return masked_sum_count(-logp, batch["loss_mask"][:, 1:])
