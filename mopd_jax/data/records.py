"""The lines of a JSONL file as checked records: every problem one
``DataError`` naming ``path:line``."""

from __future__ import annotations

import json

from mopd_jax.errors import DataError


def json_records(path: str) -> list[tuple[str, dict]]:
  """``(path:line, object)`` for every non-blank line of the JSONL file at
  ``path``; a line that is not UTF-8, not JSON or not an object is a
  ``DataError`` naming it."""
  try:
    with open(path, "rb") as f:
      lines = f.read().split(b"\n")
  except OSError as e:
    raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
  records = []
  for lineno, raw in enumerate(lines, start=1):
    if not raw.strip():
      continue
    where = f"{path}:{lineno}"
    try:
      record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
      raise DataError(f"{where}: not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
      raise DataError(f"{where}: bad JSON: {e.msg} at column {e.colno}"
                      ) from None
    except RecursionError:
      raise DataError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python reads
      raise DataError(f"{where}: bad JSON: {e}") from None
    if not isinstance(record, dict):
      raise DataError(
          f"{where}: expected a JSON object, got {type(record).__name__}")
    check_text(record, where)
    records.append((where, record))
  return records


def check_text(value, where: str, depth: int = 0) -> None:
  """Every string of a parsed line is valid Unicode (JSON's ``\ud800``
  escapes decode to lone surrogates, which no tokenizer can encode)."""
  if isinstance(value, str):
    try:
      value.encode("utf-8")
    except UnicodeEncodeError:
      raise DataError(f"{where}: a string holds a lone surrogate"
                      f" ({value[:40]!r}), not text") from None
  elif isinstance(value, dict) and depth < 64:
    for key, item in value.items():
      check_text(key, where, depth + 1)
      check_text(item, where, depth + 1)
  elif isinstance(value, list) and depth < 64:
    for item in value:
      check_text(item, where, depth + 1)
