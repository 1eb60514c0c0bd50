"""The Open-MOPD token budget: per-domain loss weights from token-share
balancing and from the gap-aware budget, whose state (``init_gap_state``,
``update_gap_state``, ``remaining_gap``) is checkpointed with the run.
Pure numpy on per-domain counts, once per step.
"""

from __future__ import annotations

import numpy as np

from mopd_jax.data import mixture
from mopd_jax.errors import ConfigError

# open_mopd.gap_statistic: what measures a domain's remaining gap
# (gap_observations); open_mopd.gap_steers: what the gap factors weigh
GAP_STATISTICS = ("abs_signal", "reverse_kl", "sequence_kl")
GAP_STEERS = ("loss", "sampling", "both")


def token_share_weights(tokens: np.ndarray, targets: np.ndarray,
                        power: float = 1.0) -> np.ndarray:
  """Token-share balancing: ``w_d = (target_d / share_d)^power / Z`` with
  ``share_d`` the fraction of the batch's tokens from domain ``d``, targets
  renormalised over the domains present and ``Z`` chosen so that
  ``sum_d share_d w_d = 1`` (the token-weighted mean weight is 1). Power 1
  is exact balancing (each domain's share of the loss is its target); below
  1 it moves each share only part of the way. Absent domains get 0."""
  tokens = np.asarray(tokens, np.float64)
  present = tokens > 0
  share = tokens / max(tokens.sum(), 1e-12)
  target = np.where(present, np.asarray(targets, np.float64), 0.0)
  target = target / max(target.sum(), 1e-12)
  w = np.where(present, (target / np.where(present, share, 1.0)) ** power,
               0.0)
  return normalise_by_tokens(w, tokens)


def gap_factors(gap: np.ndarray, seen: np.ndarray, base: np.ndarray,
                alpha: float, lo: float, hi: float) -> np.ndarray:
  """Gap-aware budget: ``f_d = clip((gap_d / ref)^alpha, lo, hi)`` with
  ``ref = sum_d w_d gap_d`` (base proportions ``w``, renormalised over the
  domains already ``seen``); 1 for domains not seen yet."""
  gap = np.maximum(np.asarray(gap, np.float64), 1e-12)
  seen = np.asarray(seen, bool)
  if not seen.any():
    return np.ones_like(gap)
  w = np.where(seen, np.asarray(base, np.float64), 0.0)
  ref = float(np.sum(w * gap) / w.sum())
  return np.where(seen, np.clip((gap / ref) ** alpha, lo, hi), 1.0)


def init_gap_state(num_domains: int) -> dict:
  """Gap state: the running gap per domain (``signal``), the observations
  behind it (``count``) and each domain's first observed gap
  (``initial``)."""
  return dict(mixture.init_state(num_domains),
              initial=np.zeros(num_domains, np.float32))


def update_gap_state(state: dict, domain_ids: np.ndarray, values: np.ndarray,
                     momentum: float) -> dict:
  """Fold one batch's gap observations into ``state``: an exponential
  moving average per domain (``mixture.update_state``), and ``initial_d``
  set from ``d``'s first batch."""
  new = mixture.update_state(state, domain_ids, values, momentum)
  first = (np.asarray(state["count"]) == 0) & (new["count"] > 0)
  new["initial"] = np.where(first, new["signal"],
                            state["initial"]).astype(np.float32)
  return new


def remaining_gap(state: dict, relative: bool) -> np.ndarray:
  """The gap the budget compares across domains: the running gap ``g_d``,
  or with ``relative`` the fraction still open, ``g_d / g_d(first batch)``
  (how far each domain has converged, free of the domains' scales)."""
  gap = np.asarray(state["signal"], np.float64)
  if not relative:
    return gap
  return gap / np.maximum(np.abs(np.asarray(state["initial"], np.float64)),
                          1e-12)


def normalise_by_tokens(weights: np.ndarray, tokens: np.ndarray
                        ) -> np.ndarray:
  """``weights`` rescaled so that their token-weighted mean is 1."""
  tokens = np.asarray(tokens, np.float64)
  mean = float(np.sum(weights * tokens) / max(tokens.sum(), 1e-12))
  return np.asarray(weights, np.float64) / max(mean, 1e-12)


def gap_observations(signal: np.ndarray, mask: np.ndarray,
                     seq_domain: np.ndarray, name: str):
  """``(domain ids, values)`` whose per-domain mean is the remaining gap.

  * ``abs_signal``: ``|a_t|`` per token (mean: the mean absolute signal);
  * ``reverse_kl``: ``-a_t = log pi - log T`` per token (mean: the per-token
    reverse KL, estimated on the student's samples);
  * ``sequence_kl``: ``sum_t -a_t`` per sequence (mean: the per-sequence
    reverse KL, which does not shrink a long domain's gap by its length).

  ``signal`` and ``mask`` are [B, T], ``seq_domain`` [B].
  """
  mask = np.asarray(mask).astype(bool)
  if name == "sequence_kl":
    return seq_domain, np.where(mask, -signal, 0.0).sum(1)
  token_domain = np.broadcast_to(seq_domain[:, None], mask.shape)[mask]
  if name == "abs_signal":
    return token_domain, np.abs(signal[mask])
  if name == "reverse_kl":
    return token_domain, -signal[mask]
  raise ConfigError(f"open_mopd.gap_statistic: {name!r} not in"
                    f" {GAP_STATISTICS}")


def domain_loss_weights(tokens: np.ndarray, gap_f: np.ndarray, open_cfg,
                        num_domains: int) -> np.ndarray:
  """Per-domain loss weights of a batch with ``tokens[d]`` tokens per domain:
  the token-share weights (if on) times the gap factors (if they steer the
  loss), rescaled to a token-weighted mean of 1."""
  w = np.ones(num_domains)
  if open_cfg.token_share:
    w = w * token_share_weights(
        tokens, mixture.base_weights(range(num_domains), open_cfg.target_shares),
        open_cfg.token_share_power)
  if open_cfg.gap_budget and open_cfg.gap_steers in ("loss", "both"):
    w = w * gap_f
  return normalise_by_tokens(w, tokens)
