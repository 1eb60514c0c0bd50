"""On-policy distillation terms against independent numpy computations."""

import jax
import numpy as np

from mopd_jax.objectives import opd


def _np_log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _logits(seed, shape):
  return np.random.default_rng(seed).normal(0, 2, shape).astype(np.float32)


def test_signal_extrapolation_and_gate():
  t, s, r = (np.random.default_rng(i).normal(size=(3, 5)) for i in range(3))
  a = np.asarray(opd.token_signal(t, s))
  np.testing.assert_allclose(a, t - s)
  np.testing.assert_allclose(opd.extrapolate(a, t, r, 1.0), a)
  np.testing.assert_allclose(opd.extrapolate(a, t, r, 1.5),
                             (t - s) + 0.5 * (t - r), rtol=1e-6)
  np.testing.assert_array_equal(opd.gate(a), (t > s).astype(np.float32))


def _top(zs, zt, k):
  ls, lt = jax.nn.log_softmax(zs, -1), jax.nn.log_softmax(zt, -1)
  top, ids = jax.lax.top_k(ls, k)
  return top, np.take_along_axis(np.asarray(lt), np.asarray(ids), -1)


def test_topk_dense_loss_matches_numpy():
  zs, zt = _logits(4, (5, 13)), _logits(5, (5, 13))
  loss, reward = opd.topk_dense_loss(*_top(zs, zt, 4))
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
  """With K = V the surrogate's gradient is exactly the reverse KL's, and
  its reward is minus the reverse KL."""
  zs, zt = _logits(6, (4, 10)), _logits(7, (4, 10))

  def reverse_kl(z):
    ls, lt = jax.nn.log_softmax(z, -1), jax.nn.log_softmax(zt, -1)
    return (jax.numpy.exp(ls) * (ls - lt)).sum(-1)

  def surrogate(z):
    ls = jax.nn.log_softmax(z, -1)
    top, ids = jax.lax.top_k(ls, 10)
    lt = jax.numpy.take_along_axis(jax.nn.log_softmax(zt, -1), ids, -1)
    return opd.topk_dense_loss(top, lt)

  np.testing.assert_allclose(
      jax.grad(lambda z: surrogate(z)[0].sum())(zs),
      jax.grad(lambda z: reverse_kl(z).sum())(zs), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(surrogate(zs)[1], -reverse_kl(zs), rtol=1e-5)
