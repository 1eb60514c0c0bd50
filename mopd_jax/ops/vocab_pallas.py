"""Pallas kernels of the fused vocabulary ops (GPU via Triton, TPU via Mosaic).

Every kernel reduces tile math from ``vocab_tiles`` over one axis of a
(row block, vocabulary tile) grid and accumulates into float32 outputs:

* forward statistics and ``dh``: each block of ``block_n`` rows walks all
  vocabulary tiles (outputs ``[N, width]``);
* ``dw``: each vocabulary tile walks all row blocks (outputs ``[width, V]``),
  so no two programs write the same output and no atomics are needed.

Two layouts of that reduction, chosen by the backend:

* ``"loop"`` (GPU/Triton): the grid covers the outer axis only and the kernel
  loops over the inner axis with ``fori_loop``, slicing the whole operand in
  global memory; GPU programs run concurrently, so a reduction may not span
  grid steps. Triton needs power-of-two blocks (>= 16 for ``dot``), hence
  ``d`` is zero-padded to a power of two (in both layouts); ``[block, d]``
  tiles stay resident, so default blocks shrink as ``d`` grows (see
  ``_geometry``). Correct on an H200 (the ops tests pass with the real
  kernels) but slower than the XLA path there.
* ``"grid"`` (TPU/Mosaic): the inner axis is the second, sequential
  (``"arbitrary"``) grid axis; the output block stays resident in VMEM across
  it and is initialised at its first step. Blocks are ``(8, 128)``-aligned.

Rows are zero-padded to a multiple of ``block_n`` and the vocabulary to one of
``block_v``; padded columns are masked to ``-inf`` from their ids, so no
kernel reads outside its operands. ``interpret=True`` runs the same kernels
with the Pallas interpreter (tests on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from mopd_jax.ops import vocab_tiles as tiles

BLOCKS = {"loop": (64, 128), "grid": (256, 512)}  # (block_n, block_v)
TRITON_TILE_BYTES = 64 * 1024


class _Geometry(NamedTuple):
  n: int
  v: int
  bn: int
  bv: int
  layout: str
  interpret: bool

  @property
  def n_pad(self):
    return -(-self.n // self.bn) * self.bn

  @property
  def v_pad(self):
    return -(-self.v // self.bv) * self.bv

  def valid(self, j):
    """``[1, bv]`` mask of the real vocabulary columns of tile ``j``."""
    cols = j * self.bv + jax.lax.broadcasted_iota(jnp.int32, (1, self.bv), 1)
    return cols < self.v


def default_layout() -> str:
  """``"grid"`` on TPU, ``"loop"`` elsewhere (GPU, and CPU interpretation)."""
  return "grid" if jax.default_backend() == "tpu" else "loop"


def _geometry(n, v, block_n, block_v, layout, interpret,
              widths) -> _Geometry:
  """Tiles of a kernel whose hidden operands have ``widths`` (their ``d``).

  Unset blocks of the GPU layout shrink with ``sum(d_pad)`` so that one
  float32 ``[block, sum(d_pad)]`` tile stays within ``TRITON_TILE_BYTES``
  (the kernels keep such tiles resident, and the H200's 227 KiB of shared
  memory per block overflowed with the fixed blocks at d=512), never below
  Triton's minimum of 16.
  """
  layout = layout or default_layout()
  bn, bv = BLOCKS[layout]
  if layout == "loop":
    width = sum(_padded_width(d) for d in widths)
    cap = max(16, 1 << ((TRITON_TILE_BYTES // (4 * width)).bit_length() - 1))
    bn, bv = min(bn, cap), min(bv, cap)
  return _Geometry(n, v, block_n or bn, block_v or bv, layout,
                   bool(interpret))


def _pad(x, axis, size):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _padded_width(d: int) -> int:
  """``d`` rounded up to a power of two >= 16 (Triton's ``dot``)."""
  return pl.next_power_of_2(max(d, 16))


def _hidden(h, geo):
  """``h`` padded to ``[n_pad, d_pad]``, ``d_pad = _padded_width(d)``."""
  return _pad(_pad(h, 0, geo.n_pad), 1, _padded_width(h.shape[1]))


def _unembedding(w, geo):
  return _pad(_pad(w, 0, _padded_width(w.shape[0])), 1, geo.v_pad)


def _row_stat(x, geo):
  return _pad(x.astype(jnp.float32), 0, geo.n_pad)


def _loop_kernel(step, init, n_rows, n_cols, n_inner, geo, over_vocab):
  """GPU layout: one program per outer block, ``fori_loop`` over the inner."""
  bn, bv = geo.bn, geo.bv

  def kernel(*refs):
    row_refs, col_refs, out_refs = (refs[:n_rows], refs[n_rows:n_rows + n_cols],
                                    refs[n_rows + n_cols:])
    outer = pl.program_id(0)
    if over_vocab:
      row_blocks = [r[...] for r in row_refs]

      def body(k, carry):
        start = pl.multiple_of(k * bv, bv)
        return step(k, row_blocks, [c[:, pl.ds(start, bv)] for c in col_refs],
                    carry)
    else:
      col_blocks = [c[...] for c in col_refs]

      def body(k, carry):
        start = pl.multiple_of(k * bn, bn)
        return step(outer, [r[pl.ds(start, bn), :] for r in row_refs],
                    col_blocks, carry)

    carry = tuple(jnp.full(r.shape, v, jnp.float32)
                  for r, v in zip(out_refs, init))
    for ref, value in zip(out_refs, jax.lax.fori_loop(0, n_inner, body, carry)):
      ref[...] = value

  return kernel


def _grid_kernel(step, init, n_rows, n_cols, over_vocab):
  """TPU layout: the inner blocks are the sequential second grid axis."""
  def kernel(*refs):
    row_refs, col_refs, out_refs = (refs[:n_rows], refs[n_rows:n_rows + n_cols],
                                    refs[n_rows + n_cols:])

    @pl.when(pl.program_id(1) == 0)
    def _():
      for ref, value in zip(out_refs, init):
        ref[...] = jnp.full(ref.shape, value, jnp.float32)

    j = pl.program_id(1 if over_vocab else 0)
    carry = step(j, [r[...] for r in row_refs], [c[...] for c in col_refs],
                 tuple(r[...] for r in out_refs))
    for ref, value in zip(out_refs, carry):
      ref[...] = value

  return kernel


def _reduce(step, init, rows, cols, widths, geo: _Geometry, over_vocab: bool):
  """Runs ``step`` over every (row block, vocabulary tile) pair.

  ``rows`` are ``[n_pad, *]`` arrays blocked by ``bn`` rows, ``cols`` are
  ``[*, v_pad]`` arrays blocked by ``bv`` columns. ``step(j, row_blocks,
  col_blocks, carry) -> carry`` for vocabulary tile ``j``; ``carry`` holds one
  float32 block per output, starting at the scalars ``init``. With
  ``over_vocab`` a row block reduces over the tiles (outputs
  ``[n_pad, width]``), otherwise a tile reduces over the row blocks (outputs
  ``[width, v_pad]``).
  """
  bn, bv = geo.bn, geo.bv
  ni, nj = geo.n_pad // bn, geo.v_pad // bv
  if over_vocab:
    out_shapes = [(geo.n_pad, w) for w in widths]
    out_blocks = [(bn, w) for w in widths]
  else:
    out_shapes = [(w, geo.v_pad) for w in widths]
    out_blocks = [(w, bv) for w in widths]

  def row_block(x):
    return (bn, x.shape[1])

  def col_block(x):
    return (x.shape[0], bv)

  if geo.layout == "loop":
    # Only the outer operand is blocked; the inner one is sliced in the loop.
    kernel = _loop_kernel(step, init, len(rows), len(cols),
                          nj if over_vocab else ni, geo, over_vocab)
    grid = (ni,) if over_vocab else (nj,)
    by_rows, by_cols, whole = ((lambda o: (o, 0)), (lambda o: (0, o)),
                               (lambda o: (0, 0)))
    if over_vocab:
      row_specs = [pl.BlockSpec(row_block(x), by_rows) for x in rows]
      col_specs = [pl.BlockSpec(x.shape, whole) for x in cols]
      out_map = by_rows
    else:
      row_specs = [pl.BlockSpec(x.shape, whole) for x in rows]
      col_specs = [pl.BlockSpec(col_block(x), by_cols) for x in cols]
      out_map = by_cols
    params = pltriton.CompilerParams(num_warps=4, num_stages=2)
  else:
    kernel = _grid_kernel(step, init, len(rows), len(cols), over_vocab)
    grid = (ni, nj) if over_vocab else (nj, ni)
    # Grid index (outer o, inner k): row block and vocabulary tile of a step.
    if over_vocab:
      row_map, col_map, out_map = ((lambda o, k: (o, 0)), (lambda o, k: (0, k)),
                                   (lambda o, k: (o, 0)))
    else:
      row_map, col_map, out_map = ((lambda o, k: (k, 0)), (lambda o, k: (0, o)),
                                   (lambda o, k: (0, o)))
    row_specs = [pl.BlockSpec(row_block(x), row_map) for x in rows]
    col_specs = [pl.BlockSpec(col_block(x), col_map) for x in cols]
    params = pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"))

  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct(s, jnp.float32) for s in out_shapes],
      grid=grid,
      in_specs=row_specs + col_specs,
      out_specs=[pl.BlockSpec(b, out_map) for b in out_blocks],
      compiler_params=params,
      interpret=geo.interpret,
  )(*rows, *cols)


def _grads(cotangent, rows, cols, geo, h_shape, w_shape):
  """``dh = G W^T`` and ``dw = h^T G`` for the tile cotangents ``G``.

  ``rows[0]`` is the padded student ``h`` and ``cols[0]`` its ``W``;
  ``cotangent(j, row_blocks, col_blocks) -> G`` (scale included), float32
  and multiplied by the upcast inputs as JAX's autodiff of materialised
  logits does. Returns float32 gradients cut back to ``h_shape``/``w_shape``.
  """
  def dh_step(j, row_blocks, col_blocks, carry):
    g = cotangent(j, row_blocks, col_blocks)
    w = col_blocks[0].astype(jnp.float32)
    return (carry[0] + jax.lax.dot_general(g, w, (((1,), (1,)), ((), ()))),)

  def dw_step(j, row_blocks, col_blocks, carry):
    g = cotangent(j, row_blocks, col_blocks)
    h = row_blocks[0].astype(jnp.float32)
    return (carry[0] + jax.lax.dot_general(h, g, (((0,), (0,)), ((), ()))),)

  d_pad = rows[0].shape[1]
  (dh,) = _reduce(dh_step, (0.0,), rows, cols, (d_pad,), geo, True)
  (dw,) = _reduce(dw_step, (0.0,), rows, cols, (d_pad,), geo, False)
  return (dh[:h_shape[0], :h_shape[1]], dw[:w_shape[0], :w_shape[1]])


def lse_stats(h, w, *, scale, block_v=None, block_n=None, layout=None,
              interpret=False):
  """``(lse, entropy)`` of each row of ``z = scale * h @ w``, each ``[N, 1]``.

  ``layout`` defaults to ``default_layout()``, blocks to ``BLOCKS[layout]``
  (smaller for a wide ``d`` on GPU: ``_geometry``).
  """
  geo = _geometry(len(h), w.shape[1], block_n, block_v, layout, interpret,
                  (h.shape[1],))

  def step(j, row_blocks, col_blocks, stats):
    valid = geo.valid(j)
    z = tiles.logits(row_blocks[0], col_blocks[0], scale, valid)
    return tiles.lse_update(stats, z, valid)

  stats = _reduce(step, (-jnp.inf, 0.0, 0.0), [_hidden(h, geo)],
                  [_unembedding(w, geo)], (1, 1, 1), geo, True)
  return tiles.lse_finish(tuple(s[:geo.n] for s in stats))


def lse_grads(h, w, lse, entropy, g_lse, g_entropy, *, scale, block_v=None,
              block_n=None, layout=None, interpret=False):
  """Float32 ``(dh, dw)`` from the cotangents of ``lse`` and ``entropy``.

  Row arrays are ``[N, 1]``; ``entropy`` and ``g_entropy`` may be None.
  """
  geo = _geometry(len(h), w.shape[1], block_n, block_v, layout, interpret,
                  (h.shape[1],))
  with_entropy = entropy is not None
  stats = [lse, g_lse] + ([entropy, g_entropy] if with_entropy else [])

  def cotangent(j, row_blocks, col_blocks):
    valid = geo.valid(j)
    hb, lse_b, g_lse_b, *ent = row_blocks
    z = tiles.logits(hb, col_blocks[0], scale, valid)
    ent_b, g_ent_b = ent if with_entropy else (None, None)
    return scale * tiles.lse_cotangent(z, valid, lse_b, ent_b, g_lse_b, g_ent_b)

  rows = [_hidden(h, geo)] + [_row_stat(s, geo) for s in stats]
  return _grads(cotangent, rows, [_unembedding(w, geo)], geo, h.shape, w.shape)


def kl_stats(hs, ws, ht, wt, *, scale, teacher_scale, block_v=None,
             block_n=None, layout=None, interpret=False):
  """``(lse_s, lse_t, KL(pi||T), KL(T||pi), H(T))`` per row, each ``[N, 1]``."""
  geo = _geometry(len(hs), ws.shape[1], block_n, block_v, layout, interpret,
                  (hs.shape[1], ht.shape[1]))

  def step(j, row_blocks, col_blocks, stats):
    valid = geo.valid(j)
    zs = tiles.logits(row_blocks[0], col_blocks[0], scale, valid)
    zt = tiles.logits(row_blocks[1], col_blocks[1], teacher_scale, valid)
    return tiles.kl_update(stats, zs, zt, valid)

  init = (-jnp.inf, 0.0, -jnp.inf, 0.0, 0.0, 0.0, 0.0)
  stats = _reduce(step, init, [_hidden(hs, geo), _hidden(ht, geo)],
                  [_unembedding(ws, geo), _unembedding(wt, geo)], (1,) * 7,
                  geo, True)
  return tiles.kl_finish(tuple(s[:geo.n] for s in stats))


def kl_grads(hs, ws, ht, wt, lse_s, lse_t, reverse, g_reverse, g_forward, *,
             scale, teacher_scale, block_v=None, block_n=None, layout=None,
             interpret=False):
  """Float32 ``(dh_s, dw_s)`` from the cotangents of both KLs (teacher fixed)."""
  geo = _geometry(len(hs), ws.shape[1], block_n, block_v, layout, interpret,
                  (hs.shape[1], ht.shape[1]))

  def cotangent(j, row_blocks, col_blocks):
    valid = geo.valid(j)
    hs_b, ht_b, lse_s_b, lse_t_b, rev_b, g_rev_b, g_fwd_b = row_blocks
    zs = tiles.logits(hs_b, col_blocks[0], scale, valid)
    zt = tiles.logits(ht_b, col_blocks[1], teacher_scale, valid)
    return scale * tiles.kl_cotangent(zs, zt, valid, lse_s_b, lse_t_b, rev_b,
                                      g_rev_b, g_fwd_b)

  stats = [lse_s, lse_t, reverse, g_reverse, g_forward]
  rows = [_hidden(hs, geo), _hidden(ht, geo)] + [_row_stat(s, geo)
                                                 for s in stats]
  cols = [_unembedding(ws, geo), _unembedding(wt, geo)]
  return _grads(cotangent, rows, cols, geo, hs.shape, ws.shape)
