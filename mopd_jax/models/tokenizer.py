"""Tokenizers behind one interface: a character-level one for the built-in
domains, and Hugging Face ``tokenizer.json`` files (``HFTokenizer``).

Every tokenizer exposes ``vocab_size``, ``pad_id``, ``eos_id``,
``encode(text) -> list[int]``, ``prompt_ids(prompt)`` (the tokens a model
reads before answering: BOS, or the chat template, then the prompt) and
``decode(ids) -> str``; ``fingerprint()`` identifies the vocabulary so that
teachers and students can be checked to share token ids. A run's tokenizer
travels with it: a run directory holding ``tokenizer.json`` uses that file
(``of_run``), and a run started from another (``init``) uses the init's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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

  def prompt_ids(self, prompt: str) -> list[int]:
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

  def prompt_ids(self, prompt: str) -> list[int]:
    """BOS, then the prompt's characters."""
    return [self.bos_id] + self.encode(prompt)

  def fits(self, vocab_size: int) -> bool:
    """Whether a model of ``vocab_size`` embeddings reads these ids (the
    built-in models have exactly one row per id)."""
    return vocab_size == self.vocab_size

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

  def save_hf(self, directory: str) -> None:
    """This tokenizer as Hugging Face files (``tokenizer.json``: one
    word-level token per character, the same ids; ``tokenizer_config.json``:
    PAD, BOS, EOS), so that an exported model reads text in transformers."""
    from tokenizers import Regex, Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update(self._ids)
    backend = Backend(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."),
                                                 behavior="isolated")
    backend.decoder = decoders.Fuse()
    os.makedirs(directory, exist_ok=True)
    backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w",
              encoding="utf-8") as f:
      json.dump(dict(zip(("pad_token", "bos_token", "eos_token"), SPECIALS)),
                f)

  def fingerprint(self) -> str:
    return "char:" + hashlib.sha256(
        ("\x00".join(SPECIALS) + "\x00" + self.alphabet).encode()).hexdigest()[:16]


# The files of a Hugging Face tokenizer, copied along with a run.
HF_FILES = ("tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")


def _token(value) -> str | None:
  """A special token of ``tokenizer_config.json`` (a string or an
  ``{"content": ...}`` object)."""
  return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
  """A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` library)
  with the BOS / EOS / PAD tokens and the chat template of the
  ``tokenizer_config.json`` beside it. Prompts go through the chat template
  as one user message with the generation prompt added (the template
  writes BOS itself); without a template they are BOS (if the model has
  one) then the text. PAD falls back to EOS."""

  def __init__(self, directory: str):
    from tokenizers import Tokenizer as Backend
    self.directory = directory
    path = os.path.join(directory, "tokenizer.json")
    try:
      self._tok = Backend.from_file(path)
      with open(path, "rb") as f:
        self._sha = hashlib.sha256(f.read()).hexdigest()[:16]
      config_path = os.path.join(directory, "tokenizer_config.json")
      config = {}
      if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
          config = json.load(f)
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"{path}: not a readable tokenizer"
                      f" ({type(e).__name__}: {e})") from None
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    ids = {}
    for name in ("bos_token", "eos_token", "pad_token"):
      token = _token(config.get(name))
      ids[name] = None if token is None else self._tok.token_to_id(token)
    if ids["eos_token"] is None:
      raise DataError(f"{directory}: tokenizer_config.json names no"
                      " eos_token, so completions could not end")
    self.bos_id, self.eos_id = ids["bos_token"], ids["eos_token"]
    self.pad_id = ids["eos_token"] if ids["pad_token"] is None else ids[
        "pad_token"]
    self._specials = {"bos_token": _token(config.get("bos_token")) or "",
                      "eos_token": _token(config.get("eos_token")) or ""}
    template = config.get("chat_template")
    self._template = None
    if template:
      from jinja2.sandbox import ImmutableSandboxedEnvironment
      self._template = ImmutableSandboxedEnvironment(
          trim_blocks=True, lstrip_blocks=True).from_string(template)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def prompt_ids(self, prompt: str) -> list[int]:
    if self._template is not None:
      text = self._template.render(
          messages=[{"role": "user", "content": prompt}],
          add_generation_prompt=True, **self._specials)
      return self.encode(text)
    return ([] if self.bos_id is None else [self.bos_id]) + self.encode(
        prompt)

  def fits(self, vocab_size: int) -> bool:
    """Checkpoints often pad their embedding past the tokenizer's ids."""
    return vocab_size >= self.vocab_size

  def decode(self, ids: Sequence[int]) -> str:
    """The text of ``ids`` up to the first EOS, special tokens dropped."""
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._tok.decode(ids, skip_special_tokens=True)

  def fingerprint(self) -> str:
    return f"hf-{self._sha}"


def of_run(run_dir: str | None):
  """The tokenizer of a run directory (or of a Hugging Face checkpoint
  directory): its ``tokenizer.json`` if it holds one, else the built-in
  character tokenizer."""
  if run_dir and os.path.exists(os.path.join(os.path.expanduser(run_dir),
                                             "tokenizer.json")):
    return HFTokenizer(os.path.expanduser(run_dir))
  return CharTokenizer()


def for_config(config):
  """The tokenizer a run of ``config`` uses: its ``init`` run's."""
  return of_run(config.get("init", ""))


def export_files(tokenizer, directory: str) -> None:
  """The tokenizer's Hugging Face files into an exported checkpoint: a
  Hugging Face tokenizer's own, the character tokenizer's ``save_hf``."""
  if isinstance(tokenizer, CharTokenizer):
    tokenizer.save_hf(directory)
  else:
    copy_files(tokenizer, directory)


def copy_files(tokenizer, workdir: str) -> None:
  """A Hugging Face tokenizer's files into ``workdir``, so that the run
  carries its tokenizer to the runs started from it."""
  if isinstance(tokenizer, HFTokenizer):
    os.makedirs(workdir, exist_ok=True)
    for name in HF_FILES:
      source = os.path.join(tokenizer.directory, name)
      if os.path.exists(source) and os.path.abspath(
          tokenizer.directory) != os.path.abspath(workdir):
        shutil.copy(source, workdir)
