"""Pallas kernels, in interpret mode on CPU, against materialised float64; and
the same kernels (interpret off) lowered for GPU (Triton) and TPU (Mosaic)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.ops import vocab, vocab_pallas
from mopd_jax.ops import vocab_naive as naive
from mopd_jax.ops.vocab_naive import rel_err

# Ragged everywhere: 2 row blocks, 3 vocabulary tiles, d padded 12 -> 16.
N, D, D_T, V = 21, 12, 20, 150
TILES = {"block_n": 16, "block_v": 64}


def normal(rng, *shape, scale=1.0):
  return (scale * rng.normal(size=shape)).astype(np.float32)


def to64(*xs):
  return [jnp.asarray(x, jnp.float64) for x in xs]


@pytest.mark.parametrize("layout,dtype", [("loop", jnp.float32),
                                          ("grid", jnp.float32),
                                          ("loop", jnp.bfloat16)])
def test_lse_entropy_kernels(layout, dtype):
  rng = np.random.default_rng(0)
  h = jnp.asarray(normal(rng, N, D), dtype)
  w = jnp.asarray(normal(rng, D, V, scale=0.6), dtype)
  g_lse, g_ent = normal(rng, N, 1), normal(rng, N, 1)
  kw = dict(scale=0.8, layout=layout, interpret=True, **TILES)

  @jax.jit
  def run(h, w):
    lse, ent = vocab_pallas.lse_stats(h, w, **kw)
    return (lse, ent), vocab_pallas.lse_grads(h, w, lse, ent, g_lse, g_ent,
                                              **kw)

  (lse, ent), (dh, dw) = run(h, w)
  with jax.enable_x64(True):
    def stats(h, w):
      z = naive.logits(h, w, 0.8)
      lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
      ent = lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, -1, keepdims=True)
      return jnp.sum(g_lse * lse) + jnp.sum(g_ent * ent), (lse, ent)

    h64, w64 = to64(np.asarray(h, np.float32), np.asarray(w, np.float32))
    ref_grads, ref_stats = jax.jit(jax.grad(stats, (0, 1), has_aux=True))(
        h64, w64)
  # float32 gradients, rounded to bfloat16 only by the caller: 1e-5 either way.
  for got, want in [(lse, ref_stats[0]), (ent, ref_stats[1]),
                    (dh, ref_grads[0]), (dw, ref_grads[1])]:
    assert got.dtype == jnp.float32 and rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("layout", ["loop", "grid"])
def test_kl_kernels(layout):
  rng = np.random.default_rng(1)
  hs, ws = normal(rng, N, D), normal(rng, D, V, scale=0.6)
  ht, wt = normal(rng, N, D_T), normal(rng, D_T, V, scale=0.5)
  g_rev, g_fwd = normal(rng, N, 1), normal(rng, N, 1)
  kw = dict(scale=1.1, teacher_scale=0.9, layout=layout, interpret=True,
            **TILES)

  @jax.jit
  def run(hs, ws):
    lse_s, lse_t, rev, fwd, ent = vocab_pallas.kl_stats(hs, ws, ht, wt, **kw)
    return (rev, fwd, ent), vocab_pallas.kl_grads(
        hs, ws, ht, wt, lse_s, lse_t, rev, g_rev, g_fwd, **kw)

  (rev, fwd, ent), (dh, dw) = run(hs, ws)
  with jax.enable_x64(True):
    def loss(hs, ws):
      outs = naive.kl(hs, ws, *to64(ht, wt), 1.1, 0.9)
      return jnp.sum(g_rev[:, 0] * outs[0]) + jnp.sum(g_fwd[:, 0] * outs[1]), outs

    ref_grads, ref_outs = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(
        *to64(hs, ws))
  for got, want in [(rev, ref_outs[0]), (fwd, ref_outs[1]), (ent, ref_outs[2]),
                    (dh, ref_grads[0]), (dw, ref_grads[1])]:
    assert rel_err(got[..., 0] if got.shape[-1] == 1 else got, want) <= 1e-5


def test_public_op_on_pallas_matches_xla():
  """``impl="pallas"`` wiring (interpreted on CPU): mask, no entropy."""
  rng = np.random.default_rng(2)
  h, w = normal(rng, N, D), normal(rng, D, V, scale=0.6)
  targets = rng.integers(0, V, N).astype(np.int32)
  keep = np.arange(N) % 5 != 1
  c = normal(rng, N)

  def grads(impl):
    def loss(h, w):
      logp = vocab.token_logprobs(h, w, targets, mask=keep,
                                  ops=vocab.VocabOps(impl, **TILES))
      return jnp.sum(c * logp), logp
    return jax.jit(jax.grad(loss, (0, 1), has_aux=True))(h, w)

  for got, want in zip(jax.tree.leaves(grads("pallas")),
                       jax.tree.leaves(grads("xla"))):
    assert rel_err(got, want) <= 1e-5


def _target_gpu(platform: str):
  """From jax 0.11 Triton lowering reads the GPU's kind from the device, or
  on a host without one from an abstract mesh's device: name an H100."""
  if platform != "cuda" or not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100",
                                       num_cores=None, platform="cuda")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      (1,), ("x",), abstract_device=device))


@pytest.mark.parametrize("layout,platform", [("loop", "cuda"),
                                             ("grid", "tpu")])
def test_kernels_lower_for_accelerators(layout, platform):
  """The non-interpreted kernels pass Triton / Mosaic lowering (no device)."""
  h, w = jnp.zeros((300, 48), jnp.bfloat16), jnp.zeros((48, 1500), jnp.bfloat16)
  ht, wt = jnp.zeros((300, 64), jnp.bfloat16), jnp.zeros((64, 1500),
                                                         jnp.bfloat16)
  r = jnp.zeros((300, 1), jnp.float32)
  kw = {"scale": 0.5, "layout": layout, "interpret": False}
  kl_kw = dict(kw, teacher_scale=1.0)

  def everything():
    return (vocab_pallas.lse_stats(h, w, **kw),
            vocab_pallas.lse_grads(h, w, r, r, r, r, **kw),
            vocab_pallas.lse_grads(h, w, r, None, r, None, **kw),
            vocab_pallas.kl_stats(h, w, ht, wt, **kl_kw),
            vocab_pallas.kl_grads(h, w, ht, wt, r, r, r, r, r, **kl_kw))

  with _target_gpu(platform):
    text = jax.jit(everything).trace().lower(
        lowering_platforms=(platform,)).as_text()
  target = "xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
  assert text.count(target) == 8  # 2 forward kernels, 3 x (dh, dw)


def test_gpu_tiles_shrink_with_the_hidden_width():
  """Default Triton tiles keep a float32 [block, sum(d_pad)] tile within
  TRITON_TILE_BYTES (fixed 64 x 128 blocks overflowed an H200's shared
  memory at d=512); explicit blocks and the TPU layout are left alone."""
  def blocks(widths, layout="loop", **kw):
    g = vocab_pallas._geometry(100, 1000, kw.get("bn"), kw.get("bv"), layout,
                               False, widths)
    return g.bn, g.bv

  assert blocks((128,)) == vocab_pallas.BLOCKS["loop"]
  assert blocks((48,)) == vocab_pallas.BLOCKS["loop"]
  assert blocks((512,)) == (32, 32)
  assert blocks((512, 300)) == (16, 16)
  assert blocks((8192,)) == (16, 16)
  for widths in [(128,), (256,), (512,), (512, 512)]:
    bn, bv = blocks(widths)
    width = sum(max(16, 1 << (d - 1).bit_length()) for d in widths)
    assert max(bn, bv) * width * 4 <= vocab_pallas.TRITON_TILE_BYTES
  assert blocks((512,), bn=64, bv=128) == (64, 128)
  assert blocks((8192,), layout="grid") == vocab_pallas.BLOCKS["grid"]
