"""Prompts packed for the prefill: each distinct prompt of a batch once, in
as few rows as hold them.

A batch of left-padded prompts wastes the prefill's work twice: on its
padding (chat prompts of 64 to 128 tokens padded to 128 are a quarter
padding) and on repeats (a GRPO group's ``G`` copies of one prompt are
prefilled ``G`` times). The sampler prefills the packed rows instead and
gathers each batch row's cache from them (``decoder.gather_cache``).
Host-side numpy: the packing decides the packed rows' count, a shape.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Packing(NamedTuple):
  """``tokens`` and ``segments`` [R, W]: the distinct prompts packed (1, 2,
  ... per prompt in a row, 0 on what is left); ``row`` and ``col`` [B, W]:
  where slot ``s`` of batch row ``b`` was packed (an empty slot points at
  ``(0, 0)``; it stays masked)."""
  tokens: np.ndarray
  segments: np.ndarray
  row: np.ndarray
  col: np.ndarray


def pack(prompt, prompt_mask, pad_id: int) -> Packing | None:
  """The distinct prompts of left-padded ``prompt`` rows (real tokens
  where ``prompt_mask`` is 1, right-aligned), first fit by decreasing
  length into rows of the same width, their count rounded up to a power
  of two of at least 8 (few shapes to compile); None where that is not
  fewer rows than the batch (nothing to save), or where a row's tokens are
  not right-aligned (the padded prefill's contract, kept as it is). Reads
  ``prompt`` on the host: a device array is waited for."""
  prompt, mask = np.asarray(prompt), np.asarray(prompt_mask) != 0
  B, W = prompt.shape
  lengths = mask.sum(1)
  if not np.array_equal(mask, np.arange(W) >= W - lengths[:, None]):
    return None
  copies: dict[bytes, list[int]] = {}
  for b in np.flatnonzero(lengths):
    copies.setdefault(prompt[b, W - lengths[b]:].tobytes(), []).append(b)
  fill: list[int] = []
  placed = []  # (batch rows, packed row, start column)
  for rows in sorted(copies.values(), key=lambda r: -lengths[r[0]]):
    n = lengths[rows[0]]
    r = next((i for i, f in enumerate(fill) if f + n <= W), len(fill))
    if r == len(fill):
      fill.append(0)
    placed.append((rows, r, fill[r]))
    fill[r] += n
  R = max(8, 1 << (len(fill) - 1).bit_length())
  if R >= B:
    return None
  tokens = np.full((R, W), pad_id, prompt.dtype)
  segments = np.zeros((R, W), np.int32)
  row = np.zeros((B, W), np.int32)
  col = np.zeros((B, W), np.int32)
  for rows, r, start in placed:
    n = lengths[rows[0]]
    tokens[r, start:start + n] = prompt[rows[0], W - n:]
    segments[r, start:start + n] = segments[r].max() + 1
    row[rows, W - n:] = r
    col[rows, W - n:] = np.arange(start, start + n)
  return Packing(tokens, segments, row, col)
