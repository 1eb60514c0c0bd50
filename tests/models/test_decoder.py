"""The decoder against an independent numpy implementation, and the cache,
padding and packing paths against one plain forward pass."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import parallel
from mopd_jax.models import attention_kernels, decoder
from mopd_jax.models.config import ModelConfig

VARIANTS = {
    "llama": ModelConfig(vocab_size=40, embed_dim=32, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=48),
    "qwen2": ModelConfig(vocab_size=40, embed_dim=32, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=8, mlp_dim=48,
                         attention_bias=True, tie_embeddings=False,
                         rope_theta=1e6),
    "qwen3": ModelConfig(vocab_size=40, embed_dim=32, num_layers=2,
                         num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=48,
                         qk_norm=True),
}


def _random_params(cfg, seed=0):
  """Init params with every leaf (norms and biases too) perturbed."""
  params = decoder.init_params(cfg, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape) for x, k in
            zip(leaves, keys)]
  return jax.tree.unflatten(tree, leaves)


def _np_rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _np_rope(x, pos, theta):
  d = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  ang = pos[:, None] * inv[None]
  cos, sin = np.cos(ang), np.sin(ang)
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  c, s = cos[:, None], sin[:, None]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def numpy_forward(params, cfg, tokens):
  """One unpadded sequence, written out loop by loop (the reference)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  T = len(tokens)
  pos = np.arange(T, dtype=np.float64)
  x = p["embed"][tokens]
  lay = p["layers"]
  group = cfg.num_heads // cfg.num_kv_heads
  for l in range(cfg.num_layers):
    h = _np_rms(x, lay["attn_norm"][l], cfg.norm_eps)
    heads = []
    for hq in range(cfg.num_heads):
      hk = hq // group
      q = h @ lay["q"][l][:, hq]
      k = h @ lay["k"][l][:, hk]
      v = h @ lay["v"][l][:, hk]
      if cfg.attention_bias:
        q, k, v = (q + lay["q_bias"][l][hq], k + lay["k_bias"][l][hk],
                   v + lay["v_bias"][l][hk])
      if cfg.qk_norm:
        q = _np_rms(q, lay["q_norm"][l], cfg.norm_eps)
        k = _np_rms(k, lay["k_norm"][l], cfg.norm_eps)
      q = _np_rope(q[:, None], pos, cfg.rope_theta)[:, 0]
      k = _np_rope(k[:, None], pos, cfg.rope_theta)[:, 0]
      s = q @ k.T / np.sqrt(cfg.head_dim)
      s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      heads.append(w @ v @ lay["o"][l][hq])
    x = x + sum(heads)
    h = _np_rms(x, lay["mlp_norm"][l], cfg.norm_eps)
    g = h @ lay["gate"][l]
    x = x + (g / (1 + np.exp(-g)) * (h @ lay["up"][l])) @ lay["down"][l]
  x = _np_rms(x, p["final_norm"], cfg.norm_eps)
  w_out = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
  return x @ w_out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_matches_numpy_reference(name):
  cfg = VARIANTS[name]
  params = _random_params(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 11)
  logits, _ = decoder.apply(params, cfg, jnp.asarray(tokens)[None],
                            jnp.ones((1, 11), jnp.int32))
  ref = numpy_forward(params, cfg, tokens)
  np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("unstacked", [False, True])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefill_then_decode_equals_full_forward(name, unstacked):
  """Also with the sampler's CPU path: the prompt prefilled into a cache
  of its own width, grown for the rest (``extend_cache``), and the decode
  steps on unstacked layers and a buffer per layer (``unstack_cache``)."""
  cfg = VARIANTS[name]
  params = _random_params(cfg)
  B, T, split = 3, 12, 5
  tokens = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)
  pad = jnp.array([0, 2, 4])  # left padding per row
  segments = (jnp.arange(T)[None] >= pad[:, None]).astype(jnp.int32)
  positions = decoder.positions_from_segments(segments)
  full, _ = decoder.apply(params, cfg, tokens, segments)
  cache = decoder.init_cache(cfg, B, T + 3)
  # keys transposed, values not (the layout decode's speed rests on)
  head = (cfg.num_layers, B, cfg.num_kv_heads)
  assert cache.k.shape == head + (cfg.head_dim, T + 3)
  assert cache.v.shape == head + (T + 3, cfg.head_dim)
  if unstacked:
    cache = decoder.init_cache(cfg, B, split)
  out, cache = decoder.apply(params, cfg, tokens[:, :split],
                             segments[:, :split], positions[:, :split], cache)
  steps = [out]
  if unstacked:
    cache = decoder.extend_cache(cache, T + 3)
    assert cache.k.shape == head + (cfg.head_dim, T + 3)
    params = decoder.unstack_layers(params, cfg.num_layers)
    cache = decoder.unstack_cache(cache)
  for t in range(split, T):
    out, cache = decoder.apply(params, cfg, tokens[:, t:t + 1],
                               segments[:, t:t + 1], positions[:, t:t + 1],
                               cache)
    steps.append(out)
  incremental = jnp.concatenate(steps, axis=1)
  valid = np.asarray(segments, bool)
  np.testing.assert_allclose(np.asarray(incremental)[valid],
                             np.asarray(full)[valid], atol=1e-5)
  assert int(cache.index) == T
  assert isinstance(cache.k, tuple) == unstacked


def test_left_padding_and_packing_do_not_change_logits():
  cfg = VARIANTS["llama"]
  params = _random_params(cfg)
  a = jnp.array([5, 6, 7, 8, 9])
  b = jnp.array([11, 12, 13])
  alone_a, _ = decoder.apply(params, cfg, a[None], jnp.ones((1, 5), jnp.int32))
  alone_b, _ = decoder.apply(params, cfg, b[None], jnp.ones((1, 3), jnp.int32))
  # Packed: [a a a a a b b b 0 0], segments 1..1 2 2 2 0 0.
  packed = jnp.concatenate([a, b, jnp.zeros(2, jnp.int32)])[None]
  seg = jnp.array([[1] * 5 + [2] * 3 + [0] * 2])
  out, _ = decoder.apply(params, cfg, packed, seg)
  np.testing.assert_allclose(out[0, :5], alone_a[0], atol=1e-5)
  np.testing.assert_allclose(out[0, 5:8], alone_b[0], atol=1e-5)
  # Left padded b.
  left = jnp.concatenate([jnp.zeros(2, jnp.int32), b])[None]
  out, _ = decoder.apply(params, cfg, left, jnp.array([[0, 0, 1, 1, 1]]))
  np.testing.assert_allclose(out[0, 2:], alone_b[0], atol=1e-5)
  assert np.all(np.isfinite(np.asarray(out)))


def test_positions_from_segments():
  seg = jnp.array([[0, 0, 1, 1, 1], [1, 1, 2, 2, 0], [3, 3, 3, 3, 3]])
  np.testing.assert_array_equal(
      decoder.positions_from_segments(seg),
      [[0, 1, 0, 1, 2], [0, 1, 0, 1, 0], [0, 1, 2, 3, 4]])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logical_axes_name_every_dimension(name):
  cfg = VARIANTS[name]
  params = decoder.init_params(cfg, jax.random.key(0))
  axes = decoder.logical_axes(cfg)
  flat_p = jax.tree.leaves(params)
  flat_a = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec))
  assert len(flat_p) == len(flat_a)
  for p, spec in zip(flat_p, flat_a):
    assert len(spec) == p.ndim and all(isinstance(n, str) for n in spec)
  assert sum(p.size for p in flat_p) == cfg.num_params()


@pytest.mark.parametrize("x_shape,w_shape,n_in,spec", [
    ((2, 5, 6), (6, 7), 1, "bti,io->bto"),  # MLP
    ((2, 5, 6), (6, 3, 4), 1, "bti,ihk->bthk"),  # q / k / v
    ((2, 5, 3, 4), (3, 4, 6), 2, "bthk,hko->bto"),  # attention output
])
def test_projection_values_and_gradients_match_numpy(x_shape, w_shape, n_in,
                                                     spec):
  """``project`` and its written-out backward pass against float64 numpy:
  ``y = x w``, ``dx = dy w^T``, ``dw = sum_{b,t} x^T dy``."""
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=x_shape), rng.normal(size=w_shape)
  y_np = np.einsum(spec, x, w)
  dy = rng.normal(size=y_np.shape)
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  dx_np = np.einsum(f"{out},{ws}->{xs}", dy, w)
  dw_np = np.einsum(f"{xs},{out}->{ws}", x, dy)
  y, vjp = jax.vjp(functools.partial(decoder.project, n_in=n_in),
                   jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
  dx, dw = vjp(jnp.asarray(dy, jnp.float32))
  for got, want in ((y, y_np), (dx, dx_np), (dw, dw_np)):
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_written_out_backward_equals_autodiff_under_remat(dtype):
  """``matmul``'s backward pass against autodiff's of ``dense`` (the same
  forward), through ``jax.checkpoint`` as remat runs it, in the model's
  compute dtypes."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(3, 7, 16)), dtype)
  w = jnp.asarray(rng.normal(size=(16, 24)), dtype)

  def loss(f, x, w):
    y = jax.checkpoint(f)(x, w).astype(jnp.float32)
    return jnp.sum(jnp.sin(y))

  got = jax.grad(functools.partial(loss, decoder.matmul), (0, 1))(x, w)
  want = jax.grad(functools.partial(loss, decoder.dense), (0, 1))(x, w)
  tol = 1e-6 if dtype == "float32" else 1e-2
  for g, r in zip(got, want):
    assert g.dtype == r.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(g, np.float32),
                               np.asarray(r, np.float32), rtol=tol,
                               atol=tol)


def test_remat_keeps_gradients_and_saves_activation_memory():
  """Per-layer rematerialisation: the same loss and gradients, and less
  temporary memory in the compiled backward pass of a deeper model."""
  base = ModelConfig(vocab_size=40, embed_dim=32, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=8, mlp_dim=128)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 64)))
  segments = jnp.ones_like(tokens)
  params = _random_params(base)

  def loss(p, cfg):
    h, _ = decoder.hidden_states(p, cfg, tokens, segments)
    return jnp.sum(h ** 2)

  results, temp = {}, {}
  for remat in (False, True):
    cfg = dataclasses.replace(base, remat=remat)
    fn = jax.jit(jax.value_and_grad(functools.partial(loss, cfg=cfg)))
    results[remat] = fn(params)
    temp[remat] = fn.lower(params).compile().memory_analysis(
        ).temp_size_in_bytes
  for a, b in zip(jax.tree.leaves(results[True]),
                  jax.tree.leaves(results[False])):
    # Recomputed in another order: float32 rounding, not a different value.
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3,
                               atol=1e-3)
  assert temp[True] < 0.7 * temp[False], temp


@pytest.mark.parametrize("remat", [False, True])
def test_unscanned_layers_equal_the_scan_with_gradients(remat):
  """``scan_layers=False`` (a loop over the layers sliced out once) gives
  the scan's hidden states and gradients, and ``split_layers``' written-out
  derivative (the layers' gradients stacked) equals autodiff's of the
  slices."""
  base = ModelConfig(vocab_size=40, embed_dim=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, mlp_dim=64, remat=remat)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, (2, 19)))
  segments = jnp.asarray(np.r_[[[0] * 4 + [1] * 15], [[1] * 10 + [2] * 9]])
  params = _random_params(base)

  def loss(p, cfg):
    h, _ = decoder.hidden_states(p, cfg, tokens, segments)
    return _weighted_sum(h, (segments != 0)[..., None])

  got = {scan: jax.jit(jax.value_and_grad(functools.partial(
      loss, cfg=dataclasses.replace(base, scan_layers=scan))))(params)
         for scan in (True, False)}
  for a, b in zip(jax.tree.leaves(got[False]), jax.tree.leaves(got[True])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                               atol=2e-5)

  def sliced(layers):  # autodiff's derivative of the slices
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(3)]

  def weighted(split):
    return lambda layers: sum(
        jnp.sum(leaf * (i + 1) * jnp.cos(leaf))
        for i, layer in enumerate(split(layers))
        for leaf in jax.tree.leaves(layer))

  mine = jax.grad(weighted(lambda l: decoder.split_layers(l, 3)))(
      params["layers"])
  ref = jax.grad(weighted(sliced))(params["layers"])
  for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
    assert a.shape == b.shape and a.shape[0] == 3
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def _packed_case():
  """Packed, left-padded rows with grouped queries (23 keys), and a loss
  over the real rows' outputs (padding rows are arbitrary)."""
  rng = np.random.default_rng(0)
  B, T, H, K, d = 3, 23, 4, 2, 8
  q = jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(B, K, T, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, K, T, d)), jnp.float32)
  segments = np.ones((B, T), np.int32)
  segments[1, :7] = 0  # left padding
  segments[2, 12:] = 2  # two packed sequences
  segments = jnp.asarray(segments)
  slots = jnp.arange(T)
  span = decoder.Span(segments, slots[None].repeat(B, 0), segments, slots)
  valid = (segments != 0)[:, :, None, None]

  def loss(q, k, v, chunk):
    return _weighted_sum(
        decoder.attend(q, k.swapaxes(2, 3), v, span, chunk), valid)

  return (q, k, v), span, valid, loss


def _weighted_sum(out, valid):
  """A scalar of the real rows' outputs that weighs every entry apart."""
  out = out.astype(jnp.float32) * valid
  return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_attention_equals_dense_with_gradients(chunk):
  """Blocked attention (online softmax, flash attention's backward pass)
  against the dense one, values and gradients to 1e-5; chunk 5 does not
  divide the 23 keys."""
  (q, k, v), span, valid, loss = _packed_case()
  dense = decoder.attend(q, k.swapaxes(2, 3), v, span, 0) * valid
  blocked = decoder.attend(q, k.swapaxes(2, 3), v, span, chunk) * valid
  np.testing.assert_allclose(blocked, dense, atol=1e-5)
  grads = [jax.grad(loss, argnums=(0, 1, 2))(q, k, v, c) for c in (0, chunk)]
  for dense_g, blocked_g in zip(*grads):
    np.testing.assert_allclose(blocked_g, dense_g, atol=1e-5)


@pytest.mark.filterwarnings("ignore:attention_impl=splash off TPU")
@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_attention_kernels_equal_dense_with_gradients(impl):
  """The kernel backends (splash in Pallas's interpreter, the XLA path of
  the call that is cuDNN on GPU) give dense attention's outputs and
  gradients on the real rows, to 1e-5; and the same values under a data x tensor
  mesh, each device running the kernel on its own rows and heads."""
  (q, k, v), span, valid, dense_loss = _packed_case()

  def loss(q, k, v):
    return _weighted_sum(
        attention_kernels.attend(q, k, v, span.q_segments, impl), valid)

  dense = decoder.attend(q, k.swapaxes(2, 3), v, span, 0) * valid
  for block in (0, 100):  # splash rounds 100 up to a multiple of 128
    np.testing.assert_allclose(
        attention_kernels.attend(q, k, v, span.q_segments, impl, block)
        * valid, dense, atol=1e-5)
  ref = jax.grad(dense_loss, argnums=(0, 1, 2))(q, k, v, 0)
  for g, r in zip(jax.grad(loss, argnums=(0, 1, 2))(q, k, v), ref):
    np.testing.assert_allclose(g, r, atol=1e-5)
  mesh = parallel.make_mesh(3, 1, 2, devices=jax.devices()[:6])
  with parallel.activate(mesh):
    sharded = jax.jit(lambda *a: attention_kernels.attend(*a, impl))(
        q, k, v, span.q_segments)
  np.testing.assert_allclose(sharded * valid, dense, atol=1e-5)


def test_bfloat16_blocked_attention_gradients_as_close_as_dense():
  """In bfloat16 the blocked backward pass (bfloat16 operands, float32
  accumulation) is within 1% of the float32 gradients, as the dense one is
  (measured: 0.4-0.6% of the largest entry for both)."""
  args, _, _, loss = _packed_case()
  ref = jax.grad(loss, argnums=(0, 1, 2))(*args, 0)
  low = [x.astype(jnp.bfloat16) for x in args]
  for chunk in (0, 5):
    grads = jax.grad(loss, argnums=(0, 1, 2))(*low, chunk)
    for g, r in zip(grads, ref):
      assert g.dtype == jnp.bfloat16
      err = jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r))
      assert 0 < float(err) < 0.01, (chunk, float(err))


def test_chunked_model_and_decode_match_dense():
  """A whole model with ``attention_chunk`` (forward, and prefill then
  decode through the cache) gives the dense model's logits."""
  cfg = ModelConfig(vocab_size=40, embed_dim=32, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, mlp_dim=48)
  chunked = dataclasses.replace(cfg, attention_chunk=4)
  params = decoder.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 3, 40)
  segments = jnp.ones_like(tokens)
  dense, _ = decoder.apply(params, cfg, tokens, segments)
  blocked, _ = decoder.apply(params, chunked, tokens, segments)
  np.testing.assert_allclose(blocked, dense, atol=1e-5)
  cache = decoder.init_cache(chunked, 2, 11)
  out, cache = decoder.apply(params, chunked, tokens[:, :6], segments[:, :6],
                             None, cache)
  steps = [out]
  for t in range(6, 11):
    out, cache = decoder.apply(params, chunked, tokens[:, t:t + 1],
                               segments[:, t:t + 1], jnp.full((2, 1), t),
                               cache)
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), dense, atol=1e-5)


def test_model_with_an_attention_kernel_matches_xla():
  """A left-padded batch through the whole model with a kernel backend
  (the cuDNN call's XLA path; both backends share this wiring and are
  checked one by one above): the real tokens' logits are the XLA path's."""
  cfg = VARIANTS["qwen2"]
  params = decoder.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 3, 40)
  segments = jnp.ones_like(tokens).at[0, :4].set(0)
  ref, _ = decoder.apply(params, cfg, tokens, segments)
  out, _ = decoder.apply(
      params, dataclasses.replace(cfg, attention_impl="cudnn"), tokens,
      segments)
  real = (segments > 0)[..., None]
  np.testing.assert_allclose(out * real, ref * real, atol=1e-5)


@pytest.mark.parametrize("filled", [3, 10, 21])
def test_decode_attention_reads_only_the_filled_blocks(filled):
  """From a cache, blocked attention stops after the block holding slot
  ``filled - 1``: NaN in every later block leaves the output finite and
  equal to dense attention over the filled slots alone (21 of 22 slots:
  the last block is moved back inside the cache, its slots seen before
  not counted twice)."""
  rng = np.random.default_rng(1)
  B, T, H, K, d, S, chunk = 2, 1, 4, 2, 8, 22, 4
  q = jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32)
  k = rng.normal(size=(B, K, S, d)).astype(np.float32)
  v = rng.normal(size=(B, K, S, d)).astype(np.float32)
  read = min(-(-filled // chunk) * chunk, S)
  k[:, :, read:] = np.nan
  v[:, :, read:] = np.nan
  segments = np.zeros((B, S), np.int32)
  segments[:, :filled] = 1
  segments[1, :2] = 0  # left padding
  span = decoder.Span(jnp.ones((B, T), jnp.int32),
                      jnp.full((B, T), filled - 1), jnp.asarray(segments),
                      jnp.arange(S))
  out = decoder.attend(q, jnp.asarray(k).swapaxes(2, 3), jnp.asarray(v),
                       span, chunk, jnp.int32(filled))
  trimmed = span._replace(kv_segments=span.kv_segments[:, :filled],
                          kv_slots=span.kv_slots[:filled])
  dense = decoder.attend(q, jnp.asarray(k[:, :, :filled]).swapaxes(2, 3),
                         jnp.asarray(v[:, :, :filled]), trimmed, 0)
  np.testing.assert_allclose(out, dense, atol=1e-5)
