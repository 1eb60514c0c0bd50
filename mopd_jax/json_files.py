"""Reading the JSON files of runs and checkpoints (``config.json``,
indexes, tokenizer settings): anything unreadable is one user error
naming the file. A missing file is left to the caller, which knows what
its absence means. ``regular_file`` guards every file of a checkpoint
before it is opened: a named pipe or a device in its place would block
or never end."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from mopd_jax.errors import UserError, reason


def regular_file(path: str, error: type[UserError] = UserError) -> None:
  """``error`` unless ``path`` (after links) is a regular file, or does
  not exist (``FileNotFoundError`` is the caller's to raise)."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return
  except OSError as e:
    raise error(f"{path}: unreadable ({reason(e)})") from None
  if not stat.S_ISREG(mode):
    raise error(f"{path}: not a regular file")


def read_json(path: str, error: type[UserError] = UserError) -> Any:
  """The JSON value in ``path``; ``error`` when it is unreadable, not a
  regular file or not JSON (nested too deeply included).
  ``FileNotFoundError`` propagates."""
  regular_file(path, error)
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise
  except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
    raise error(f"{path}: unreadable ({reason(e)})") from None


def read_object(path: str, error: type[UserError] = UserError) -> dict:
  """``read_json``, which must give a JSON object."""
  value = read_json(path, error)
  if not isinstance(value, dict):
    raise error(f"{path}: expected a JSON object, got"
                f" {type(value).__name__}")
  return value
