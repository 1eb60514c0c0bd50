"""On-policy distillation terms against independent numpy computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.objectives import opd, policy


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _logits(seed, shape):
  return np.random.default_rng(seed).normal(0, 2, shape).astype(np.float32)


def test_signal_extrapolation_gate_and_proxy():
  t, s, r = (np.random.default_rng(i).normal(size=(3, 5)) for i in range(3))
  a = np.asarray(opd.token_signal(t, s))
  np.testing.assert_allclose(a, t - s)
  np.testing.assert_allclose(opd.extrapolate(a, t, r, 1.0), a)
  np.testing.assert_allclose(opd.extrapolate(a, t, r, 1.5),
                             (t - s) + 0.5 * (t - r), rtol=1e-6)
  np.testing.assert_array_equal(opd.gate(a), (t > s).astype(np.float32))
  zb, ze, zi = (_logits(i, (4, 7)) for i in range(3))
  np.testing.assert_allclose(opd.proxy_logits(zb, ze, zi), zb + ze - zi,
                             rtol=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 0.3])
def test_vocab_kl_matches_numpy(alpha):
  zs, zt = _logits(0, (6, 11)), _logits(1, (6, 11))
  ls, lt = _np_log_softmax(zs.astype(np.float64)), _np_log_softmax(
      zt.astype(np.float64))
  reverse = (np.exp(ls) * (ls - lt)).sum(-1)
  forward = (np.exp(lt) * (lt - ls)).sum(-1)
  np.testing.assert_allclose(opd.vocab_kl(zs, zt, alpha),
                             alpha * forward + (1 - alpha) * reverse,
                             rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(opd.vocab_kl(zs, zt, alpha)) >= -1e-6)
  np.testing.assert_allclose(opd.vocab_kl(zs, zs, alpha), 0.0, atol=1e-6)


def test_vocab_kl_gradient_matches_numpy():
  """d reverse / d z_s = p_s * ((ls - lt) - sum_v p_s (ls - lt))."""
  zs, zt = _logits(2, (3, 9)), _logits(3, (3, 9))
  grad = jax.grad(lambda z: opd.vocab_kl(z, zt, 0.0).sum())(zs)
  ls, lt = _np_log_softmax(zs.astype(np.float64)), _np_log_softmax(
      zt.astype(np.float64))
  p, d = np.exp(ls), ls - lt
  np.testing.assert_allclose(grad, p * (d - (p * d).sum(-1, keepdims=True)),
                             rtol=1e-4, atol=1e-6)


def test_topk_dense_loss_matches_numpy():
  zs, zt = _logits(4, (5, 13)), _logits(5, (5, 13))
  loss, reward = opd.topk_dense_loss(zs, zt, 4)
  ls, lt = _np_log_softmax(zs.astype(np.float64)), _np_log_softmax(
      zt.astype(np.float64))
  for row in range(5):
    top = np.argsort(-ls[row])[:4]
    p = np.exp(ls[row, top]) / np.exp(ls[row, top]).sum()
    r = p * (lt[row, top] - ls[row, top])
    np.testing.assert_allclose(reward[row], r.sum(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss[row], -(r * ls[row, top]).sum(),
                               rtol=1e-5, atol=1e-6)


def test_topk_over_the_whole_vocabulary_has_the_reverse_kl_gradient():
  """With K = V the surrogate's gradient is exactly the reverse KL's."""
  zs, zt = _logits(6, (4, 10)), _logits(7, (4, 10))
  g_topk = jax.grad(lambda z: opd.topk_dense_loss(z, zt, 10)[0].sum())(zs)
  g_kl = jax.grad(lambda z: opd.vocab_kl(z, zt, 0.0).sum())(zs)
  np.testing.assert_allclose(g_topk, g_kl, rtol=1e-4, atol=1e-6)
  _, reward = opd.topk_dense_loss(zs, zt, 10)
  np.testing.assert_allclose(reward, -opd.vocab_kl(zs, zt, 0.0), rtol=1e-5)


@pytest.mark.parametrize("length,tile", [(13, 4), (8, 8), (5, 16)])
def test_over_positions_equals_the_direct_computation(length, tile):
  """Values and gradients of a tiled KL equal the untiled ones, for ragged
  lengths (padding dropped)."""
  rng = np.random.default_rng(length)
  h = jnp.asarray(rng.normal(size=(3, length, 6)), jnp.float32)
  ht = jnp.asarray(rng.normal(size=(3, length, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 9)), jnp.float32)

  def direct(w):
    return opd.vocab_kl(h @ w, ht @ w * 0.5, 0.3)

  def tiled(w):
    return policy.over_positions(
        lambda a, b: {"kl": opd.vocab_kl(a @ w, b @ w * 0.5, 0.3)}, tile, h,
        ht)["kl"]

  np.testing.assert_allclose(tiled(w), direct(w), rtol=1e-5, atol=1e-6)
  assert tiled(w).shape == (3, length)
  np.testing.assert_allclose(jax.grad(lambda w: tiled(w).sum())(w),
                             jax.grad(lambda w: direct(w).sum())(w),
                             rtol=1e-4, atol=1e-5)
