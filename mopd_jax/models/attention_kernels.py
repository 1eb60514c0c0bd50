"""Self-attention by a fused kernel library instead of XLA ops
(``model.attention_impl``), for a forward pass without a KV cache (training,
scoring, evaluation's log-probs):

* ``splash``: the Pallas TPU splash-attention kernel (flash attention with
  block-sparse masks; a Mosaic kernel on TPU, run in Pallas's interpreter
  elsewhere, which is how the tests check it on CPU);
* ``cudnn``: ``jax.nn.dot_product_attention`` with cuDNN's flash attention
  on GPU (bfloat16 only), and that function's XLA implementation elsewhere.

Both compute ``softmax(q k^T / sqrt(d) + mask) v`` with
``mask[t, s] = seg[s] == seg[t] and s <= t``: padding (segment 0) attends to
padding, so no row is empty. Real tokens never attend to padding, so their
outputs are those of ``decoder.attend``; the padding rows' outputs differ
and are never used. Under a mesh each device runs the kernel on its own
batch rows (and its own heads, where the tensor axis divides the key/value
heads), through ``shard_map``: XLA cannot partition a custom kernel itself.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mopd_jax import parallel

# Splash's query and key blocks are multiples of the lane width of a TPU's
# vector unit (its kernel refuses others).
_LANES = 128


def attend(q, k, v, segments, impl: str, block: int = 0):
  """Attention of ``q`` [B, T, H, d] over ``k``, ``v`` [B, K, T, d] (K
  key/value heads shared by H / K query heads each) with segment ids
  ``segments`` [B, T]; ``impl``: ``splash`` or ``cudnn``; ``block``:
  splash's block length (0: 512; rounded up to a multiple of 128)."""
  fn = {"splash": functools.partial(_splash, block=block or 512),
        "cudnn": _dot_product}[impl]
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q, k, v, segments)
  sizes = dict(mesh.shape)
  batch = parallel.mesh_spec(sizes, ("batch",), q.shape[:1])[0]
  heads = parallel.mesh_spec(sizes, ("kv_heads",), k.shape[1:2])[0]
  q_spec, kv_spec = P(batch, None, heads), P(batch, heads)
  return jax.shard_map(fn, mesh=mesh,
                       in_specs=(q_spec, kv_spec, kv_spec, P(batch)),
                       out_specs=q_spec, check_vma=False)(q, k, v, segments)


def _splash(q, k, v, segments, block: int):
  """Splash attention, one batch row at a time (``vmap``); rows padded
  to a multiple of the block length with segment 0. Off TPU the kernel
  runs in Pallas's interpreter: right, and far slower than ``xla``."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash,
      splash_attention_mask as splash_mask,
  )
  interpret = jax.default_backend() != "tpu"
  if interpret:
    warnings.warn("attention_impl=splash off TPU runs in Pallas's"
                  " interpreter (slow: meant for tests)", stacklevel=2)
  B, T, H, d = q.shape
  bq = min(_round_up(block, _LANES), _round_up(T, _LANES))
  length = _round_up(T, bq)
  pad = length - T
  mask = splash_mask.MultiHeadMask(
      [splash_mask.CausalMask((length, length)) for _ in range(H)])
  sizes = splash.BlockSizes(
      block_q=bq, block_kv=bq, block_kv_compute=bq, block_q_dkv=bq,
      block_kv_dkv=bq, block_kv_dkv_compute=bq, block_q_dq=bq, block_kv_dq=bq)
  kernel = splash.make_splash_mha(
      mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
      interpret=interpret)
  seg = jnp.pad(segments, ((0, 0), (0, pad)))
  q = jnp.pad((q.astype(jnp.float32) * d ** -0.5).astype(q.dtype),
              ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (k, v))
  out = jax.vmap(lambda q, k, v, s: kernel(
      q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s)))(q, k, v, seg)
  return out.transpose(0, 2, 1, 3)[:, :T]


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _dot_product(q, k, v, segments):
  """``jax.nn.dot_product_attention``: cuDNN on GPU, XLA elsewhere; the
  segment mask becomes cuDNN's additive bias, ``is_causal`` lets cuDNN
  skip the blocks above the diagonal."""
  T = q.shape[1]
  mask = (segments[:, :, None] == segments[:, None, :]) & jnp.tril(
      jnp.ones((T, T), bool))
  return jax.nn.dot_product_attention(
      q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
      mask=mask[:, None], is_causal=True,
      implementation="cudnn" if jax.default_backend() == "gpu" else "xla")
