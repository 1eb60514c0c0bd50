"""On-policy distillation: the per-token teacher signal and its losses.

The student ``pi`` samples ``y``; a teacher ``T`` scores every sampled
token. Per-token arrays are [B, T] with a completion mask; full-vocabulary
quantities come from the fused ops in ``mopd_jax.ops.vocab`` (the exact KL,
the student's top-K), so that [tokens, vocab] never exists.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GAP_STATISTICS = ("abs_signal", "reverse_kl", "sequence_kl")
# opd.loss -> the per-token distillation loss it names (assembled in
# stages/mopd.make_loss from the functions below and the fused ops)
LOSSES = {
    "pg": "clipped policy gradient with a_t as a stop-gradient advantage",
    "topk": "the student's top-K dense reward (topk_dense_loss)",
    "kl": "the exact per-position KL over the vocabulary (ops.vocab_kl)",
}


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
