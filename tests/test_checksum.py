"""The parameter checksum of run summaries: equal exactly for bit-identical
trees with the same names, shapes and dtypes."""

import jax.numpy as jnp
import numpy as np

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


def test_leaf_names_join_keys_with_slashes():
  names = [name for name, _ in named_leaves({"opt": ({"mu": 1},), "w": 2})]
  assert names == ["opt/0/mu", "w"]
