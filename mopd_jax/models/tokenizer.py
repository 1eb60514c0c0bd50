"""Tokenizers behind one interface: a character-level one for the built-in
domains, and Hugging Face ``tokenizer.json`` files (``HFTokenizer``).

Every tokenizer exposes ``vocab_size``, ``pad_id``, ``eos_id``,
``stop_ids`` (every token that ends a completion), ``encode(text) ->
list[int]``, ``prompt_ids(prompt)`` (the tokens a model reads before
answering: BOS, or the chat template, then the prompt), ``text_ids(text)``
(a plain text as the tokenizer itself reads it), ``decode(ids) -> str``
(up to the first stop token) and ``piece(id)``; ``fingerprint()`` identifies the vocabulary so that
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

from mopd_jax import json_files
from mopd_jax.data.records import check_text
from mopd_jax.errors import DataError
from mopd_jax.models import chat_template

# Every character the built-in domains may produce; order fixes the token ids.
ALPHABET = string.digits + string.ascii_lowercase + " +-*=:;#,.()<>?!/|_"
SPECIALS = ("<pad>", "<bos>", "<eos>")


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int | None
  eos_id: int
  stop_ids: tuple[int, ...]

  def encode(self, text: str) -> list[int]:
    ...

  def prompt_ids(self, prompt: str) -> list[int]:
    ...

  def text_ids(self, text: str) -> list[int]:
    ...

  def piece(self, token: int) -> str:
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
    self.stop_ids = (self.eos_id,)
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

  text_ids = prompt_ids  # a plain text reads like a prompt: BOS first

  def piece(self, token: int) -> str:
    token = int(token)
    if token < len(SPECIALS):
      return SPECIALS[token]
    return self.alphabet[token - len(SPECIALS)]

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


# The files of a Hugging Face tokenizer, copied along with a run (the chat
# template's and the stop tokens' too).
HF_FILES = ("tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", chat_template.TEMPLATE_FILE,
            "generation_config.json")
# transformers' named special tokens, the variables a chat template reads.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token",
                  "pad_token", "cls_token", "mask_token")
_WARNED_NO_TEMPLATE: set[str] = set()


def _read_json_object(path: str, missing=None):
  """The JSON object in ``path`` (``missing`` when there is no file)."""
  try:
    return json_files.read_object(path, DataError)
  except FileNotFoundError:
    return missing


def _token(config: dict, name: str, where: str) -> str | None:
  """A special token of ``tokenizer_config.json`` (a string or an
  ``{"content": ...}`` object)."""
  value = config.get(name)
  if isinstance(value, dict):
    value = value.get("content")
  if value is not None and not isinstance(value, str):
    raise DataError(f"{where}: {name}: expected a token string, got"
                    f" {value!r}")
  check_text(value, f"{where}: {name}")
  return value


def _stop_ids(directory: str, vocab_size: int) -> list:
  """``eos_token_id`` of ``generation_config.json`` (else of the model's
  ``config.json``), an id or a list of ids below ``vocab_size``, as
  transformers' ``generate`` stops on it."""
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(directory, name)
    config = _read_json_object(path, {})
    value = config.get("eos_token_id")
    if value is not None:  # transformers' null: not set
      ids = value if isinstance(value, list) else [value]
      if not all(isinstance(i, int) and not isinstance(i, bool)
                 and 0 <= i < vocab_size for i in ids):
        raise DataError(f"{path}: eos_token_id: expected a token id below"
                        f" the tokenizer's {vocab_size}, or a list of them,"
                        f" got {value!r}")
      return ids
  return []


class HFTokenizer:
  """A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` library)
  with what transformers reads beside it: the special tokens of
  ``tokenizer_config.json``, the chat template (``chat_template.find``) and
  the stop tokens of ``generation_config.json``. Prompts go through the chat
  template as one user message with the generation prompt added, exactly
  as ``apply_chat_template(..., add_generation_prompt=True)`` tokenizes
  them; without a template they are BOS (if the model has one) then the
  text, said once in the log. PAD falls back to EOS. ``stop_ids``: every
  token that ends a completion (EOS and ``generation_config.json``'s
  ``eos_token_id``, which may be a list)."""

  def __init__(self, directory: str):
    from tokenizers import Tokenizer as Backend
    self.directory = directory
    path = os.path.join(directory, "tokenizer.json")
    json_files.regular_file(path, DataError)
    try:
      self._tok = Backend.from_file(path)
      with open(path, "rb") as f:
        self._sha = hashlib.sha256(f.read()).hexdigest()[:16]
    except Exception as e:  # pylint: disable=broad-except
      raise DataError(f"{path}: not a readable tokenizer"
                      f" ({type(e).__name__}: {e})") from None
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _read_json_object(config_path, {})
    # the ids' range, which a model's embedding must cover (an id may lie
    # past the count of tokens)
    self.vocab_size = 1 + max(
        self._tok.get_vocab(with_added_tokens=True).values(), default=-1)
    self._specials = {}
    ids = {}
    for name in SPECIAL_TOKENS:
      token = _token(config, name, config_path)
      if token is not None:
        self._specials[name] = token
      ids[name] = None if token is None else self._tok.token_to_id(token)
      if token is not None and ids[name] is None and name in (
          "bos_token", "eos_token", "pad_token"):
        raise DataError(f"{config_path}: {name} {token!r} is not a token of"
                        " tokenizer.json")
    if ids["eos_token"] is None:
      raise DataError(f"{directory}: tokenizer_config.json names no"
                      " eos_token, so completions could not end")
    self.bos_id, self.eos_id = ids["bos_token"], ids["eos_token"]
    self.pad_id = ids["eos_token"] if ids["pad_token"] is None else ids[
        "pad_token"]
    self.stop_ids = tuple(dict.fromkeys([self.eos_id]
                                        + _stop_ids(directory,
                                                    self.vocab_size)))
    found = chat_template.find(directory, config)
    self.template = None if found is None else chat_template.Template(*found)
    if self.template is not None:
      if not self.prompt_ids("1 + 1 = ?"):  # once, as a check
        raise DataError(f"{self.template.where}: the chat template renders"
                        " a prompt as no tokens")
    elif directory not in _WARNED_NO_TEMPLATE:
      _WARNED_NO_TEMPLATE.add(directory)
      # The log (stdout): stderr is for the one error line.
      print(f"note: {directory} has no chat template; prompts are BOS +"
            " text")

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def text_ids(self, text: str) -> list[int]:
    """``text`` as ``tokenizer(text)`` reads it (the tokenizer's own
    special tokens, e.g. a BOS its post-processor adds)."""
    return self._tok.encode(text, add_special_tokens=True).ids

  def prompt_ids(self, prompt: str) -> list[int]:
    if self.template is not None:
      return self.encode(self.template.render(
          [{"role": "user", "content": prompt}], add_generation_prompt=True,
          **self._specials))
    return ([] if self.bos_id is None else [self.bos_id]) + self.encode(
        prompt)

  def fits(self, vocab_size: int) -> bool:
    """Checkpoints often pad their embedding past the tokenizer's ids."""
    return vocab_size >= self.vocab_size

  def decode(self, ids: Sequence[int]) -> str:
    """The text of ``ids`` up to the first stop token, special tokens
    dropped."""
    ids = [int(i) for i in ids]
    end = next((t for t, i in enumerate(ids) if i in self.stop_ids),
               len(ids))
    return self._tok.decode(ids[:end], skip_special_tokens=True)

  def piece(self, token: int) -> str:
    """One token's text, special tokens included (``<|im_end|>``)."""
    return self._tok.decode([int(token)], skip_special_tokens=False)

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
  carries its tokenizer to the runs started from it. The chat template
  found (wherever transformers found it) and the stop tokens are written
  out where the source had them elsewhere, so that transformers reads the
  same from ``workdir``."""
  if not isinstance(tokenizer, HFTokenizer) or os.path.abspath(
      tokenizer.directory) == os.path.abspath(workdir):
    return
  os.makedirs(workdir, exist_ok=True)
  for name in HF_FILES:
    source = os.path.join(tokenizer.directory, name)
    if os.path.exists(source):
      shutil.copy(source, workdir)
  template = os.path.join(workdir, chat_template.TEMPLATE_FILE)
  if tokenizer.template is not None and not os.path.exists(template):
    with open(template, "w", encoding="utf-8") as f:
      f.write(tokenizer.template.source)
  generation = os.path.join(workdir, "generation_config.json")
  if not os.path.exists(generation):
    with open(generation, "w", encoding="utf-8") as f:
      json.dump({"eos_token_id": list(tokenizer.stop_ids),
                 "pad_token_id": tokenizer.pad_id}, f, indent=2)
