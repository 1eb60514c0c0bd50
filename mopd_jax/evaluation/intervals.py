"""Uncertainty over seeds and prompts: the intervals a seeded study reports.

A seeded study repeats the experts and every fusion method for ``S``
seeds and evaluates every model on the same ``N`` test prompts, so each
model's outcome on a domain is an ``[S, N]`` array of per-prompt scores
(1/0 correct, or a per-prompt pass@k). Two kinds of interval follow:

* a cell (one model, one domain): the mean over seeds with the Student-t
  interval ``mean +- t_{0.975, S-1} sd / sqrt(S)`` of the seed-level
  accuracies (``sd`` the sample standard deviation; none for ``S = 1``):
  seed-to-seed variation, which in this study is larger than the
  prompt-level standard error;
* a difference between two models (same seeds, same prompts): the mean
  of ``a - b`` over seeds and prompts with a two-level percentile
  bootstrap, each replicate drawing ``S`` seeds with replacement and,
  within each drawn seed, ``N`` prompts with replacement. With few seeds
  the seed level has few distinct draws (10 for ``S = 3``), so the
  interval is an honest floor of the uncertainty, not a guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
RESAMPLES = 2000


def seed_interval(values: Sequence[float], level: float = LEVEL,
                  bounds: tuple[float, float] | None = None) -> dict:
  """``{mean, low, high, seeds}`` of seed-level values with the Student-t
  interval (``low = high = None`` for one seed), clipped to ``bounds``
  when the quantity has them (an accuracy's interval past 100% says
  nothing more than 100%)."""
  x = np.asarray(values, dtype=np.float64)
  mean = float(x.mean())
  if x.size < 2:
    return dict(mean=mean, low=None, high=None, seeds=int(x.size))
  half = float(stats.t.ppf(0.5 + level / 2, x.size - 1)
               * x.std(ddof=1) / np.sqrt(x.size))
  low, high = mean - half, mean + half
  if bounds is not None:
    low, high = max(low, bounds[0]), min(high, bounds[1])
  return dict(mean=mean, low=low, high=high, seeds=int(x.size))


def bootstrap_means(scores: np.ndarray, resamples: int = RESAMPLES,
                    seed: int = 0) -> np.ndarray:
  """``[resamples]`` replicates of the grand mean of ``scores``
  (``[S, N]`` or ``[S, D, N]``: seeds, [domains,] prompts), drawing seeds
  and then, within each drawn seed, prompts with replacement (the same
  prompt draw for every domain of a replicate is not assumed: each
  domain's prompts are drawn on their own)."""
  x = np.asarray(scores, dtype=np.float64)
  x = x[:, None, :] if x.ndim == 2 else x
  s, d, n = x.shape
  rng = np.random.default_rng(seed)
  seeds = rng.integers(0, s, size=(resamples, s))
  prompts = rng.integers(0, n, size=(resamples, s, d, n))
  picked = x[seeds[:, :, None, None], np.arange(d)[None, None, :, None],
             prompts]  # [resamples, S, D, N]
  return picked.mean(axis=(1, 2, 3))


def paired_difference(a: np.ndarray, b: np.ndarray, level: float = LEVEL,
                      resamples: int = RESAMPLES, seed: int = 0) -> dict:
  """``{mean, low, high, seeds, prompts}`` of ``a - b`` (per-prompt scores
  of two models on the same seeds and prompts, ``[S, N]`` or
  ``[S, D, N]``) with the two-level bootstrap's percentile interval."""
  diff = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  if diff.ndim not in (2, 3):
    raise ValueError(f"scores of shape {diff.shape}: need [S, N] or"
                     " [S, D, N]")
  reps = bootstrap_means(diff, resamples, seed)
  tail = (1 - level) / 2
  return dict(mean=float(diff.mean()),
              low=float(np.quantile(reps, tail)),
              high=float(np.quantile(reps, 1 - tail)),
              seeds=int(diff.shape[0]), prompts=int(diff.shape[-1]))


def excludes_zero(interval: dict) -> bool:
  """Whether a difference's interval lies wholly on one side of 0."""
  return interval["low"] is not None and (interval["low"] > 0
                                          or interval["high"] < 0)
