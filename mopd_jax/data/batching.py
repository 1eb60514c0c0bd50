"""Turn examples into fixed-shape token arrays.

Demonstrations are ``BOS prompt answer EOS`` sequences packed into rows, whose
loss mask covers the answer and EOS; prompts for sampling are left-padded ``BOS prompt``
rows so every row's first generated token lands in the same cache slot.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from mopd_jax.errors import DataError


def demonstration_tokens(example, tokenizer) -> tuple[list[int], int]:
  """``BOS prompt answer EOS`` ids and the index where the answer starts."""
  prompt = tokenizer.prompt_ids(example.prompt)
  return prompt + tokenizer.encode(example.answer) + [tokenizer.eos_id], len(
      prompt)


def pack_demonstrations(draw: Callable[[], object], tokenizer, rows: int,
                        length: int):
  """Pack demonstrations into ``rows`` rows of ``length`` tokens.

  Examples come from ``draw()`` and go, first fit, into the first row with
  room; packing stops at the first example that fits nowhere (it is dropped).
  Returns ``tokens``, ``segment_ids`` (1, 2, ... per example in a row, 0 on
  padding) and ``loss_mask`` (1 on answer and EOS tokens, the ones the model
  learns to predict), each [rows, length] int32, and the examples packed.
  """
  tokens = np.full((rows, length), tokenizer.pad_id, np.int32)
  segments = np.zeros_like(tokens)
  loss_mask = np.zeros_like(tokens)
  fill = [0] * rows
  packed = []
  while True:
    example = draw()
    ids, answer_start = demonstration_tokens(example, tokenizer)
    if len(ids) > length:
      raise DataError(f"{example.domain} example {example.prompt!r}:"
                      f" {len(ids)} tokens exceed the sequence length {length}")
    row = next((r for r in range(rows) if fill[r] + len(ids) <= length), None)
    if row is None:
      break
    start = fill[row]
    tokens[row, start:start + len(ids)] = ids
    segments[row, start:start + len(ids)] = segments[row].max() + 1
    loss_mask[row, start + answer_start:start + len(ids)] = 1
    fill[row] += len(ids)
    packed.append(example)
  return dict(tokens=tokens, segment_ids=segments, loss_mask=loss_mask), packed


def bucket_width(longest: int, width: int) -> int:
  """The columns a set of rows is cut to: the smallest of 8, 12, 16, 24,
  32, 48, ... (``2^i`` and ``1.5 x 2^i``) that holds its ``longest``
  completion, at most the batch's ``width``: few widths, so that few shapes
  compile, each at most 1.5 times the longest."""
  candidate = 8
  while candidate < longest:
    power_of_two = candidate & (candidate - 1) == 0
    candidate = candidate * 3 // 2 if power_of_two else candidate * 4 // 3
  return min(candidate, width)


def encode_prompts(prompts: Sequence[str], tokenizer, width: int,
                   rows: int = 0, fit: bool = False):
  """Left-padded prompt rows (``tokenizer.prompt_ids``): ``(tokens,
  mask)``, each [B, W]. ``B`` is ``rows`` (at least ``len(prompts)``; the
  rows past the prompts are empty, mask 0) or ``len(prompts)``; ``W`` is
  ``width``, or with ``fit`` the smallest of 16, 32, 64, ... that holds the
  longest prompt (at most ``width``): a few shapes to compile, and no
  attention over padding that a short prompt does not need."""
  encoded = {}  # a group's copies of one prompt go through the template once
  for text in prompts:
    if text not in encoded:
      row = tokenizer.prompt_ids(text)
      if len(row) > width:
        raise DataError(f"prompt {text[:60]!r}: {len(row)} tokens exceed"
                        f" data.max_prompt_len={width}")
      encoded[text] = row
  ids = [encoded[text] for text in prompts]
  if fit:
    longest = max((len(row) for row in ids), default=1)
    width = min(width, max(16, 1 << (longest - 1).bit_length()))
  tokens = np.full((max(rows, len(prompts)), width), tokenizer.pad_id,
                   np.int32)
  mask = np.zeros_like(tokens)
  for b, row in enumerate(ids):
    tokens[b, width - len(row):] = row
    mask[b, width - len(row):] = 1
  return tokens, mask
