"""Fused top-K log-probs (XLA path) against materialised float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.ops import vocab
from mopd_jax.ops import vocab_naive as naive
from mopd_jax.ops.vocab_naive import rel_err


def xla(block_v):
  """The reference implementation with a ``block_v`` vocabulary tile."""
  return vocab.VocabOps("xla", block_v)


def inputs(seed, n, d, v, k):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, d)).astype(np.float32),
          (rng.normal(size=(d, v)) * 2 / np.sqrt(d)).astype(np.float32),
          rng.normal(size=(n, k)).astype(np.float32))


@pytest.mark.parametrize("n,d,v,k,block_v", [
    (29, 16, 250, 5, 64),   # ragged vocabulary
    (8, 8, 100, 6, 4),      # tiles narrower than k
])
def test_matches_float64_naive(n, d, v, k, block_v):
  h, w, c = inputs(v, n, d, v, k)

  def loss(h, w):
    logp, ids = vocab.topk_logprobs(h, w, k, ops=xla(block_v),
                                    scale=0.9)
    return jnp.sum(c * logp), (logp, ids)

  (dh, dw), (logp, ids) = jax.jit(jax.grad(loss, (0, 1), has_aux=True))(h, w)
  with jax.enable_x64(True):
    def ref_loss(h, w):
      logp, ids = naive.topk_logprobs(h, w, k, scale=0.9)
      return jnp.sum(c * logp), (logp, ids)

    (ref_dh, ref_dw), (ref_logp, ref_ids) = jax.jit(jax.grad(
        ref_loss, (0, 1), has_aux=True))(jnp.asarray(h, jnp.float64),
                                        jnp.asarray(w, jnp.float64))
  assert ids.dtype == jnp.int32 and logp.shape == (n, k)
  np.testing.assert_array_equal(ids, ref_ids)
  for got, want in [(logp, ref_logp), (dh, ref_dh), (dw, ref_dw)]:
    assert rel_err(got, want) <= 1e-5


def test_topk_dense_reward_with_teacher_gather():
  """``sum_k p~_k (log T_k - log pi_k)`` from the docstring's recipe."""
  n, d, v, k = 12, 8, 90, 4
  h, w, _ = inputs(0, n, d, v, k)
  ht, wt, _ = inputs(1, n, d, v, k)
  keep = np.arange(n) % 3 != 0
  logp, ids = vocab.topk_logprobs(h, w, k, mask=keep, ops=xla(32))
  teacher = vocab.token_logprobs(ht, wt, ids, mask=keep, ops=xla(32))
  reward = jnp.sum(jax.nn.softmax(logp, axis=-1) * (teacher - logp), axis=-1)
  ref_logp, ref_ids = naive.topk_logprobs(h, w, k)
  ref_teacher = jnp.take_along_axis(
      jax.nn.log_softmax(naive.logits(ht, wt), axis=-1), ref_ids, axis=-1)
  ref_reward = jnp.sum(jax.nn.softmax(ref_logp, axis=-1)
                       * (ref_teacher - ref_logp), axis=-1)
  np.testing.assert_array_equal(np.asarray(ids)[keep], np.asarray(ref_ids)[keep])
  assert np.all(np.asarray(ids)[~keep] == 0)
  assert np.all(np.asarray(teacher)[~keep] == 0)
  assert rel_err(np.asarray(reward)[keep], np.asarray(ref_reward)[keep]) <= 1e-5
