"""GRPO-family objective: group advantages, clipped policy gradient, KL to a
reference policy, and the aggregation of per-token losses.

Shapes: ``rewards`` [B] with the ``G`` samples of one prompt contiguous
(B = prompts * G); per-token arrays [B, T] with a completion ``mask``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.reductions import masked_sum_count

ADVANTAGES = ("grpo", "drgrpo", "rloo", "passk")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")


def group_advantages(rewards: jax.Array, group_size: int, mode: str = "grpo",
                     eps: float = 1e-6, pass_k: int = 1) -> jax.Array:
  """Per-sample advantage from the rewards of its group.

  * ``grpo``:   ``A_i = (r_i - mean(r)) / (std(r) + eps)`` (population std)
  * ``drgrpo``: ``A_i = r_i - mean(r)``   (Dr. GRPO: no std division)
  * ``rloo``:   ``A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean(r))``
  * ``passk``:  ``A_i = E_{S ∋ i}[max_{j in S} r_j] - E_S[max_{j in S} r_j]``
    over the uniformly random ``pass_k``-subsets ``S`` of the group: the
    group is rewarded for its best of ``k`` (pass@k) and each sample gets
    its share (``subset_max_advantages``); ``pass_k = 1`` is ``drgrpo``.

  A group whose rewards are all equal gets exactly zero advantage.
  """
  r = rewards.astype(jnp.float32).reshape(-1, group_size)
  centred = r - jnp.mean(r, axis=1, keepdims=True)
  if mode == "grpo":
    adv = centred / (jnp.std(r, axis=1, keepdims=True) + eps)
  elif mode == "drgrpo":
    adv = centred
  elif mode == "rloo":
    adv = centred * group_size / max(group_size - 1, 1)
  elif mode == "passk":
    adv = subset_max_advantages(r, pass_k)
  else:
    raise ValueError(f"advantage mode {mode!r} not in {ADVANTAGES}")
  # Exact zeros for all-equal groups, whatever rounding left in ``centred``.
  adv = jnp.where(informative_groups(rewards, group_size)[:, None], adv, 0.0)
  return adv.reshape(-1)


def _max_weights(n: int, k: int) -> np.ndarray:
  """``P(the j-th smallest of n is the max of a random k-subset)``, j = 1..n:
  ``C(j-1, k-1) / C(n, k)``."""
  return np.array([math.comb(j - 1, k - 1) / math.comb(n, k)
                   for j in range(1, n + 1)], np.float32)


def subset_max_advantages(r: jax.Array, k: int) -> jax.Array:
  """Pass@k advantages of groups ``r`` [P, G] (binary or graded rewards).

  The group's value is ``R = E_S[max_S r] = sum_j r_(j) C(j-1, k-1)/C(G, k)``
  with ``r_(j)`` the j-th smallest reward; sample ``i``'s is
  ``R_i = E_{S ∋ i}[max_S r] = sum_j max(r_i, o_(j)) C(j-1, k-2)/C(G-1, k-1)``
  with ``o`` the other ``G - 1`` rewards (``R_i = r_i`` for ``k = 1``);
  ``A_i = R_i - R``. For binary rewards with ``c`` correct: a correct
  sample gets ``C(G-c, k)/C(G, k)``, an incorrect one loses only
  ``C(G-c-1, k-1)/C(G-1, k-1) - C(G-c, k)/C(G, k)`` (Chen et al. 2025,
  pass@k training; G=8, c=1, k=4: +0.5 and -0.07): a lone correct answer
  keeps a large advantage while the wrong majority is barely pushed down,
  so groups keep exploring instead of collapsing onto one answer.
  """
  g = r.shape[1]
  if not 1 <= k <= g:
    raise ValueError(f"pass_k {k} must be in [1, group size {g}]")
  value = jnp.sort(r, axis=1) @ _max_weights(g, k)
  if k == 1:
    own = r
  else:
    # others[p, i] = the group's rewards without sample i, sorted.
    drop = np.array([[j for j in range(g) if j != i] for i in range(g)])
    others = jnp.sort(r[:, drop], axis=2)
    own = jnp.maximum(r[:, :, None], others) @ _max_weights(g - 1, k - 1)
  return own - value[:, None]


def informative_groups(rewards: jax.Array, group_size: int) -> jax.Array:
  """[prompts] bool: the group's rewards are not all equal."""
  r = rewards.reshape(-1, group_size)
  return jnp.max(r, axis=1) > jnp.min(r, axis=1)


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array,
                        advantages: jax.Array, eps_low: float,
                        eps_high: float, dual_clip: float = 0.0,
                        behaviour_logp: jax.Array | None = None,
                        tis_cap: float = 0.0):
  """Per-token clipped surrogate loss and the clip indicator.

  ``rho_t = exp(logp_t - old_logp_t)``,
  ``L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)``;
  with ``dual_clip = c > 1``, for ``A < 0``: ``L_t = min(L_t, -c A)``
  (the loss of a negative-advantage token cannot exceed ``c |A|``).
  With ``tis_cap > 0`` and the sampler's ``behaviour_logp``, each token is
  weighted by the truncated importance weight
  ``min(exp(old_logp_t - behaviour_logp_t), tis_cap)`` (stop-gradient),
  correcting for sampler/trainer mismatch.

  ``advantages`` is [B] (one per sequence) or [B, T] (one per token).
  Returns ``(loss [B, T], clipped [B, T] float)``.
  """
  adv = advantages if advantages.ndim == 2 else advantages[:, None]
  ratio = jnp.exp(logp - old_logp)
  unclipped = ratio * adv
  clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  surrogate = jnp.minimum(unclipped, clipped_ratio * adv)
  loss = -surrogate
  if dual_clip > 0:
    loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
  if tis_cap > 0 and behaviour_logp is not None:
    weight = jnp.minimum(jnp.exp(old_logp - behaviour_logp), tis_cap)
    loss = loss * jax.lax.stop_gradient(weight)
  was_clipped = (clipped_ratio * adv < unclipped).astype(jnp.float32)
  return loss, was_clipped


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3"
               ) -> jax.Array:
  """Per-token estimate of ``KL(pi || pi_ref)`` from sampled tokens.

  With ``d = log pi_ref(y) - log pi(y)``: ``k1 = -d``, ``k2 = d^2 / 2``,
  ``k3 = exp(d) - d - 1`` (unbiased and non-negative; Schulman 2020).
  """
  d = ref_logp - logp
  if estimator == "k1":
    return -d
  if estimator == "k2":
    return 0.5 * d * d
  if estimator == "k3":
    return jnp.exp(d) - d - 1.0
  raise ValueError(f"KL estimator {estimator!r} not in {KL_ESTIMATORS}")


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str = "token_mean",
              constant: float = 0.0):
  """Reduce a [B, T] per-token loss to a ``(sum, count)`` pair.

  * ``token_mean``: ``(sum_bt m x, sum_bt m)`` (every token weighs the same)
  * ``seq_mean_token_mean``: ``(sum_b mean_t x_b, #sequences with tokens)``
  * ``constant``: ``(sum_bt m x, B * constant)`` (Dr. GRPO's fixed
    normaliser; ``constant`` is typically the maximum completion length)

  ``sum / count`` is the loss; pairs from micro-batches add up exactly.
  """
  if mode == "token_mean":
    return masked_sum_count(per_token, mask)
  mask = mask.astype(jnp.float32)
  if mode == "seq_mean_token_mean":
    tokens = jnp.sum(mask, axis=1)
    seq_means = jnp.sum(per_token * mask, axis=1) / jnp.maximum(tokens, 1.0)
    has = (tokens > 0).astype(jnp.float32)
    return jnp.sum(seq_means * has), jnp.sum(has)
  if mode == "constant":
    if constant <= 0:
      raise ValueError("aggregation 'constant' needs constant > 0")
    return (jnp.sum(per_token * mask),
            jnp.float32(per_token.shape[0] * constant))
  raise ValueError(f"aggregation {mode!r} not in {AGGREGATIONS}")
