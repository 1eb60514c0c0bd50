"""Chunked XLA path of the fused vocabulary ops: a loop over vocabulary tiles.

All rows are processed together and the vocabulary is walked in tiles of
``block_v`` columns with ``lax.fori_loop``, so the largest temporaries are a
few ``[N, block_v]`` float32 tiles instead of ``[N, V]`` logits. When ``V`` is
not a multiple of ``block_v`` the last tile is read at ``[V - block_v, V)``
(never past the end of ``W``) and the columns the previous tile already
covered are masked to ``-inf``, so ``W`` is never padded or copied.

Backward functions recompute each tile's logits from ``h`` and ``w`` and
return float32 gradients ``(dh, dw)`` of the row statistics only; the caller
(``vocab.py``) adds the gathered target terms. With ``keep=True`` the
statistics also return the tiles' logits they computed, stacked
``[tiles, N, block_v]`` (``N * V`` floats, what materialised logits cost),
and the backward functions given them as ``kept`` read them instead of
recomputing: one matmul of the three per tile fewer, for memory
(``vocab.VocabOps.keep_logits_mib`` decides).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mopd_jax.ops import vocab_tiles as tiles

BLOCK_V = 1024


def tile_shape(n: int, v: int, block_v=None) -> tuple[int, int, int]:
  """``[tiles, n, block_v]``: the shape of one array of kept logits."""
  bv = min(block_v or BLOCK_V, v)
  return -(-v // bv), n, bv


def _loop(ws, block_v, body, init):
  """``fori_loop`` over the vocabulary tiles of the ``[d, V]`` arrays ``ws``.

  ``body(j, start, valid, w_tiles, carry) -> carry`` for tile ``j``, where
  ``valid [1, bv]`` marks the columns that belong to this tile.
  """
  v = ws[0].shape[1]
  bv = min(block_v or BLOCK_V, v)

  def step(j, carry):
    start = jnp.minimum(j * bv, v - bv)
    valid = (start + jnp.arange(bv) >= j * bv)[None, :]
    w_tiles = [jax.lax.dynamic_slice_in_dim(w, start, bv, axis=1) for w in ws]
    return body(j, start, valid, w_tiles, carry)

  return jax.lax.fori_loop(0, -(-v // bv), step, init)


def _kept_init(keep, n, v, block_v, count):
  """``count`` zero buffers for the kept logits, or None without ``keep``."""
  if not keep:
    return None
  return tuple(jnp.zeros(tile_shape(n, v, block_v), jnp.float32)
               for _ in range(count))


def _keep(kept, j, zs):
  """The buffers ``kept`` with tile ``j`` of each set to ``zs``."""
  if kept is None:
    return None
  return tuple(buf.at[j].set(z) for buf, z in zip(kept, zs))


def _tile(kept, i, j, recompute):
  """Tile ``j`` of the ``i``-th kept logits, else ``recompute()``."""
  return recompute() if kept is None else kept[i][j]


def _grads(h, w, others, block_v, cotangent):
  """``dh = G W^T`` and ``dw = h^T G`` in float32, tile by tile.

  ``cotangent(j, valid, w_tile, other_tiles) -> G_tile``: the cotangent of
  tile ``j``'s logits ``h @ w_tile`` (scale included); ``others`` are further
  ``[d', V]`` operands it needs (the teacher's unembedding).
  """
  def body(j, start, valid, w_tiles, carry):
    dh, dw = carry
    wt = w_tiles[0]
    g = cotangent(j, valid, wt, w_tiles[1:])
    # The float32 cotangent meets the upcast inputs, as in JAX's own
    # autodiff of materialised logits: only dh and dw are rounded.
    dh = dh + jnp.dot(g, wt.T.astype(jnp.float32))
    update = jnp.dot(h.T.astype(jnp.float32), g)
    old = jax.lax.dynamic_slice_in_dim(dw, start, update.shape[1], axis=1)
    # Masked columns of an overlapping last tile add 0, so adding is exact.
    dw = jax.lax.dynamic_update_slice_in_dim(dw, old + update, start, axis=1)
    return dh, dw

  init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32))
  return _loop([w, *others], block_v, body, init)


def lse_stats(h, w, *, scale, block_v=None, keep=False):
  """``(lse, entropy)`` of each row of ``z = scale * h @ w``, each ``[N, 1]``;
  with ``keep``, ``(lse, entropy, kept)``, ``kept`` the logits as a 1-tuple
  of ``[tiles, N, block_v]``."""
  def body(j, start, valid, w_tiles, carry):
    stats, kept = carry
    z = tiles.logits(h, w_tiles[0], scale, valid)
    return tiles.lse_update(stats, z, valid), _keep(kept, j, (z,))

  init = (tiles.lse_init(len(h)),
          _kept_init(keep, len(h), w.shape[1], block_v, 1))
  stats, kept = _loop([w], block_v, body, init)
  return tiles.lse_finish(stats) + ((kept,) if keep else ())


def lse_grads(h, w, lse, entropy, g_lse, g_entropy, *, scale, block_v=None,
              kept=None):
  """Float32 ``(dh, dw)`` from the cotangents of ``lse`` and ``entropy``.

  Row arrays are ``[N, 1]``; ``entropy`` and ``g_entropy`` may be None;
  ``kept``: ``lse_stats(..., keep=True)``'s logits, read instead of
  recomputed.
  """
  def cotangent(j, valid, wt, _):
    z = _tile(kept, 0, j, lambda: tiles.logits(h, wt, scale, valid))
    return scale * tiles.lse_cotangent(z, valid, lse, entropy, g_lse,
                                       g_entropy)

  return _grads(h, w, [], block_v, cotangent)


def kl_stats(hs, ws, ht, wt, *, scale, teacher_scale, block_v=None,
             keep=False):
  """``(lse_s, lse_t, KL(pi||T), KL(T||pi), H(T))`` per row, each ``[N, 1]``;
  with ``keep``, a sixth element: the student's and the teacher's logits,
  each ``[tiles, N, block_v]``."""
  def body(j, start, valid, w_tiles, carry):
    stats, kept = carry
    zs = tiles.logits(hs, w_tiles[0], scale, valid)
    zt = tiles.logits(ht, w_tiles[1], teacher_scale, valid)
    return tiles.kl_update(stats, zs, zt, valid), _keep(kept, j, (zs, zt))

  init = (tiles.kl_init(len(hs)),
          _kept_init(keep, len(hs), ws.shape[1], block_v, 2))
  stats, kept = _loop([ws, wt], block_v, body, init)
  return tiles.kl_finish(stats) + ((kept,) if keep else ())


def kl_grads(hs, ws, ht, wt, lse_s, lse_t, reverse, g_reverse, g_forward, *,
             scale, teacher_scale, block_v=None, kept=None):
  """Float32 ``(dh_s, dw_s)`` from the cotangents of both KLs (teacher
  fixed); ``kept``: ``kl_stats(..., keep=True)``'s logits."""
  def cotangent(j, valid, ws_tile, others):
    zs = _tile(kept, 0, j,
               lambda: tiles.logits(hs, ws_tile, scale, valid))
    zt = _tile(kept, 1, j,
               lambda: tiles.logits(ht, others[0], teacher_scale, valid))
    return scale * tiles.kl_cotangent(zs, zt, valid, lse_s, lse_t, reverse,
                                      g_reverse, g_forward)

  return _grads(hs, ws, [wt], block_v, cotangent)


def topk(h, w, k: int, *, scale, block_v=None):
  """Top-``k`` logits and their ids per row, and the row ``lse`` ``[N, 1]``.

  A running top-``k`` is merged with each tile's top-``k``; the running
  entries come first, so ties keep the lower id as ``lax.top_k`` on the full
  row does. Not differentiable (``vocab.py`` attaches the gradient).
  """
  n = len(h)

  def body(j, start, valid, w_tiles, carry):
    values, ids, stats = carry
    z = tiles.logits(h, w_tiles[0], scale, valid)
    tile_values, tile_ids = jax.lax.top_k(z, min(k, z.shape[1]))
    merged, pos = jax.lax.top_k(
        jnp.concatenate([values, tile_values], axis=1), k)
    ids = jnp.take_along_axis(
        jnp.concatenate([ids, start + tile_ids], axis=1), pos, axis=1)
    return merged, ids, tiles.lse_update(stats, z, valid)

  init = (jnp.full((n, k), -jnp.inf, jnp.float32), jnp.zeros((n, k), jnp.int32),
          tiles.lse_init(n))
  values, ids, stats = _loop([w], block_v, body, init)
  return values, ids, tiles.lse_finish(stats)[0]
