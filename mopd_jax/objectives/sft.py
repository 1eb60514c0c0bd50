"""Supervised next-token loss on demonstrations."""

from __future__ import annotations

from mopd_jax.models import decoder
from mopd_jax.ops import vocab
from mopd_jax.reductions import masked_sum_count


def sft_loss(params, cfg, batch, ops: dict | None = None):
  """``(sum_t -m_t log pi(y_t | y_<t), sum_t m_t)`` over the loss mask ``m``.

  ``log pi`` comes from the hidden states and the unembedding with the fused
  vocabulary op (options ``ops``: ``impl``, ``block_v``), so the
  ``[B, T, V]`` logits are never materialised.
  """
  h, _ = decoder.hidden_states(params, cfg, batch["tokens"],
                               batch["segment_ids"])
  mask = batch["loss_mask"][:, 1:]
  logp = vocab.token_logprobs(
      h[:, :-1], decoder.output_weight(params, cfg).astype(h.dtype),
      batch["tokens"][:, 1:], mask=mask, **(ops or {}))
  return masked_sum_count(-logp, mask)
