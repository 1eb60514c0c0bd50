"""GRPO objective pieces against independent numpy computations."""

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.objectives import grpo

RNG = np.random.default_rng(0)


def _np_subset_max(x, k):
  """Pass@k advantages by enumerating every k-subset of the group."""
  subsets = list(itertools.combinations(range(len(x)), k))
  value = np.mean([max(x[j] for j in s) for s in subsets])
  return np.array([np.mean([max(x[j] for j in s) for s in subsets if i in s])
                   for i in range(len(x))]) - value


def _np_advantages(r, G, mode, eps=1e-6, k=2):
  out = np.zeros_like(r, dtype=np.float64)
  for g in range(len(r) // G):
    x = r[g * G:(g + 1) * G].astype(np.float64)
    if x.max() == x.min():
      continue
    if mode == "passk":
      out[g * G:(g + 1) * G] = _np_subset_max(x, k)
      continue
    for i in range(G):
      if mode == "grpo":
        out[g * G + i] = (x[i] - x.mean()) / (x.std() + eps)
      elif mode == "drgrpo":
        out[g * G + i] = x[i] - x.mean()
      else:
        out[g * G + i] = x[i] - np.mean(np.delete(x, i))
  return out


@pytest.mark.parametrize("mode", grpo.ADVANTAGES)
def test_group_advantages(mode):
  G = 4
  r = RNG.random(5 * G).round(1)
  r[:G] = 0.5  # an all-equal group
  r[G:2 * G] = [0, 0, 0, 1]
  got = np.asarray(grpo.group_advantages(jnp.asarray(r), G, mode, pass_k=2))
  np.testing.assert_allclose(got, _np_advantages(r, G, mode), atol=1e-5)
  assert np.all(got[:G] == 0.0) and np.all(np.isfinite(got))


@pytest.mark.parametrize("binary", [False, True])
def test_pass_k_advantages_enumerate_subsets(binary):
  G = 6
  r = RNG.random(4 * G)
  r = (r < 0.4).astype(np.float64) if binary else r.round(2)
  for k in range(1, G + 1):
    got = np.asarray(grpo.group_advantages(jnp.asarray(r), G, "passk",
                                           pass_k=k))
    np.testing.assert_allclose(got, _np_advantages(r, G, "passk", k=k),
                               atol=1e-5)
  np.testing.assert_allclose(  # best of 1 is the plain centred reward
      grpo.group_advantages(jnp.asarray(r), G, "passk", pass_k=1),
      grpo.group_advantages(jnp.asarray(r), G, "drgrpo"), atol=1e-6)


def test_pass_k_binary_closed_form():
  G, k, c = 8, 4, 1  # one correct answer among eight
  r = np.array([1.0] + [0.0] * (G - 1))
  got = np.asarray(grpo.group_advantages(jnp.asarray(r), G, "passk",
                                         pass_k=k))
  miss = math.comb(G - c, k) / math.comb(G, k)
  np.testing.assert_allclose(got[0], miss, rtol=1e-6)
  np.testing.assert_allclose(
      got[1:], 1 - math.comb(G - c - 1, k - 1) / math.comb(G - 1, k - 1)
      - (1 - miss), rtol=1e-5)
  with pytest.raises(ValueError, match="pass_k"):
    grpo.group_advantages(jnp.asarray(r), G, "passk", pass_k=G + 1)


def test_informative_groups():
  r = jnp.array([1, 1, 0, 1, 0, 0, 0.3, 0.3])
  np.testing.assert_array_equal(grpo.informative_groups(r, 2),
                                [False, True, False, False])


def _np_policy_loss(logp, old, adv, el, eh, c, beh, cap):
  ratio = np.exp(logp - old)
  a = adv[:, None] if adv.ndim == 1 else adv
  s1, s2 = ratio * a, np.clip(ratio, 1 - el, 1 + eh) * a
  loss = -np.minimum(s1, s2)
  if c:
    loss = np.where(a < 0, np.minimum(loss, -c * a), loss)
  if cap:
    loss = loss * np.minimum(np.exp(old - beh), cap)
  return loss, (s2 < s1).astype(float)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dual_clip, cap", [(0.0, 0.0), (3.0, 0.0),
                                            (0.0, 2.0), (3.0, 2.0)])
def test_clipped_policy_loss(dual_clip, cap, per_token):
  """Per-sequence [B] advantages (GRPO) and per-token [B, T] ones (MOPD's
  sampled-token signal)."""
  B, T = 6, 7
  old = RNG.normal(-1.5, 0.5, (B, T))
  logp = old + RNG.normal(0, 0.6, (B, T))  # ratios well outside the clip
  beh = old + RNG.normal(0, 0.3, (B, T))
  adv = RNG.normal(0, 2, (B, T) if per_token else B)
  loss, clipped = grpo.clipped_policy_loss(
      jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), 0.2, 0.28,
      dual_clip, jnp.asarray(beh), cap)
  ref, ref_clipped = _np_policy_loss(logp, old, adv, 0.2, 0.28, dual_clip,
                                     beh, cap)
  np.testing.assert_allclose(np.asarray(loss), ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(clipped), ref_clipped)
  assert 0 < ref_clipped.mean() < 1


def test_policy_gradient_at_ratio_one_is_minus_advantage():
  import jax
  logp = jnp.array([[-1.0, -2.0]])
  adv = jnp.array([1.5])
  grad = jax.grad(lambda l: grpo.clipped_policy_loss(
      l, jax.lax.stop_gradient(l), adv, 0.2, 0.2)[0].sum())(logp)
  np.testing.assert_allclose(grad, [[-1.5, -1.5]])


@pytest.mark.parametrize("kind", grpo.KL_ESTIMATORS)
def test_kl_estimators(kind):
  # Its own draws (not the module's stream, which depends on which tests
  # ran first); k3 = exp(d) - d - 1 cancels near d = 0 in float32, hence
  # the absolute tolerance.
  rng = np.random.default_rng(7)
  logp = rng.normal(-2, 1, (3, 5)).astype(np.float32)
  ref = rng.normal(-2, 1, (3, 5)).astype(np.float32)
  d = ref.astype(np.float64) - logp
  expect = {"k1": -d, "k2": 0.5 * d ** 2, "k3": np.exp(d) - d - 1}[kind]
  np.testing.assert_allclose(
      np.asarray(grpo.kl_penalty(jnp.asarray(logp), jnp.asarray(ref), kind)),
      expect, rtol=1e-5, atol=1e-6)


def test_k3_is_unbiased_for_kl():
  """E_{y~pi}[k3] = KL(pi || ref) on a 3-token distribution."""
  pi = np.array([0.5, 0.3, 0.2])
  ref = np.array([0.2, 0.5, 0.3])
  k3 = np.asarray(grpo.kl_penalty(jnp.log(jnp.asarray(pi)),
                                  jnp.log(jnp.asarray(ref)), "k3"))
  np.testing.assert_allclose((pi * k3).sum(), (pi * np.log(pi / ref)).sum(),
                             rtol=1e-5)


def test_aggregations():
  x = RNG.normal(size=(3, 4))
  m = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
  s, c = grpo.aggregate(jnp.asarray(x), jnp.asarray(m), "token_mean")
  np.testing.assert_allclose(float(s) / float(c), (x * m).sum() / 6, rtol=1e-5)
  s, c = grpo.aggregate(jnp.asarray(x), jnp.asarray(m), "seq_mean_token_mean")
  expect = (x[0, :2].mean() + x[1].mean()) / 2
  np.testing.assert_allclose(float(s) / float(c), expect, rtol=1e-5)
  assert float(c) == 2
  s, c = grpo.aggregate(jnp.asarray(x), jnp.asarray(m), "constant", 8)
  np.testing.assert_allclose(float(s) / float(c), (x * m).sum() / 24,
                             rtol=1e-5)
  # Micro-batches add up to the whole batch exactly.
  s1, c1 = grpo.aggregate(jnp.asarray(x[:2]), jnp.asarray(m[:2]),
                          "seq_mean_token_mean")
  s2, c2 = grpo.aggregate(jnp.asarray(x[2:]), jnp.asarray(m[2:]),
                          "seq_mean_token_mean")
  np.testing.assert_allclose((float(s1) + float(s2)) / (float(c1) + float(c2)),
                             expect, rtol=1e-5)
