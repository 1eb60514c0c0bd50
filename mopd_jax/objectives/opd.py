"""On-policy distillation: the per-token teacher signal and its losses.

The student ``pi`` samples ``y``; a teacher ``T`` scores every sampled
token. Per-token arrays are [B, T] with a completion mask; full-vocabulary
quantities come from the fused ops in ``mopd_jax.ops.vocab`` (the exact KL,
the student's top-K), so that [tokens, vocab] never exists.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from mopd_jax.objectives import grpo
from mopd_jax.ops.vocab import VocabKL

GAP_STATISTICS = ("abs_signal", "reverse_kl", "sequence_kl")


def token_signal(teacher_logp: jax.Array, student_logp: jax.Array
                 ) -> jax.Array:
  """``a_t = log T(y_t | x, y_<t) - log pi(y_t | x, y_<t)``."""
  return teacher_logp - student_logp


def extrapolate(signal: jax.Array, teacher_logp: jax.Array,
                ref_logp: jax.Array, lam: float) -> jax.Array:
  """Reward extrapolation: ``a_t + (lambda - 1) (log T(y_t) - log ref(y_t))``
  (``lambda = 1`` leaves ``a_t`` unchanged; ``ref`` is the base model)."""
  return signal + (lam - 1.0) * (teacher_logp - ref_logp)


def gate(signal: jax.Array) -> jax.Array:
  """``1[log T(y_t) > log pi(y_t)]``: where the teacher gives the sampled token
  more probability than the student (guidance is kept only there)."""
  return (signal > 0).astype(jnp.float32)


def topk_dense_loss(student_logp: jax.Array, teacher_logp: jax.Array):
  """The student's top-K dense reward and its policy-gradient loss per row.

  Over the student's ``K`` most likely tokens (``student_logp`` [..., K],
  ``teacher_logp`` the teacher's log-probs of the same ids), with
  ``p~_k = pi_k / sum_j pi_j`` (renormalised over the K) and
  ``r_k = log T_k - log pi_k``: ``R = sum_k p~_k r_k`` (a truncated negative
  reverse KL) and ``L = -sum_k sg(p~_k r_k) log pi_k``, whose gradient is the
  reverse KL's restricted to the K tokens (with K = V exactly the reverse
  KL's gradient, the ``sum_v pi_v grad log pi_v`` term being 0). Returns
  ``(L, R)``.
  """
  weights = jax.nn.softmax(student_logp, axis=-1)
  reward = jax.lax.stop_gradient(weights * (teacher_logp - student_logp))
  return -jnp.sum(reward * student_logp, axis=-1), jnp.sum(reward, axis=-1)


class LossInputs(NamedTuple):
  """What a distillation loss reads for one minibatch, per token [B, T]:
  the student's ``logp`` (current) and ``old_logp`` (rollout time), the
  signal ``a_t``, the gate ``g_t`` (ones when off), the outcome term
  ``lambda_orm A`` [B, 1], the clip arguments of
  ``grpo.clipped_policy_loss`` after the advantage, ``kl_alpha``, and the
  full-vocabulary terms: ``kl`` the routed teacher's ``VocabKL`` (None
  unless a term needs it), ``topk()`` the student's top-K log-probs and the
  routed teacher's log-probs of the same ids, computed only when called."""
  logp: jax.Array
  old_logp: jax.Array
  signal: jax.Array
  gate: jax.Array
  outcome: jax.Array
  clip: tuple
  kl_alpha: float
  kl: VocabKL | None
  topk: Callable[[], tuple[jax.Array, jax.Array]]


def pg_loss(x: LossInputs):
  """``L_t = clipped PG with advantage g_t a_t + lambda_orm A`` (``a_t`` a
  stop-gradient advantage: the sampled-token signal)."""
  per_token, clipped = grpo.clipped_policy_loss(
      x.logp, x.old_logp, x.gate * x.signal + x.outcome, *x.clip)
  return per_token, clipped, {}


def _dense_plus_outcome(x: LossInputs, dense: jax.Array):
  """``g_t dense_t + PG_t(lambda_orm A)``."""
  per_token, clipped = grpo.clipped_policy_loss(
      x.logp, x.old_logp, jnp.broadcast_to(x.outcome, x.logp.shape), *x.clip)
  return x.gate * dense + per_token, clipped


def kl_loss(x: LossInputs):
  """``L_t = g_t KL_alpha(pi || T) + lambda_orm PG(A)``, the exact
  per-position KL over the vocabulary (``VocabKL.mix(kl_alpha)``)."""
  per_token, clipped = _dense_plus_outcome(x, x.kl.mix(x.kl_alpha))
  return per_token, clipped, {}


def topk_loss(x: LossInputs):
  """``L_t = g_t topk_dense_loss + lambda_orm PG(A)``, the student's top-K
  dense reward (reported as ``topk_reward``)."""
  dense, reward = topk_dense_loss(*x.topk())
  per_token, clipped = _dense_plus_outcome(x, dense)
  return per_token, clipped, {"topk_reward": reward}


# opd.loss -> its per-token loss: (LossInputs) -> (L_t, clipped, metrics)
LOSSES = {"pg": pg_loss, "topk": topk_loss, "kl": kl_loss}
