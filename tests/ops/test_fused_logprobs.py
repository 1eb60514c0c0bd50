"""Fused token log-probs and entropy (XLA path) against materialised float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.ops import vocab
from mopd_jax.ops import vocab_naive as naive
from mopd_jax.ops.vocab_naive import rel_err


def xla(block_v, keep_logits_mib=-1):
  """The reference implementation with a ``block_v`` vocabulary tile
  (logits kept for the backward pass as on the CPU by default; 0:
  recomputed, as on accelerators)."""
  return vocab.VocabOps("xla", block_v, keep_logits_mib=keep_logits_mib)


def inputs(seed, n, d, v, k=None):
  rng = np.random.default_rng(seed)
  h = rng.normal(size=(n, d)).astype(np.float32)
  w = (rng.normal(size=(d, v)) * 2 / np.sqrt(d)).astype(np.float32)
  targets = rng.integers(0, v, (n,) if k is None else (n, k)).astype(np.int32)
  # Random cotangents: the gradient of <c_logp, logp> + <c_ent, entropy>
  # checks every output's backward at once.
  c_logp = rng.normal(size=targets.shape).astype(np.float32)
  c_ent = rng.normal(size=(n,)).astype(np.float32)
  return h, w, targets, c_logp, c_ent


def float64_reference(h, w, targets, c_logp, c_ent, scale=1.0, keep=None):
  """Naive ``(logp, entropy), (dh, dw)`` in float64, masked rows zeroed."""
  keep = np.ones(len(h), bool) if keep is None else keep
  with jax.enable_x64(True):
    def loss(h, w):
      logp, ent = naive.token_logprobs(h, w, jnp.asarray(targets), scale)
      logp = logp * keep.reshape((-1,) + (1,) * (logp.ndim - 1))
      return jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent * keep), (logp,
                                                                   ent * keep)

    h64, w64 = jnp.asarray(h, jnp.float64), jnp.asarray(w, jnp.float64)
    grads, outs = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(h64, w64)
    return jax.tree.map(np.asarray, (outs, grads))


def fused(h, w, targets, c_logp, c_ent, **kwargs):
  def loss(h, w):
    logp, ent = vocab.token_logprobs(h, w, targets, with_entropy=True,
                                     **kwargs)
    return jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent), (logp, ent)

  grads, outs = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(h, w)
  return outs, grads


@pytest.mark.parametrize("n,d,v,block_v,k,scale", [
    (37, 16, 250, 64, None, 1.0),   # ragged rows and vocabulary
    (32, 8, 256, 64, None, 1.0),    # vocabulary a multiple of the tile
    (5, 8, 100, 128, None, 1.0),    # vocabulary smaller than one tile
    (19, 12, 130, 32, 3, 0.7),      # K targets per row, temperature
])
@pytest.mark.parametrize("keep", [-1, 0])
def test_matches_float64_naive(n, d, v, block_v, k, scale, keep):
  h, w, targets, c_logp, c_ent = inputs(n + v, n, d, v, k)
  (logp, ent), (dh, dw) = fused(h, w, targets, c_logp, c_ent,
                                ops=xla(block_v, keep), scale=scale)
  (ref_logp, ref_ent), (ref_dh, ref_dw) = float64_reference(
      h, w, targets, c_logp, c_ent, scale)
  assert logp.shape == targets.shape and ent.shape == (n,)
  for got, want in [(logp, ref_logp), (ent, ref_ent), (dh, ref_dh),
                    (dw, ref_dw)]:
    assert got.dtype == jnp.float32
    assert rel_err(got, want) <= 1e-5


def test_masked_rows_give_zero_and_no_gradient():
  n, d, v = 24, 8, 90
  h, w, targets, c_logp, c_ent = inputs(1, n, d, v)
  keep = np.random.default_rng(2).random(n) < 0.6
  # Padding rows may hold anything: NaN states and out-of-range targets.
  h = np.where(keep[:, None], h, np.nan).astype(np.float32)
  targets = np.where(keep, targets, -1).astype(np.int32)
  (logp, ent), (dh, dw) = fused(h, w, targets, c_logp, c_ent, ops=xla(32),
                                mask=keep)
  (ref_logp, ref_ent), (ref_dh, ref_dw) = float64_reference(
      np.where(keep[:, None], h, 0.0), w, np.where(keep, targets, 0), c_logp,
      c_ent, keep=keep)
  assert np.all(np.asarray(logp)[~keep] == 0)
  assert np.all(np.asarray(ent)[~keep] == 0)
  assert np.all(np.asarray(dh)[~keep] == 0)
  for got, want in [(logp, ref_logp), (ent, ref_ent), (dh, ref_dh),
                    (dw, ref_dw)]:
    assert np.all(np.isfinite(got)) and rel_err(got, want) <= 1e-5


def test_leading_dims_match_flat_rows():
  h, w, targets, _, _ = inputs(3, 10, 8, 70)
  mask = np.arange(10) % 4 != 0
  flat = vocab.token_logprobs(h, w, targets, mask=mask, ops=xla(16))
  shaped = vocab.token_logprobs(h.reshape(2, 5, 8), w, targets.reshape(2, 5),
                                mask=mask.reshape(2, 5), ops=xla(16))
  assert shaped.shape == (2, 5)
  np.testing.assert_array_equal(np.asarray(shaped).ravel(), np.asarray(flat))
  with pytest.raises(ValueError, match="targets"):
    vocab.token_logprobs(h.reshape(2, 5, 8), w, targets)


def test_bfloat16_within_naive_bfloat16_error():
  h, w, targets, c_logp, c_ent = inputs(4, 40, 16, 300)
  h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  # The truth: float64 on the bfloat16-rounded inputs.
  truth = float64_reference(np.asarray(h16, np.float32),
                            np.asarray(w16, np.float32), targets, c_logp, c_ent)

  def naive_loss(h, w):
    logp, ent = naive.token_logprobs(h, w, targets)
    return jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent), (logp, ent)

  naive_grads, naive_outs = jax.jit(jax.grad(naive_loss, (0, 1),
                                             has_aux=True))(h16, w16)
  outs, grads = fused(h16, w16, targets, c_logp, c_ent, ops=xla(64))
  assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
  got = jax.tree.leaves((outs, grads))
  base = jax.tree.leaves((naive_outs, naive_grads))
  for g, b, t in zip(got, base, jax.tree.leaves(truth)):
    assert rel_err(g, t) <= max(2 * rel_err(b, t), 1e-5)


@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_kept_logits_give_the_recomputed_gradients(scale):
  """Reading the forward pass's logits instead of recomputing them changes
  no bit of either op's gradients at temperature 1 (so a run's float
  rounding does not depend on the budget) and only float32 rounding at
  others (XLA fuses the scaled tile differently in the two passes), and
  the budget decides which happens."""
  n, d, v = 21, 8, 150
  h, w, targets, c_logp, c_ent = inputs(5, n, d, v)
  mask = np.arange(n) % 5 != 0
  teacher_h = np.random.default_rng(6).normal(size=(n, d)).astype(np.float32)

  def grads(keep):
    ops = xla(32, keep)

    def loss(h, w):
      logp, ent = vocab.token_logprobs(h, w, targets, mask=mask, scale=scale,
                                       with_entropy=True, ops=ops)
      kl = vocab.vocab_kl(h, w, teacher_h, 1.1 * w, mask=mask, scale=scale,
                          teacher_scale=scale, ops=ops)
      return (jnp.sum(c_logp * logp) + jnp.sum(c_ent * ent)
              + jnp.sum(c_ent * kl.mix(0.3)))

    return jax.jit(jax.grad(loss, (0, 1)))(h, w)

  for kept, recomputed in zip(grads(1), grads(0)):
    if scale == 1.0:
      np.testing.assert_array_equal(np.asarray(kept), np.asarray(recomputed))
    else:
      assert rel_err(kept, recomputed) <= 1e-6
  # 5 tiles of [21, 32] float32 logits: 13,440 bytes an array
  cfg = vocab._config(xla(32, 1), 1.0)
  assert vocab.tile_bytes(n, v, cfg, 1) == 13_440
  hw = (jnp.asarray(h), jnp.asarray(w))
  assert vocab._stats(cfg, "lse_stats", 1, *hw)[-1][0].shape == (5, n, 32)
  assert vocab._stats(cfg._replace(keep_bytes=13_439), "lse_stats", 1,
                      *hw)[-1] is None
  assert vocab._config(xla(32), 1.0).keep_bytes == 1024 << 20  # the CPU's
  assert vocab._config(vocab.VocabOps("pallas"), 1.0).keep_bytes == 0


def test_auto_never_picks_pallas_on_cpu():
  assert jax.default_backend() == "cpu"
  assert vocab.resolve_impl("auto") == "xla"
  with pytest.raises(ValueError, match="impl"):
    vocab.resolve_impl("cuda")
