"""Fused student/teacher KL over the vocabulary (XLA path) against float64."""

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


def inputs(seed, n, d, d_t, v):
  rng = np.random.default_rng(seed)

  def normal(*shape):
    return rng.normal(size=shape).astype(np.float32)

  return (normal(n, d), normal(d, v) * 2 / np.sqrt(d), normal(n, d_t),
          normal(d_t, v) * 2 / np.sqrt(d_t), normal(n), normal(n))


def float64_reference(h, w, ht, wt, c_rev, c_fwd, scale, teacher_scale):
  """Naive ``(reverse, forward, H(T))`` and the student's ``(dh, dw)``."""
  with jax.enable_x64(True):
    def loss(h, w):
      rev, fwd, ent = naive.kl(h, w, jnp.asarray(ht, jnp.float64),
                               jnp.asarray(wt, jnp.float64), scale,
                               teacher_scale)
      return jnp.sum(c_rev * rev) + jnp.sum(c_fwd * fwd), (rev, fwd, ent)

    grads, outs = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(
        jnp.asarray(h, jnp.float64), jnp.asarray(w, jnp.float64))
    return jax.tree.map(np.asarray, (outs, grads))


def fused_loss(c_rev, c_fwd, **kwargs):
  def loss(h, w, ht, wt):
    kl = vocab.vocab_kl(h, w, ht, wt, **kwargs)
    return jnp.sum(c_rev * kl.reverse) + jnp.sum(c_fwd * kl.forward), kl

  return loss


@pytest.mark.parametrize("n,d,d_t,v,block_v,scale,teacher_scale", [
    (37, 16, 16, 250, 64, 1.0, None),   # ragged rows and vocabulary
    (16, 8, 24, 128, 32, 0.8, 1.25),    # wider teacher, two temperatures
    (5, 8, 8, 60, 128, 1.0, None),      # vocabulary smaller than one tile
])
@pytest.mark.parametrize("keep", [-1, 0])
def test_matches_float64_naive(n, d, d_t, v, block_v, scale, teacher_scale,
                               keep):
  h, w, ht, wt, c_rev, c_fwd = inputs(n + v, n, d, d_t, v)
  loss = fused_loss(c_rev, c_fwd, ops=xla(block_v, keep), scale=scale,
                    teacher_scale=teacher_scale)
  (dh, dw, dht, dwt), kl = jax.jit(jax.grad(loss, (0, 1, 2, 3),
                                            has_aux=True))(h, w, ht, wt)
  outs, (ref_dh, ref_dw) = float64_reference(
      h, w, ht, wt, c_rev, c_fwd, scale,
      scale if teacher_scale is None else teacher_scale)
  for got, want in [*zip(kl, outs), (dh, ref_dh), (dw, ref_dw)]:
    assert got.dtype == jnp.float32 and rel_err(got, want) <= 1e-5
  # The teacher is a constant.
  assert not np.any(np.asarray(dht)) and not np.any(np.asarray(dwt))


def test_mix_interpolates_forward_and_reverse():
  h, w, ht, wt, _, _ = inputs(0, 12, 8, 8, 50)
  kl = vocab.vocab_kl(h, w, ht, wt, ops=xla(16))
  np.testing.assert_allclose(kl.mix(0.0), kl.reverse)
  np.testing.assert_allclose(kl.mix(1.0), kl.forward)
  np.testing.assert_allclose(kl.mix(0.25), 0.25 * kl.forward
                             + 0.75 * kl.reverse, rtol=1e-6)
  assert np.all(np.asarray(kl.reverse) > 0) and np.all(
      np.asarray(kl.forward) > 0)


def test_identical_student_and_teacher_give_zero():
  h, w, _, _, _, _ = inputs(1, 10, 8, 8, 70)

  def fn(h, w):
    return vocab.vocab_kl(h, w, h, w, ops=xla(32))

  kl = jax.jit(fn)(h, w)
  grads = jax.jit(jax.grad(lambda h, w: jnp.sum(fn(h, w).mix(0.5)),
                           (0, 1)))(h, w)
  assert np.max(np.abs(np.asarray(kl.reverse))) < 1e-5
  assert np.max(np.abs(np.asarray(kl.forward))) < 1e-5
  assert all(np.max(np.abs(np.asarray(g))) < 1e-5 for g in grads)


def test_masked_rows_give_zero_and_no_gradient():
  n, v = 20, 90
  h, w, ht, wt, c_rev, c_fwd = inputs(2, n, 8, 12, v)
  keep = np.random.default_rng(3).random(n) < 0.5
  h_pad = np.where(keep[:, None], h, np.nan).astype(np.float32)
  ht_pad = np.where(keep[:, None], ht, np.inf).astype(np.float32)
  loss = fused_loss(c_rev * keep, c_fwd * keep, ops=xla(32),
                    mask=keep)
  (dh, dw), kl = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(h_pad, w, ht_pad,
                                                               wt)
  outs, (ref_dh, ref_dw) = float64_reference(h, w, ht, wt, c_rev * keep,
                                             c_fwd * keep, 1.0, 1.0)
  for got, want in zip(kl, outs):
    assert np.all(np.asarray(got)[~keep] == 0)
    assert rel_err(np.asarray(got)[keep], want[keep]) <= 1e-5
  assert np.all(np.asarray(dh)[~keep] == 0)
  assert rel_err(dh, ref_dh) <= 1e-5 and rel_err(dw, ref_dw) <= 1e-5
