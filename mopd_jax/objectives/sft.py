"""Supervised next-token loss on demonstrations."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from mopd_jax import training
from mopd_jax.models import decoder
from mopd_jax.ops import vocab
from mopd_jax.reductions import masked_sum_count


def sft_loss(params, cfg, batch, ops: vocab.VocabOps = vocab.DEFAULT_OPS):
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
      batch["tokens"][:, 1:], mask=mask, ops=ops)
  return masked_sum_count(-logp, mask)


def make_train_step(cfg, optimizer: optax.GradientTransformation,
                    ops: vocab.VocabOps = vocab.DEFAULT_OPS):
  """``step(state, batch) -> (state, metrics)``: one guarded AdamW update on
  the token-mean SFT loss ``sum_t m_t (-log pi(y_t)) / sum_t m_t`` (not
  jitted: callers choose donation and lowering). ``metrics`` holds
  ``(sum, count)`` pairs: ``loss`` and ``training.SKIPPED``."""
  def step(state, batch):
    def loss_fn(params):
      total, count = sft_loss(params, cfg, batch, ops)
      return total / count, (total, count)

    (total, count), params, opt_state, skipped = training.gradient_step(
        optimizer, loss_fn, state["params"], state["opt_state"])
    new_state = dict(state, params=params, opt_state=opt_state,
                     step=state["step"] + 1)
    return new_state, {"loss": (total, count),
                       training.SKIPPED: (skipped, jnp.float32(1))}

  return step
