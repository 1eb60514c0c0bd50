"""Tokenizers behind one interface: a character-level one for the built-in
domains, and (later) Hugging Face ``tokenizer.json`` files.

Every tokenizer exposes ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``,
``encode(text) -> list[int]`` and ``decode(ids) -> str``; ``fingerprint()``
identifies the vocabulary so that teachers and students can be checked to share
token ids.
"""

from __future__ import annotations

import hashlib
import string
from typing import Protocol, Sequence

from mopd_jax.errors import DataError

# Every character the built-in domains may produce; order fixes the token ids.
ALPHABET = string.digits + string.ascii_lowercase + " +-*=:;#,.()<>?!/|_"
SPECIALS = ("<pad>", "<bos>", "<eos>")


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str) -> list[int]:
    ...

  def decode(self, ids: Sequence[int]) -> str:
    ...

  def fingerprint(self) -> str:
    ...


class CharTokenizer:
  """One token per character of ``alphabet``, after PAD=0, BOS=1, EOS=2."""

  def __init__(self, alphabet: str = ALPHABET):
    if len(set(alphabet)) != len(alphabet):
      raise ValueError("alphabet has repeated characters")
    self.alphabet = alphabet
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self._ids = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}
    self.vocab_size = len(SPECIALS) + len(alphabet)

  def encode(self, text: str) -> list[int]:
    try:
      return [self._ids[c] for c in text]
    except KeyError as e:
      raise DataError(
          f"character {e.args[0]!r} in {text[:40]!r} is not in the"
          " character tokenizer's alphabet") from None

  def decode(self, ids: Sequence[int]) -> str:
    """Characters of ``ids`` up to the first EOS; PAD and BOS are dropped."""
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i >= len(SPECIALS):
        out.append(self.alphabet[i - len(SPECIALS)])
    return "".join(out)

  def fingerprint(self) -> str:
    return "char:" + hashlib.sha256(
        ("\x00".join(SPECIALS) + "\x00" + self.alphabet).encode()).hexdigest()[:16]
