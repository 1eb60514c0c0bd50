"""Turn examples into fixed-shape token arrays.

Demonstrations are right-padded ``BOS prompt answer EOS`` rows whose loss mask
covers the answer and EOS; prompts for sampling are left-padded ``BOS prompt``
rows so every row's first generated token lands in the same cache slot.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mopd_jax.errors import DataError


def encode_demonstrations(examples: Sequence, tokenizer, length: int):
  """``tokens``, ``segment_ids`` and ``loss_mask``, each [B, length] int32.

  ``loss_mask[b, t] = 1`` where ``tokens[b, t]`` is an answer or EOS token,
  i.e. a token the model must learn to predict from what precedes it.
  """
  tokens = np.full((len(examples), length), tokenizer.pad_id, np.int32)
  segments = np.zeros_like(tokens)
  loss_mask = np.zeros_like(tokens)
  for b, ex in enumerate(examples):
    prompt = [tokenizer.bos_id] + tokenizer.encode(ex.prompt)
    answer = tokenizer.encode(ex.answer) + [tokenizer.eos_id]
    row = prompt + answer
    if len(row) > length:
      raise DataError(f"{ex.domain} example {ex.prompt!r}: {len(row)} tokens"
                      f" exceed the sequence length {length}")
    tokens[b, :len(row)] = row
    segments[b, :len(row)] = 1
    loss_mask[b, len(prompt):len(row)] = 1
  return dict(tokens=tokens, segment_ids=segments, loss_mask=loss_mask)


def encode_prompts(prompts: Sequence[str], tokenizer, width: int):
  """Left-padded ``BOS prompt`` rows: ``(tokens, mask)``, each [B, width]."""
  tokens = np.full((len(prompts), width), tokenizer.pad_id, np.int32)
  mask = np.zeros_like(tokens)
  for b, text in enumerate(prompts):
    row = [tokenizer.bos_id] + tokenizer.encode(text)
    if len(row) > width:
      raise DataError(f"prompt {text[:60]!r}: {len(row)} tokens exceed"
                      f" data.max_prompt_len={width}")
    tokens[b, width - len(row):] = row
    mask[b, width - len(row):] = 1
  return tokens, mask
