"""The parameter checksum of run summaries: equal exactly for bit-identical
trees with the same names, shapes and dtypes."""

import jax.numpy as jnp
import numpy as np

from mopd_jax import checksum
from mopd_jax.checksum import named_leaves, tree_checksum


def _tree():
  return {"layers": {"q": jnp.arange(6.0).reshape(2, 3)},
          "embed": np.ones(4, np.float32)}


def test_checksum_is_a_function_of_names_and_bits():
  digest = tree_checksum(_tree())
  assert digest == tree_checksum(dict(reversed(list(_tree().items()))))
  assert len(digest) == 64
  flipped = _tree()
  bits = flipped["embed"].view(np.uint32)
  bits[0] ^= 1  # the lowest mantissa bit
  assert tree_checksum(flipped) != digest
  renamed = {"layers": {"k": _tree()["layers"]["q"]}, "embed": _tree()["embed"]}
  assert tree_checksum(renamed) != digest
  reshaped = dict(_tree(), layers={"q": jnp.arange(6.0).reshape(3, 2)})
  assert tree_checksum(reshaped) != digest
  recast = dict(_tree(), embed=np.ones(4, np.float64))
  assert tree_checksum(recast) != digest


def test_a_tree_hashed_again_is_remembered_and_equal_to_its_bytes(
    monkeypatch):
  """The same jax arrays hashed twice (a final checkpoint, then the
  summary) give the digest of their bytes; numpy leaves, which can change
  in place, are hashed anew."""
  import hashlib
  tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(2, jnp.bfloat16)}
  want = hashlib.sha256()
  for name in ("a", "b"):
    array = np.asarray(tree[name])
    want.update(f"{name}:{array.dtype.name}:{array.shape}\n".encode())
    want.update(array.tobytes())
  assert tree_checksum(tree) == want.hexdigest()
  read = []
  monkeypatch.setattr(checksum, "to_host", lambda x: read.append(x) or x)
  assert tree_checksum(tree) == want.hexdigest() and not read  # remembered
  assert tree_checksum(dict(tree, a=tree["a"] + 1)) != want.hexdigest()
  assert read  # a new leaf is read
  mutable = {"a": np.zeros(3, np.float32)}
  before = tree_checksum(mutable)
  mutable["a"][0] = 1.0
  assert tree_checksum(mutable) != before


def test_leaf_names_join_keys_with_slashes():
  names = [name for name, _ in named_leaves({"opt": ({"mu": 1},), "w": 2})]
  assert names == ["opt/0/mu", "w"]
