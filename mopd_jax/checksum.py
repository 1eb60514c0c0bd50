"""Names and checksums of pytree leaves, so that two runs (or a checkpoint
and the state it was saved from) can be compared without loading both."""

from __future__ import annotations

import hashlib
import weakref
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


# The digest of the last tree of jax arrays hashed, by the identity of its
# (immutable) leaves: a checkpoint's save and the run's summary hash the same final
# parameters, and hashing 135M float32 takes most of a second.
_last: tuple[list, str] | None = None


def tree_checksum(tree: Any) -> str:
  """``sha256`` over the leaves of ``tree`` in sorted name order, each as
  ``name:dtype:shape`` then its raw bytes; equal digests mean bit-identical
  trees with the same names, shapes and dtypes."""
  global _last
  leaves = sorted(named_leaves(tree), key=lambda item: item[0])
  if _last is not None and len(_last[0]) == len(leaves) and all(
      name == seen_name and ref() is leaf
      for (name, leaf), (seen_name, ref) in zip(leaves, _last[0])):
    return _last[1]
  digest = hashlib.sha256()
  for name, leaf in leaves:
    array = np.ascontiguousarray(to_host(leaf))
    digest.update(f"{name}:{array.dtype.name}:{array.shape}\n".encode())
    digest.update(array.reshape(-1).view(np.uint8))  # no copy of the bytes
  # only jax arrays, which cannot change in place, are remembered
  _last = ([(name, weakref.ref(leaf)) for name, leaf in leaves],
           digest.hexdigest()) if all(isinstance(leaf, jax.Array)
                                      for _, leaf in leaves) else None
  return digest.hexdigest()
