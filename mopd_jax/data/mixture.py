"""Domain mixtures: fixed proportions ``w_d``, or (Mix RL) adaptive ones that
follow each domain's learnability.

The adaptive state (per-domain prompt counts and a running mean of the mean
absolute advantage, the learnability signal) is a small pytree kept in the
train state, so it is checkpointed and resumed with everything else.
"""

from __future__ import annotations

import numpy as np


def base_weights(domains, weights) -> np.ndarray:
  """Normalised proportions ``w_d`` (uniform when ``weights`` is empty)."""
  w = np.ones(len(domains)) if not weights else np.asarray(weights, float)
  return w / w.sum()


def init_state(num_domains: int) -> dict:
  return dict(count=np.zeros(num_domains, np.float32),
              signal=np.zeros(num_domains, np.float32))


def proportions(base: np.ndarray, state: dict, adaptive: bool,
                exploration: float, floor: float) -> np.ndarray:
  """Sampling proportions of the next batch.

  Fixed: ``w = base / sum(base)``. Adaptive: an upper-confidence bound on
  each domain's learnability,
  ``u_d = s_d + c sqrt(ln(1 + sum_k n_k) / (1 + n_d))``
  (``s_d``: running mean of |advantage| over ``d``'s prompts, ``n_d``: prompts
  of ``d`` seen so far, ``c = exploration``), then
  ``w_d = floor + (1 - D floor) * base_d u_d / sum_k base_k u_k``, so no
  domain's share falls below ``floor``.
  """
  w = np.asarray(base, np.float64)
  if adaptive:
    count = np.asarray(state["count"], np.float64)
    bonus = exploration * np.sqrt(np.log1p(count.sum()) / (1.0 + count))
    w = w * (np.asarray(state["signal"], np.float64) + bonus + 1e-12)
    w = w / w.sum()
    w = floor + (1.0 - len(w) * floor) * w
  return w / w.sum()


def update_state(state: dict, domain_ids: np.ndarray, group_signal: np.ndarray,
                 momentum: float) -> dict:
  """Fold one batch into the adaptive state.

  ``domain_ids`` and ``group_signal`` (mean |advantage| of each prompt's
  group) are per prompt. ``s_d <- m s_d + (1 - m) mean(signal of d's
  prompts)`` for the domains present (the first observation replaces the zero
  start), and ``n_d`` counts prompts.
  """
  count = np.asarray(state["count"], np.float32).copy()
  signal = np.asarray(state["signal"], np.float32).copy()
  for d in np.unique(domain_ids):
    batch_mean = float(np.mean(group_signal[domain_ids == d]))
    signal[d] = batch_mean if count[d] == 0 else (
        momentum * signal[d] + (1.0 - momentum) * batch_mean)
    count[d] += float(np.sum(domain_ids == d))
  return dict(count=count, signal=signal)
