"""On-policy distillation: the per-token teacher signal and its losses.

The student ``pi`` samples ``y``; a teacher ``T`` scores every sampled
token. Per-token arrays are [B, T] with a completion mask; full-vocabulary
quantities work on logits [..., V] and are evaluated over tiles of
positions (``objectives.policy.over_positions``) so that [tokens, vocab]
never exists for a whole batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mopd_jax.ops.logprobs import log_softmax

LOSSES = ("pg", "topk", "kl")
GAP_STATISTICS = ("abs_signal", "reverse_kl")


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


def proxy_logits(student_base: jax.Array, expert: jax.Array,
                 expert_init: jax.Array) -> jax.Array:
  """Proxy teacher in logit space: ``z = z_student_base + (z_expert -
  z_expert_init)`` (the expert's RL update carried onto another model)."""
  return student_base + (expert - expert_init)


def vocab_kl(z_student: jax.Array, z_teacher: jax.Array, alpha: float = 0.0
             ) -> jax.Array:
  """Exact per-row KL over the vocabulary, differentiable in the student.

  ``reverse = sum_v pi_v (log pi_v - log T_v)``,
  ``forward = sum_v T_v (log T_v - log pi_v)``,
  returns ``alpha * forward + (1 - alpha) * reverse`` (``alpha=0``: reverse).
  """
  ls, lt = log_softmax(z_student), log_softmax(z_teacher)
  reverse = jnp.sum(jnp.exp(ls) * (ls - lt), axis=-1)
  forward = jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)
  return alpha * forward + (1.0 - alpha) * reverse


def topk_dense_loss(z_student: jax.Array, z_teacher: jax.Array, k: int):
  """The student's top-K dense reward and its policy-gradient loss per row.

  Over the student's ``K`` most likely tokens, with ``p~_k = pi_k / sum_j
  pi_j`` (renormalised over the K) and ``r_k = log T_k - log pi_k``:
  ``R = sum_k p~_k r_k`` (a truncated negative reverse KL) and
  ``L = -sum_k sg(p~_k r_k) log pi_k``, whose gradient is that of the
  reverse KL restricted to the K tokens (``sum_k pi_k grad log pi_k`` terms
  vanish in expectation). Returns ``(L, R)``.
  """
  ls, lt = log_softmax(z_student), log_softmax(z_teacher)
  top_logp, ids = jax.lax.top_k(ls, k)
  teacher_logp = jnp.take_along_axis(lt, ids, axis=-1)
  weights = jax.nn.softmax(top_logp, axis=-1)
  reward = jax.lax.stop_gradient(weights * (teacher_logp - top_logp))
  return -jnp.sum(reward * top_logp, axis=-1), jnp.sum(reward, axis=-1)
