import numpy as np
import pytest

from mopd_jax.evaluation import intervals

# Student-t quantiles from the printed tables (independent of scipy)
T975 = {2: 4.302652729911275, 4: 2.7764451051977987}


def test_seed_interval_is_the_student_t_interval():
  out = intervals.seed_interval([0.5, 0.6, 0.7])
  half = T975[2] * 0.1 / np.sqrt(3)
  assert out["mean"] == pytest.approx(0.6)
  assert (out["low"], out["high"]) == pytest.approx((0.6 - half, 0.6 + half))
  x = np.array([0.1, 0.4, 0.35, 0.2, 0.3])
  out = intervals.seed_interval(x)
  half = T975[4] * x.std(ddof=1) / np.sqrt(5)
  assert out["high"] - out["mean"] == pytest.approx(half)
  assert out["seeds"] == 5


def test_an_accuracy_interval_stays_in_its_range():
  out = intervals.seed_interval([0.9, 1.0], bounds=(0.0, 1.0))
  assert out["high"] == 1.0 and out["low"] == pytest.approx(
      0.95 - 12.706204736174707 * np.std([0.9, 1.0], ddof=1) / np.sqrt(2))
  assert intervals.seed_interval([0.9, 1.0])["high"] > 1.0


def test_one_seed_has_no_interval():
  out = intervals.seed_interval([0.42])
  assert out == dict(mean=0.42, low=None, high=None, seeds=1)
  assert not intervals.excludes_zero(out)


def test_bootstrap_spread_matches_the_two_level_variance():
  """Each replicate averages S independent draws X_j (a seed, then N of
  its prompts), so Var = (Var_pop(seed means) + mean_s(var_s) / N) / S."""
  rng = np.random.default_rng(1)
  scores = (rng.random((3, 2, 50)) < np.array([0.3, 0.6, 0.8])[:, None,
                                                               None])
  scores = scores.astype(float)
  reps = intervals.bootstrap_means(scores, resamples=6000, seed=2)
  per_seed = scores.reshape(3, -1)
  # prompts are drawn per domain: each domain's mean has variance v/N,
  # and the seed's value averages D of them
  within = np.mean([np.mean(scores[s].var(axis=1)) / 50 / 2
                    for s in range(3)])
  expected = (per_seed.mean(axis=1).var() + within) / 3
  assert reps.mean() == pytest.approx(scores.mean(), abs=0.01)
  assert reps.var() == pytest.approx(expected, rel=0.08)


def test_paired_difference_one_seed_is_the_normal_interval():
  rng = np.random.default_rng(0)
  a = (rng.random((1, 2000)) < 0.6).astype(float)
  b = (rng.random((1, 2000)) < 0.5).astype(float)
  out = intervals.paired_difference(a, b, resamples=4000)
  d = (a - b)[0]
  se = d.std() / np.sqrt(d.size)
  assert out["mean"] == pytest.approx(d.mean())
  assert out["low"] == pytest.approx(d.mean() - 1.96 * se, abs=0.2 * se)
  assert out["high"] == pytest.approx(d.mean() + 1.96 * se, abs=0.2 * se)
  assert intervals.excludes_zero(out)
  assert (out["seeds"], out["prompts"]) == (1, 2000)


def test_identical_models_are_tied_and_the_bootstrap_is_deterministic():
  a = (np.random.default_rng(3).random((3, 40)) < 0.5).astype(float)
  out = intervals.paired_difference(a, a.copy())
  assert out["mean"] == out["low"] == out["high"] == 0.0
  assert not intervals.excludes_zero(out)
  b = np.roll(a, 1, axis=1)
  assert intervals.paired_difference(a, b) == intervals.paired_difference(
      a, b)
  with pytest.raises(ValueError):
    intervals.paired_difference(a[0], b[0])
