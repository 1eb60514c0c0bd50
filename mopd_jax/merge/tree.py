"""The merge of a whole parameter tree, one leaf at a time: a stacked leaf
(the decoder's ``layers/*``, one slice per layer) is merged slice by slice,
as mergekit merges each layer's tensor on its own (top-k, norms and cosines
per layer), jitted per shape."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.checksum import named_leaves
from mopd_jax.merge.methods import METHODS
from mopd_jax.merge.parameters import (Override, Settings, check_settings,
                                       leaf_settings)

@functools.lru_cache(maxsize=None)
def _merge_fn(settings: Settings, stacked: bool, per_layer: tuple[str, ...]):
  """A jitted ``(b, x, key, *per-layer values) -> merged`` for one leaf
  shape; a stacked leaf is merged slice by slice (vmap over the layer
  axis), each slice with its own key and per-layer values."""
  fn = METHODS[settings.method].fn

  def one(b, x, key, *values):
    s = dataclasses.replace(settings, **dict(zip(per_layer, values)))
    return fn(b.astype(jnp.float32), x.astype(jnp.float32), s,
              key).astype(b.dtype)

  if stacked:
    return jax.jit(jax.vmap(one, in_axes=(0, 1, 0) + (0,) * len(per_layer)))
  return jax.jit(one)


def merge_leaf(name: str, base_leaf, expert_leaves: Sequence, settings:
               Settings, rules: Sequence[Override], key: jax.Array,
               stacked: bool):
  """One leaf merged (``stacked``: its axis 0 holds the layers)."""
  layers = base_leaf.shape[0] if stacked else None
  values = leaf_settings(name, layers, settings, rules)
  check_settings(values, name)
  per_layer = tuple(k for k, v in values.items() if isinstance(v, np.ndarray))
  static = dataclasses.replace(settings, **{
      k: v for k, v in values.items() if k not in per_layer})
  x = jnp.stack(list(expert_leaves))
  keys = jax.random.split(key, layers) if stacked else key
  fn = _merge_fn(static, stacked, per_layer)
  return fn(base_leaf, x, keys, *(jnp.asarray(values[k]) for k in per_layer))


def merge_params(base: Any, expert_leaves: Callable[[str], Sequence],
                 settings: Settings, rules: Sequence[Override] = (),
                 seed: int = 0,
                 is_stacked: Callable[[str], bool] = lambda name: False
                 ) -> Any:
  """The merged parameter tree, one leaf at a time: leaf ``i``, named
  ``n``, merged from ``expert_leaves(n)`` (the experts' leaves, read only
  then, so that memory holds one model and one leaf per expert) with key
  ``fold_in(key(seed), i)``."""
  flat_base, treedef = jax.tree_util.tree_flatten(base)
  root = jax.random.key(seed)
  merged = [merge_leaf(name, leaf, expert_leaves(name), settings, rules,
                       jax.random.fold_in(root, i), is_stacked(name))
            for i, (name, leaf) in enumerate(
                zip([n for n, _ in named_leaves(base)], flat_base))]
  return jax.tree_util.tree_unflatten(treedef, merged)


def in_memory(experts: Sequence[Any]) -> Callable[[str], list]:
  """``expert_leaves`` for experts already in memory."""
  by_name = [dict(named_leaves(e)) for e in experts]
  return lambda name: [e[name] for e in by_name]


