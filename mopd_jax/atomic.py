"""Atomic file writes: a reader (or a run killed mid-write) sees the old file
or the new one, never half of one.

The bytes go to a temporary file in the same directory, are flushed to
disk, and the file is renamed over the target (``os.replace`` is atomic on
POSIX and Windows within one file system).

A write the file system refuses (no space left, no permission) is a
``UserError`` naming the file. In a multi-host run only process 0 writes (every process computes the same
payload, and the hosts share the workdir); the others return at once.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mopd_jax.errors import UserError
from mopd_jax.parallel import is_primary


def write_bytes_atomic(path: str, data: bytes) -> None:
  """Replace the file at ``path`` with ``data`` in one step (on process 0
  only)."""
  if not is_primary():
    return
  # Per process, so that two runs never share a temporary file; open()
  # (unlike mkstemp) gives the file the usual permissions.
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    if isinstance(e, OSError):  # a full disk, a read-only folder: the user's
      raise UserError(f"{path}: cannot write ({e.strerror or e})") from None
    raise


def write_text_atomic(path: str, text: str) -> None:
  """``text`` as UTF-8, written atomically."""
  write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str, payload: Any) -> None:
  """``payload`` as indented, key-sorted JSON, written atomically."""
  write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
