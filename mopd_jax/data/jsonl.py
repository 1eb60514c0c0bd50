"""Loading prompts from a JSONL file: one ``{"prompt", "answer", "domain"}``
object per line.

``domain`` must name a built-in domain, whose verifier scores the completions
of that prompt. Every problem is reported as one ``DataError`` naming the file,
the line and the field, so that a bad line is found without a traceback.
"""

from __future__ import annotations

from mopd_jax.data import domains
from mopd_jax.data.example import Example
from mopd_jax.data.records import json_records
from mopd_jax.errors import DataError
from mopd_jax.models.tokenizer import ALPHABET

_FIELDS = ("prompt", "answer", "domain")


def load_jsonl(path: str, alphabet: str | None = ALPHABET,
               max_prompt_len: int | None = None) -> list[Example]:
  """The examples of the JSONL file at ``path``; blank lines are skipped.

  Keys other than the three fields (an id, say) are ignored. ``prompt`` and
  ``answer`` may use only characters of ``alphabet`` (the character
  tokenizer's by default; None skips the check, for a tokenizer that can
  encode any text). A reference ``answer`` must score 1.0 under its domain's
  verifier, since a prompt that no completion can solve would only add noise.
  With the character tokenizer a prompt takes ``1 + len(prompt)`` tokens
  (BOS first), which must fit ``max_prompt_len`` when given: a prompt that
  cannot be encoded is found here, not at the first evaluation after
  training.
  """
  allowed = None if alphabet is None else frozenset(alphabet)
  examples = []
  for where, record in json_records(path):
    example = _parse_record(record, where, allowed)
    tokens = 1 + len(example.prompt)
    if max_prompt_len and alphabet is not None and tokens > max_prompt_len:
      raise DataError(f"{where}: field 'prompt': {tokens} tokens"
                      f" (with BOS) exceed data.max_prompt_len="
                      f"{max_prompt_len}")
    examples.append(example)
  if not examples:
    raise DataError(f"{path}: no examples")
  return examples


def _parse_record(record: dict, where: str,
                  allowed: frozenset[str] | None) -> Example:
  """The example of one line's object; ``where`` is ``path:lineno``."""
  for field in _FIELDS:
    if field not in record:
      raise DataError(f"{where}: missing field {field!r}")
    if not isinstance(record[field], str):
      raise DataError(f"{where}: field {field!r} must be a string, got"
                      f" {type(record[field]).__name__}")
    if not record[field]:
      raise DataError(f"{where}: field {field!r} is empty")
  domain = record["domain"]
  try:
    spec = domains.get_domain(domain)
  except DataError as e:
    raise DataError(f"{where}: field 'domain': {e}") from None
  if allowed is not None:
    for field in ("prompt", "answer"):
      bad = sorted(set(record[field]) - allowed)
      if bad:
        raise DataError(f"{where}: field {field!r} has characters {bad} that"
                        " are not in the tokenizer alphabet")
  example = Example(
      prompt=record["prompt"], answer=record["answer"], domain=domain)
  if spec.verify(example.answer, example.answer) != 1.0:
    raise DataError(f"{where}: field 'answer': {example.answer[:40]!r} does not"
                    f" pass the {domain!r} verifier")
  return example
