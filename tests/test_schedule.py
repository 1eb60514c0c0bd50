"""The learning-rate schedule against its formula, computed in numpy."""

import math

import ml_collections
import numpy as np
import optax
import pytest

from mopd_jax import training


def _optim(warmup, decay, end=0.1, lr=3e-3):
  return ml_collections.ConfigDict(dict(
      learning_rate=lr, warmup_steps=warmup, end_lr_fraction=end,
      decay_steps=decay))


def _reference(t, lr, warmup, total, decay, end):
  start = max(warmup, total - decay) if decay else warmup
  if t < warmup:
    return lr * t / warmup
  if t < start:
    return lr
  u = min(t - start, total - start) / max(total - start, 1)
  return lr * (end + (1 - end) * (1 + math.cos(math.pi * u)) / 2)


@pytest.mark.parametrize("warmup,total,decay,end", [
    (100, 800, 0, 0.1), (100, 800, 150, 0.1), (5, 300, 0, 1.0),
    (0, 60, 20, 0.0), (10, 50, 500, 0.1)])
def test_schedule_matches_formula(warmup, total, decay, end):
  schedule = training.learning_rate_schedule(_optim(warmup, decay, end), total)
  got = np.array([schedule(t) for t in range(total + 3)])
  want = np.array([_reference(t, 3e-3, warmup, total, decay, end)
                   for t in range(total + 3)])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_no_decay_steps_is_warmup_cosine_bit_for_bit():
  # Runs trained before the option existed keep their exact schedule.
  got = training.learning_rate_schedule(_optim(100, 0), 800)
  want = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 100, 800, 3e-4)
  for t in range(805):
    assert float(got(t)) == float(want(t))


def test_stable_stretch_is_shared_by_longer_runs():
  # Warmup-stable-decay: a run D steps longer than a stable-phase
  # checkpoint's step decays from exactly that point.
  short = training.learning_rate_schedule(_optim(100, 150), 650)
  long = training.learning_rate_schedule(_optim(100, 150), 1100)
  for t in range(500):
    assert float(short(t)) == float(long(t))
  assert short(600) < long(600) == np.float32(3e-3)
