"""Decoder-only transformer as pure functions over a parameter pytree.

``init`` returns parameters whose leaves are ``flax.linen.LogicallyPartitioned``
boxes naming each axis (``vocab``, ``embed``, ``heads``, ...); ``nn.unbox``
gives the plain arrays that ``apply`` takes and that Merge adds and subtracts,
``nn.get_partition_spec`` gives the logical layout that ``parallel`` maps onto a
mesh. Layers are stacked on a leading ``layers`` axis and run with
``lax.scan`` so compile time does not grow with depth, or, with
``scan_layers`` off, as a loop over the layers sliced out once.

Batches are described by ``segment_ids`` (0 = padding, equal ids = one
sequence, so packed and padded batches are handled alike) and ``positions``
(RoPE positions, see ``positions_from_segments``). A token attends to earlier
slots of its own segment only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from mopd_jax import parallel
from mopd_jax.models import attention_kernels
from mopd_jax.models.config import ModelConfig

Params = Any


class KVCache(NamedTuple):
  """Keys/values of every layer, the segment id of each slot, next free slot.

  Heads come before slots, so that attention reads each (row, head) as one
  contiguous matrix, and keys are stored transposed ([head_dim, slots]),
  values not ([slots, head_dim]): both products, ``q k^T`` and ``p v``, are
  then plain ``[rows, n] x [n, m]`` matmuls, with no transpose of the cache
  at every decode step (XLA:CPU's dot packs a transposed operand afresh at
  each call: at SmolLM2-135M's batch 64 the scores took 3.2 ms of a
  layer's 8.5 with keys as [slots, head_dim], docs/performance.md).
  Stacked over layers, or, beside unstacked layers (``unstack_cache``),
  one buffer per layer."""
  # keys [layers, batch, kv_heads, head_dim, slots], values [layers, batch,
  # kv_heads, slots, head_dim], or tuples of the layers' buffers
  k: jax.Array | tuple
  v: jax.Array | tuple
  segment_ids: jax.Array  # [batch, slots]; 0 marks an empty or padding slot
  index: jax.Array  # int32 scalar: slot of the next token written


# Logical axes of one layer's cached keys and values (slots count as
# ``length``): keys transposed (``KVCache``).
KEY_AXES = ("batch", "kv_heads", "head_dim", "length")
VALUE_AXES = ("batch", "kv_heads", "length", "head_dim")


def _box(value, names):
  return nn.LogicallyPartitioned(value, names)


def init(cfg: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (boxed with logical axis names).

  Weights ~ N(0, 0.02^2); the residual-branch outputs (``o``, ``down``) are
  scaled by 1/sqrt(2 L) so the residual stream's variance does not grow with
  depth. Norm scales start at 1, biases at 0.
  """
  dt = jnp.dtype(cfg.param_dtype)
  L, D, H, K, Dh, F, V = (cfg.num_layers, cfg.embed_dim, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                          cfg.vocab_size)
  keys = iter(jax.random.split(key, 9))
  std, out_std = 0.02, 0.02 / (2 * L) ** 0.5

  def normal(shape, s):
    return (s * jax.random.normal(next(keys), shape)).astype(dt)

  layers = {
      "attn_norm": _box(jnp.ones((L, D), dt), ("layers", "norm")),
      "q": _box(normal((L, D, H, Dh), std),
                ("layers", "embed", "heads", "head_dim")),
      "k": _box(normal((L, D, K, Dh), std),
                ("layers", "embed", "kv_heads", "head_dim")),
      "v": _box(normal((L, D, K, Dh), std),
                ("layers", "embed", "kv_heads", "head_dim")),
      "o": _box(normal((L, H, Dh, D), out_std),
                ("layers", "heads", "head_dim", "embed")),
      "mlp_norm": _box(jnp.ones((L, D), dt), ("layers", "norm")),
      "gate": _box(normal((L, D, F), std), ("layers", "embed", "mlp")),
      "up": _box(normal((L, D, F), std), ("layers", "embed", "mlp")),
      "down": _box(normal((L, F, D), out_std), ("layers", "mlp", "embed")),
  }
  if cfg.attention_bias:
    layers["q_bias"] = _box(jnp.zeros((L, H, Dh), dt),
                            ("layers", "heads", "head_dim"))
    layers["k_bias"] = _box(jnp.zeros((L, K, Dh), dt),
                            ("layers", "kv_heads", "head_dim"))
    layers["v_bias"] = _box(jnp.zeros((L, K, Dh), dt),
                            ("layers", "kv_heads", "head_dim"))
  if cfg.qk_norm:
    layers["q_norm"] = _box(jnp.ones((L, Dh), dt), ("layers", "head_dim"))
    layers["k_norm"] = _box(jnp.ones((L, Dh), dt), ("layers", "head_dim"))
  params = {
      "embed": _box(normal((V, D), std), ("vocab", "embed")),
      "layers": layers,
      "final_norm": _box(jnp.ones((D,), dt), ("norm",)),
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = _box(normal((D, V), std), ("embed", "vocab"))
  return params


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """Plain (unboxed) random parameters."""
  return nn.unbox(init(cfg, key))


def logical_axes(cfg: ModelConfig) -> Params:
  """Pytree of ``PartitionSpec``s of logical axis names, shaped like params."""
  boxed = jax.eval_shape(lambda: init(cfg, jax.random.key(0)))
  return nn.get_partition_spec(boxed)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """``y = x / sqrt(mean(x^2) + eps) * scale``, computed in float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split layout (as Llama/Qwen in Hugging Face).

  With ``f_i = theta^(-2i/d)`` and ``phi = p * f``:
  ``rope(x) = x * cos(phi||phi) + rotate_half(x) * sin(phi||phi)``,
  ``rotate_half([x1, x2]) = [-x2, x1]``. ``x``: [B, T, heads, d].
  """
  d = x.shape[-1]
  inv_freq = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  phi = positions.astype(jnp.float32)[..., None] * inv_freq
  phi = jnp.concatenate([phi, phi], axis=-1)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * jnp.cos(phi) + rotated * jnp.sin(phi)).astype(x.dtype)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
  """Position of each token within its segment (0 at each segment start).

  Works for right padding, left padding and packing alike: a segment starts
  wherever the id differs from the previous token's. Padding gets positions
  too, which is harmless because padding is masked out of attention.
  """
  t = jnp.arange(segment_ids.shape[-1])
  prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = jnp.where(segment_ids != prev, t, 0)
  return t - jax.lax.cummax(starts, axis=1)


class Span(NamedTuple):
  """Who may attend to whom: the queries' segment ids and slots [B, T],
  the keys' segment ids [B, S] and slots [S]."""
  q_segments: jax.Array
  q_slots: jax.Array
  kv_segments: jax.Array
  kv_slots: jax.Array


def attention_mask(q_segments, q_slots, kv_segments, kv_slots) -> jax.Array:
  """``mask[b, t, s] = seg_kv[s] == seg_q[t] != 0  and  slot_kv[s] <= slot_q[t]``."""
  same = (q_segments[:, :, None] == kv_segments[:, None, :]) & (
      kv_segments[:, None, :] != 0)
  causal = kv_slots[None, None, :] <= q_slots[:, :, None]
  return same & causal


def _grouped(q, K):
  """[B, T, H, d] queries as [B, K, G*T, d]: each kv head's G query heads'
  T queries as the rows of one matrix."""
  B, T, H, d = q.shape
  return q.reshape(B, T, K, H // K, d).transpose(0, 2, 3, 1, 4).reshape(
      B, K, (H // K) * T, d)


def _ungrouped(out, T):
  """The inverse of ``_grouped``: [B, K, G*T, d] -> [B, T, H, d]."""
  B, K, R, d = out.shape
  return out.reshape(B, K, R // T, T, d).transpose(0, 3, 1, 2, 4).reshape(
      B, T, K * (R // T), d)


def attend(q, k, v, span: Span, chunk: int = 0, filled=None):
  """``softmax(q k^T / sqrt(d) + mask) v`` (``attention_mask`` of ``span``)
  of queries ``q`` [B, T, H, d] over keys ``k`` [B, K, d, S] (transposed,
  as the cache holds them) and values ``v`` [B, K, S, d]:
  with ``chunk`` 0 over all keys at once (``_attend``), else over blocks of
  ``chunk`` keys with an online softmax that never holds more than one
  block's scores and whose backward pass keeps memory linear in the
  length (``_attend_chunked``).
  ``filled`` (decoding from a cache, no gradient): the number of slots
  written so far; blocked attention then reads only the blocks that hold
  them (``_attend_filled``), not the empty rest of the cache."""
  if k.shape[2:] != (q.shape[3], v.shape[2]):
    raise ValueError(f"keys {k.shape}: not [B, K, d, S] beside queries"
                     f" {q.shape} and values {v.shape}")
  if chunk <= 0 or v.shape[2] <= chunk:
    return _attend(q, k, v, attention_mask(*span))
  if filled is not None:
    return _attend_filled(q, k, v, span, chunk, filled)
  return _attend_chunked(q, k, v, span, chunk)


def _online_block(carry, qg, kj, vj, mask):
  """One key block of the online softmax. With ``s_j = q k_j^T / sqrt(d)``
  (masked to -1e30), the running max ``m``, denominator ``l`` and output
  ``o``::

      m' = max(m, max s_j),  c = exp(m - m'),
      l' = c l + sum exp(s_j - m'),  o' = c o + exp(s_j - m') v_j

  ``qg``: grouped queries [B, K, G*T, d]; ``kj``: [B, K, d, c]; ``vj``:
  [B, K, c, d]; ``mask``: [B, T, c]."""
  m, l, o = carry
  s = _block_scores(qg, kj, mask)
  m_new = jnp.maximum(m, s.max(-1))
  scale = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new[..., None])
  o = scale[..., None] * o + jnp.einsum(
      "bkrs,bksd->bkrd", p.astype(vj.dtype), vj,
      preferred_element_type=jnp.float32)
  return m_new, scale * l + p.sum(-1), o


def _online_init(qg):
  B, K, R, d = qg.shape
  return (jnp.full((B, K, R), -jnp.inf, jnp.float32),
          jnp.zeros((B, K, R), jnp.float32),
          jnp.zeros((B, K, R, d), jnp.float32))


def _online_result(carry, v, T):
  _, l, o = carry
  return _ungrouped((o / l[..., None]).astype(v.dtype), T)


def _key_blocks(k, v, span: Span, chunk: int):
  """Keys ``k`` [B, K, d, S], values ``v`` [B, K, S, d] and their segment
  ids and slots as ``n = ceil(S / chunk)`` blocks along a leading axis
  (keys [n, B, K, d, c], values [n, B, K, c, d], segment ids [n, B, c],
  slots [n, c]), padded with segment 0 (never attended)."""
  B, S = v.shape[0], v.shape[2]
  n = -(-S // chunk)
  pad = n * chunk - S

  def split(x, axis):  # the slots' axis of x [B, K, ., .]
    x = jnp.pad(x, [(0, pad) if i == axis else (0, 0)
                    for i in range(x.ndim)])
    x = x.reshape(x.shape[:axis] + (n, chunk) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  return (split(k, 3), split(v, 2),
          jnp.pad(span.kv_segments, ((0, 0), (0, pad))).reshape(
              B, n, chunk).transpose(1, 0, 2),
          jnp.pad(span.kv_slots, (0, pad)).reshape(n, chunk))


def _masked(x, mask, fill):
  """``x`` [B, K, G*T, c] (grouped rows) where ``mask`` [B, T, c] holds,
  else ``fill``."""
  B, K, R, c = x.shape
  T = mask.shape[1]
  return jnp.where(mask[:, None, None], x.reshape(B, K, R // T, T, c),
                   fill).reshape(B, K, R, c)


def _block_scores(qg, kj, mask):
  """``s_j = q k_j^T / sqrt(d)`` (``kj`` transposed, [B, K, d, c]), masked
  to -1e30: [B, K, G*T, c]."""
  s = jnp.einsum("bkrd,bkds->bkrs", qg, kj,
                 preferred_element_type=jnp.float32) * qg.shape[-1] ** -0.5
  return _masked(s, mask, -1e30)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend_chunked(q, k, v, span: Span, chunk: int):
  """Blocked attention: ``_online_block`` over every block of ``chunk``
  keys and ``o / l`` at the end, the same softmax with ``[T, chunk]``
  scores at a time instead of ``[T, S]``. Its backward pass (flash
  attention's) keeps only ``o``, ``m`` and ``l``, linear in ``T``, and
  recomputes each block's probabilities from them."""
  return _chunked_forward(q, k, v, span, chunk)[0]


def _chunked_forward(q, k, v, span: Span, chunk: int):
  T, K = q.shape[1], v.shape[1]
  qg = _grouped(q, K)

  def step(carry, block):
    kj, vj, seg_j, slot_j = block
    mask = attention_mask(span.q_segments, span.q_slots, seg_j, slot_j)
    return _online_block(carry, qg, kj, vj, mask), None

  (m, l, o), _ = jax.lax.scan(step, _online_init(qg),
                              _key_blocks(k, v, span, chunk))
  out = o / l[..., None]
  return _ungrouped(out.astype(v.dtype), T), (q, k, v, span, out, m, l)


def _chunked_backward(chunk, saved, grad):
  """With ``P = exp(s - m) / l`` recomputed block by block, ``dO`` the
  output's cotangent and ``D = rowsum(dO * O)``::

      dV_j = P_j^T dO,  dS_j = P_j * (dO V_j^T - D)  (0 where masked),
      dQ = sum_j dS_j K_j / sqrt(d),  dK_j = dS_j^T Q / sqrt(d),

  ``dK_j`` computed transposed, in the keys' layout: ``Q^T dS_j``."""
  q, k, v, span, out, m, l = saved
  T, K, S, d = q.shape[1], v.shape[1], v.shape[2], q.shape[3]
  f32 = jnp.float32
  # Matmul operands stay in the inputs' dtype (bfloat16 on accelerators),
  # accumulated in float32, as in the forward pass.
  qg, dout = _grouped(q, K), _grouped(grad.astype(q.dtype), K)
  rowsum = jnp.sum(dout.astype(f32) * out, axis=-1)

  def step(dq, block):
    kj, vj, seg_j, slot_j = block
    mask = attention_mask(span.q_segments, span.q_slots, seg_j, slot_j)
    p = jnp.exp(_block_scores(qg, kj, mask) - m[..., None]) / l[..., None]
    dv = jnp.einsum("bkrs,bkrd->bksd", p.astype(v.dtype), dout,
                    preferred_element_type=f32)
    dp = jnp.einsum("bkrd,bksd->bkrs", dout, vj, preferred_element_type=f32)
    ds = _masked(p * (dp - rowsum[..., None]), mask, 0.0) * d ** -0.5
    ds = ds.astype(q.dtype)
    return (dq + jnp.einsum("bkrs,bkds->bkrd", ds, kj,
                            preferred_element_type=f32),
            (jnp.einsum("bkrs,bkrd->bkds", ds, qg,
                        preferred_element_type=f32), dv))

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, f32),
                              _key_blocks(k, v, span, chunk))

  def unblock(x, axis):  # the inverse of _key_blocks' split
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
    return jax.lax.slice_in_dim(x, 0, S, axis=axis)

  return (_ungrouped(dq, T).astype(q.dtype), unblock(dk, 3).astype(k.dtype),
          unblock(dv, 2).astype(v.dtype), None)


_attend_chunked.defvjp(
    lambda q, k, v, span, chunk: _chunked_forward(q, k, v, span, chunk),
    _chunked_backward)


def _attend_filled(q, k, v, span: Span, chunk: int, filled):
  """Blocked attention over the first ``ceil(filled / chunk)`` blocks of a
  cache of ``S >= chunk`` slots only (a loop whose length is traced, so
  forward only). The last block may start before ``j * chunk`` to stay
  inside the cache; its slots already seen are masked (segment 0)."""
  T, K, S = q.shape[1], v.shape[1], v.shape[2]
  qg = _grouped(q, K)

  def body(j, carry):
    start = jnp.minimum(j * chunk, S - chunk)
    slots = start + jnp.arange(chunk)
    seg = jax.lax.dynamic_slice_in_dim(span.kv_segments, start, chunk, 1)
    seg = jnp.where(slots >= j * chunk, seg, 0)
    mask = attention_mask(span.q_segments, span.q_slots, seg, slots)
    return _online_block(
        carry, qg, jax.lax.dynamic_slice_in_dim(k, start, chunk, 3),
        jax.lax.dynamic_slice_in_dim(v, start, chunk, 2), mask)

  carry = jax.lax.fori_loop(0, (filled + chunk - 1) // chunk, body,
                            _online_init(qg))
  return _online_result(carry, v, T)


def _attend(q, k, v, mask):
  """Grouped-query softmax attention; q: [B,T,H,d], k: [B,K,d,S] (keys
  transposed), v: [B,K,S,d].

  ``softmax(q k^T / sqrt(d) + mask) v`` with each group of G = H/K query
  heads sharing one key/value head. The G heads' T queries are the rows
  of one [G*T, d] matrix per (batch, kv head), so both products are plain
  batched matmuls (its forward measured 1.45x faster on CPU than keeping
  T and G apart, at T=1 and T=72). Masked scores get a large finite negative so a fully
  masked (padding) row stays finite.
  """
  scores = _block_scores(_grouped(q, v.shape[1]), k, mask)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return _ungrouped(jnp.einsum("bkrs,bksd->bkrd", probs, v), q.shape[1])


def dense(x, w):
  """``y[b, t] = x[b, t] w``: x [B, T, I], w [I, O] -> [B, T, O]."""
  return jnp.einsum("bti,io->bto", x, w)


def _matmul_fwd(x, w):
  return dense(x, w), (x, w)


def _matmul_bwd(saved, dy):
  """``dx = dy w^T`` and ``dw = sum_{b,t} x[b, t]^T dy[b, t]``, the latter
  as one dot that yields ``dw`` in ``w``'s own [I, O] layout, with which
  XLA:CPU runs the train step faster than with autodiff's backward pass
  of ``dense`` (docs/performance.md)."""
  x, w = saved
  return (jnp.einsum("bto,io->bti", dy, w),
          jnp.einsum("bti,bto->io", x, dy))


# ``dense`` with the backward pass above. A custom VJP has no forward-mode
# derivative: the model supports ``jax.grad``/``vjp``, not ``jvp``.
matmul = jax.custom_vjp(dense)
matmul.defvjp(_matmul_fwd, _matmul_bwd)


def project(x, w, n_in: int):
  """A projection: ``x``'s last ``n_in`` axes contracted with ``w``'s first
  ``n_in`` (``btd,dhk->bthk`` for q/k/v, ``bthk,hkd->btd`` for the output,
  ``btd,df->btf`` for the MLP), as one ``matmul`` over flattened axes."""
  B, T = x.shape[:2]
  inner = math.prod(w.shape[:n_in])
  y = matmul(x.reshape(B, T, inner), w.reshape(inner, -1))
  return y.reshape(B, T, *w.shape[n_in:])


def _cache_write(kv_cache, k, v, index):
  """``k_cache[..., index:index+T] = k`` (keys [B, K, d, T]) and
  ``v_cache[..., index:index+T, :] = v`` (values [B, K, T, d]), for
  ``kv_cache = (k_cache, v_cache, layer)``: with ``layer`` None this
  layer's own buffers, else the stacked ``[layers, ...]`` ones at
  ``layer``. Returns this layer's whole keys and values to attend over
  and the updated ``(k_cache, v_cache)``."""
  k_cache, v_cache, layer = kv_cache
  writes = ((k_cache, k, KEY_AXES, (0, 0, 0, index)),
            (v_cache, v, VALUE_AXES, (0, 0, index, 0)))
  if layer is None:
    k_all, v_all = (
        parallel.constrain(jax.lax.dynamic_update_slice(c, new, at), axes)
        for c, new, axes, at in writes)
    return k_all, v_all, (k_all, v_all)
  k_cache, v_cache = (
      parallel.constrain(jax.lax.dynamic_update_slice(
          c, new[None], (layer,) + at), ("layers",) + axes)
      for c, new, axes, at in writes)
  return k_cache[layer], v_cache[layer], (k_cache, v_cache)


def _layer(cfg: ModelConfig, x, p, positions, span, kv_cache, index):
  """One pre-norm block: ``x += Attn(norm(x)); x += SwiGLU(norm(x))``.

  ``kv_cache``: None, or ``(k, v, layer)`` with the whole stacked cache
  (``KVCache``'s layout): this layer's keys and values are written into
  it in place at slot ``index`` of ``layer`` and its slice is attended
  over (a stacked cache passed through ``scan``'s inputs and outputs
  instead is copied whole at every decode step: 1.5x slower sampling);
  with ``layer`` None, ``k`` and ``v`` are this layer's own buffers
  (``unstack_cache``), written and attended over with no slice copied
  out."""
  dt = x.dtype
  h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
  q, k, v = (project(h, p[name].astype(dt), 1) for name in "qkv")
  if cfg.attention_bias:
    q, k, v = (q + p["q_bias"].astype(dt), k + p["k_bias"].astype(dt),
               v + p["v_bias"].astype(dt))
  if cfg.qk_norm:
    q = rms_norm(q, p["q_norm"], cfg.norm_eps)
    k = rms_norm(k, p["k_norm"], cfg.norm_eps)
  q = rope(q, positions, cfg.rope_theta)
  k = rope(k, positions, cfg.rope_theta)
  v = v.transpose(0, 2, 1, 3)  # [B, K, T, d]
  if kv_cache is None and cfg.attention_impl != "xla":
    attn = attention_kernels.attend(q, k.transpose(0, 2, 1, 3), v,
                                    span.q_segments, cfg.attention_impl,
                                    cfg.attention_chunk)
  else:
    k = k.transpose(0, 2, 3, 1)  # [B, K, d, T]: transposed, as cached
    if kv_cache is not None:
      k, v, kv_cache = _cache_write(kv_cache, k, v, index)
    attn = attend(q, k, v, span, cfg.attention_chunk,
                  None if index is None else index + q.shape[1])
  x = x + project(attn, p["o"].astype(dt), 2)
  x = parallel.constrain(x, ("batch", "length", "embed"))
  h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
  gate = project(h, p["gate"].astype(dt), 1)
  up = project(h, p["up"].astype(dt), 1)
  act = parallel.constrain(jax.nn.silu(gate) * up,
                                   ("batch", "length", "mlp"))
  x = x + project(act, p["down"].astype(dt), 1)
  x = parallel.constrain(x, ("batch", "length", "embed"))
  return x, kv_cache


def hidden_states(params: Params, cfg: ModelConfig, tokens: jax.Array,
                  segment_ids: jax.Array, positions: jax.Array | None = None,
                  cache: KVCache | None = None):
  """Final-norm hidden states [B, T, D] and the updated cache (or None).

  Without a cache, ``tokens`` attend among themselves. With one, they are
  written at slots ``cache.index + [0, T)`` and attend to everything already
  cached, so a prefill followed by one-token decode steps equals one forward
  pass over the whole sequence.
  """
  if positions is None:
    positions = positions_from_segments(segment_ids)
  dt = jnp.dtype(cfg.dtype)
  T = tokens.shape[1]
  # Looked up in a replicated copy of the table (one all-gather, as FSDP
  # does for every weight it uses), so that each device gathers its own
  # batch rows: from a vocab- or embed-sharded table the gathered rows come
  # out split along ``embed``, and XLA has no efficient way from there to
  # the batch-split activations ("involuntary full rematerialization").
  table = parallel.constrain(params["embed"], (None, None))
  x = jnp.take(table, tokens, axis=0).astype(dt)
  x = parallel.constrain(x, ("batch", "length", "embed"))
  if cache is None:
    slots = jnp.arange(T)
    span = Span(segment_ids, slots[None].repeat(tokens.shape[0], 0),
                segment_ids, slots)
    index = None
  else:
    index = cache.index
    kv_segments = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids,
                                               (0, index))
    q_slots = (index + jnp.arange(T))[None].repeat(tokens.shape[0], 0)
    span = Span(segment_ids, q_slots, kv_segments,
                jnp.arange(cache.segment_ids.shape[1]))

  if cache is None:
    def layer(x, p):
      return _layer(cfg, x, p, positions, span, None, None)[0]

    layers = params["layers"]
    if not cfg.scan_layers and not isinstance(layers, (list, tuple)):
      # as many as the stacked arrays hold, as the scan would run
      layers = split_layers(layers, jax.tree.leaves(layers)[0].shape[0])
    unrolled = isinstance(layers, (list, tuple))
    if cfg.remat:
      # Keeps only each layer's input for the backward pass (inside a
      # scan, XLA's CSE cannot merge the recomputation away).
      layer = jax.checkpoint(layer, prevent_cse=unrolled)
    if unrolled:
      for p in layers:
        x = layer(x, p)
    else:
      x, _ = jax.lax.scan(lambda x, p: (layer(x, p), None), x, layers)
    return rms_norm(x, params["final_norm"], cfg.norm_eps), None

  def cached_body(carry, layer):
    x, k, v = carry
    p, i = layer
    x, (k, v) = _layer(cfg, x, p, positions, span, (k, v, i), index)
    return (x, k, v), None

  if isinstance(params["layers"], (list, tuple)):  # unstacked (the sampler)
    k, v = list(cache.k), list(cache.v)
    for i, p in enumerate(params["layers"]):
      x, (k[i], v[i]) = _layer(cfg, x, p, positions, span,
                               (k[i], v[i], None), index)
    k, v = tuple(k), tuple(v)
  else:
    (x, k, v), _ = jax.lax.scan(
        cached_body, (x, cache.k, cache.v),
        (params["layers"], jnp.arange(cfg.num_layers)))
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  return x, KVCache(k, v, kv_segments, index + T)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split_layers(layers: Params, num_layers: int) -> list:
  """The stacked ``[L, ...]`` layer tree as a list of ``L`` per-layer trees
  (one copy of the layers' parameters while it lives). Its derivative
  stacks the layers' gradients back into one array per weight, which
  XLA:CPU ran faster than the derivative of ``L`` slices (SmolLM2-135M's
  gradient: docs/performance.md)."""
  return [jax.tree.map(lambda a, i=i: a[i], layers)
          for i in range(num_layers)]


def _split_layers_fwd(layers, num_layers):
  return split_layers(layers, num_layers), None


def _split_layers_bwd(num_layers, _, grads):
  del num_layers
  return (jax.tree.map(lambda *g: jnp.stack(g), *grads),)


split_layers.defvjp(_split_layers_fwd, _split_layers_bwd)


def unstack_layers(params: Params, num_layers: int) -> Params:
  """``params`` with its stacked layers as a list of per-layer trees: a
  loop that runs many cached steps (the sampler's decode) takes each
  layer's weights as its own buffer, where a scan over the stacked arrays
  copies every layer's weights out of them at every step."""
  return dict(params, layers=split_layers(params["layers"], num_layers))


def unstack_cache(cache: KVCache) -> KVCache:
  """``cache`` with a buffer per layer, for unstacked layers
  (``unstack_layers``): a decode step then writes each layer's keys and
  values in place and attends over them directly, where slicing a layer
  out of the stacked cache copies it at every step (``bench_sampler.py``,
  the built-in model: 1.24x the tokens/s at batch 128 and 72 slots,
  1.25-1.34x at batch 32 and 512 slots; SmolLM2-135M at batch 16: no
  change)."""
  return cache._replace(k=tuple(cache.k), v=tuple(cache.v))


def output_weight(params: Params, cfg: ModelConfig) -> jax.Array:
  """The [D, V] output projection (the tied embedding, transposed, if tied)."""
  return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


def apply(params: Params, cfg: ModelConfig, tokens: jax.Array,
          segment_ids: jax.Array, positions: jax.Array | None = None,
          cache: KVCache | None = None):
  """Float32 logits [B, T, V] and the updated cache: ``logits = h W_out``."""
  h, cache = hidden_states(params, cfg, tokens, segment_ids, positions, cache)
  return unembed(params, cfg, h), cache


def unembed(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
  """Float32 logits [B, T, V] of hidden states [B, T, D]: ``h W_out``."""
  logits = jnp.einsum("btd,dv->btv", h, output_weight(params, cfg).astype(h.dtype),
                      preferred_element_type=jnp.float32)
  return parallel.constrain(logits, ("batch", "length", "vocab"))


def init_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
  """An empty cache of ``slots`` positions per sequence: keys [layers,
  batch, kv_heads, head_dim, slots], values [layers, batch, kv_heads,
  slots, head_dim], laid out by the logical axes ``layers`` + ``KEY_AXES``
  and ``VALUE_AXES`` on the mesh in scope."""
  heads = (cfg.num_layers, batch, cfg.num_kv_heads)
  return _laid_out(jnp.zeros(heads + (cfg.head_dim, slots), cfg.dtype),
                   jnp.zeros(heads + (slots, cfg.head_dim), cfg.dtype),
                   jnp.zeros((batch, slots), jnp.int32),
                   jnp.zeros((), jnp.int32))


def _laid_out(k, v, segment_ids, index) -> KVCache:
  """A cache of these arrays, each constrained to its logical axes
  (``init_cache``'s layout)."""
  return KVCache(parallel.constrain(k, ("layers",) + KEY_AXES),
                 parallel.constrain(v, ("layers",) + VALUE_AXES),
                 parallel.constrain(segment_ids.astype(jnp.int32),
                                    ("batch", "length")), index)


def extend_cache(cache: KVCache, slots: int) -> KVCache:
  """``cache`` grown to ``slots`` positions per sequence, the new ones
  empty (segment 0, never attended), laid out as ``init_cache``'s (or,
  unstacked, a buffer per layer as before): a prefill into a cache of
  the prompt's width attends over the prompt's slots only, not over those
  its completion will fill, and a decode's phases grow it as they go."""
  grow = slots - cache.segment_ids.shape[1]

  def pad(x, axis):  # axis counted from the end
    return jnp.pad(x, [(0, grow) if i == x.ndim + axis else (0, 0)
                       for i in range(x.ndim)])

  if isinstance(cache.k, tuple):  # unstack_cache's
    return cache._replace(k=tuple(pad(k, -1) for k in cache.k),
                          v=tuple(pad(v, -2) for v in cache.v),
                          segment_ids=pad(cache.segment_ids, -1))
  return _laid_out(pad(cache.k, -1), pad(cache.v, -2),
                   pad(cache.segment_ids, -1), cache.index)


def gather_cache(cache: KVCache, row: jax.Array, col: jax.Array,
                 segment_ids: jax.Array) -> KVCache:
  """The cache of a batch whose prompts were filled in packed rows
  (``rollout/packing.py``): slot ``s`` of batch row ``b`` is the packed
  cache's slot ``col[b, s]`` of row ``row[b, s]`` (``row``, ``col`` and
  the batch's ``segment_ids`` [B, W]; a slot of segment 0 is never
  attended, whatever it holds). For one device: on a mesh, gathering rows
  across the batch's shards would all-gather the cache."""
  k = cache.k[:, row, :, :, col].transpose(2, 0, 3, 4, 1)  # [L, B, K, d, W]
  v = cache.v[:, row, :, col, :].transpose(2, 0, 3, 1, 4)  # [L, B, K, W, d]
  return _laid_out(k, v, segment_ids, cache.index)
