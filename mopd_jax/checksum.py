"""Names and checksums of pytree leaves, so that two runs (or a checkpoint
and the state it was saved from) can be compared without loading both."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from mopd_jax.parallel import to_host


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """``[("layers/q", leaf), ...]``: every leaf with its path, keys joined by
  ``/`` (a namedtuple's field and a dict key of the same name read the same,
  as in Orbax metadata)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [("/".join(_key_name(k) for k in path), leaf) for path, leaf in flat]


def tree_checksum(tree: Any) -> str:
  """``sha256`` over the leaves of ``tree`` in sorted name order, each as
  ``name:dtype:shape`` then its raw bytes; equal digests mean bit-identical
  trees with the same names, shapes and dtypes."""
  digest = hashlib.sha256()
  for name, leaf in sorted(named_leaves(tree), key=lambda item: item[0]):
    array = np.ascontiguousarray(to_host(leaf))
    digest.update(f"{name}:{array.dtype.name}:{array.shape}\n".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()
