"""On-policy distillation: the whole loss of MOPD and its variants.

The student ``pi`` samples ``y`` (or, off-policy, a behaviour policy does:
the teacher's prefixes, the TRB blend); the routed teacher ``T`` of each
token (its domain's expert, the delta teacher, or a token router's pick)
scores it. Per token, with the signal

    a_t = log T(y_t | x, y_<t) - log pi(y_t | x, y_<t)

(``pi`` the rollout-time student, or the current one under Open-MOPD's
reward refresh; ``+ (lambda - 1)(log T - log base)`` with extrapolation),
the gate ``g_t = 1[a_t > 0]`` (``opd.gate``, else 1) and the outcome term
``lambda_orm A`` (the sequence's group advantage), ``opd.loss`` is

    pg:    L_t = clipped PG with advantage g_t a_t + lambda_orm A
    topk:  L_t = g_t topk_dense_loss + lambda_orm PG(A)
    kl:    L_t = g_t KL_alpha(pi || T) + lambda_orm PG(A),
           KL_alpha = alpha KL(T || pi) + (1 - alpha) KL(pi || T)

plus ``KL(T || pi)`` where ``H(T) > opd.entropy_threshold``. The step's
loss is

    L = agg_t [ w_d(t) L_t + beta KL_t(pi || pi_ref) - c H_t(pi) ]

with ``w_d`` the Open-MOPD loss weight of the token's domain
(``distill/budget.py``: token-share balancing times the gap-aware budget;
1 when off), the KL to the reference and the entropy bonus of
``policy.aggregate_loss`` and its aggregation (``rl.aggregation``).
Per-token arrays are [B, T] with a completion mask; full-vocabulary
quantities come from the fused ops in ``mopd_jax.ops.vocab`` (the exact KL,
the student's top-K), so that [tokens, vocab] never exists.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from mopd_jax.objectives import grpo, policy
from mopd_jax.ops import vocab
from mopd_jax.ops.vocab import VocabKL
from mopd_jax.reductions import masked_sum_count


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


def full_vocabulary(opd_cfg) -> bool:
  """Whether the loss needs the teacher's whole distribution per position
  (then its hidden states are cached instead of [tokens, vocab] logits)."""
  return opd_cfg.loss in ("topk", "kl") or opd_cfg.entropy_threshold > 0


def make_loss(model_cfg, sampling, rl_cfg, opd_cfg, refresh: bool,
              ops: vocab.VocabOps):
  """The distillation loss of a minibatch, ``(params, mb, teacher_w)``.

  ``mb`` holds per-sequence arrays: the rollout, ``old_logp``,
  ``teacher_logp`` (and ``teacher_hidden``, ``teacher_entropy``,
  ``ref_logp`` as the options need), the outcome ``advantages``, the
  routed ``teacher_id`` [B, T] (per token: a token router may send one
  sequence's tokens to several teachers) and the per-sequence loss
  ``weight`` (Open-MOPD).
  ``teacher_w`` [teachers, D, V] stacks the teachers' unembeddings (zero
  rows pad a smaller hidden size: the logits are unchanged); every
  full-vocabulary term runs once per teacher with only that teacher's rows
  unmasked (the fused ops give masked rows 0 but still compute them: J
  unembedding passes over the minibatch, against one transformer forward
  per teacher over its own rows, done before, in ``teachers.score``).

  The module docstring's ``L``, ``L_t`` from ``LOSSES[opd.loss]``,
  ``refresh``: ``a_t`` under the current student (reward refresh).
  """

  def loss_fn(params, mb, teacher_w):
    stats = policy.student_positions(params, model_cfg, mb,
                                     sampling.temperature, ops)
    logp = stats["logp"]

    def routed(fn):
      """``sum_j fn(j, mask_j)``: each token gets its own teacher's value."""
      outs = [fn(j, mb["mask"] * (mb["teacher_id"] == j))
              for j in range(teacher_w.shape[0])]
      return jax.tree.map(lambda *xs: sum(xs), *outs)

    def kl(j, mask):
      return vocab.vocab_kl(stats["h"], stats["w"], mb["teacher_hidden"],
                            teacher_w[j], mask=mask, scale=stats["scale"],
                            teacher_scale=1.0, ops=ops)

    def topk():
      top_logp, ids = vocab.topk_logprobs(
          stats["h"], stats["w"], opd_cfg.top_k, mask=mb["mask"],
          scale=stats["scale"], ops=ops)
      return top_logp, routed(lambda j, mask: vocab.token_logprobs(
          mb["teacher_hidden"], teacher_w[j], ids, mask=mask, ops=ops))

    # the full KL once, for the loss and the entropy term
    full_kl = (routed(kl) if opd_cfg.loss == "kl"
               or opd_cfg.entropy_threshold > 0 else None)
    student = jax.lax.stop_gradient(logp) if refresh else mb["old_logp"]
    signal = token_signal(mb["teacher_logp"], student)
    if opd_cfg.extrapolation != 1.0:
      signal = extrapolate(signal, mb["teacher_logp"], mb["ref_logp"],
                           opd_cfg.extrapolation)
    gate_t = gate(signal) if opd_cfg.gate else jnp.ones_like(signal)
    per_token, clipped, metrics = LOSSES[opd_cfg.loss](LossInputs(
        logp=logp, old_logp=mb["old_logp"], signal=signal, gate=gate_t,
        outcome=opd_cfg.lambda_orm * mb["advantages"][:, None],
        clip=(rl_cfg.eps_low, rl_cfg.eps_high, rl_cfg.dual_clip,
              mb.get("behaviour_logp"), rl_cfg.tis_cap),
        kl_alpha=opd_cfg.kl_alpha, kl=full_kl, topk=topk))
    if opd_cfg.entropy_threshold > 0:
      per_token = per_token + jnp.where(
          mb["teacher_entropy"] > opd_cfg.entropy_threshold,
          full_kl.forward, 0.0)
    per_token = per_token * mb["weight"][:, None]
    mask = mb["mask"] * mb["keep"][:, None]
    metrics = {k: masked_sum_count(v, mask) for k, v in metrics.items()}
    metrics.update(signal=masked_sum_count(signal, mask),
                   gated=masked_sum_count(1.0 - gate_t, mask))
    return policy.aggregate_loss(per_token, clipped, stats, mb, rl_cfg,
                                 sampling.max_new_tokens, metrics)

  return loss_fn


def make_align_kl(model_cfg, temperature: float, ops: vocab.VocabOps):
  """A jitted ``(params, batch, teacher_hidden [J, B, T, D], teacher_w
  [J, D, V]) -> [J, B, T]``: ``KL(pi || T_j)`` at every completion position
  over the vocabulary (the fused op, no [tokens, V] logits), ``pi`` the
  student under ``params`` (the expert-align router's score)."""

  @jax.jit
  def align_kl(params, batch, teacher_hidden, teacher_w):
    stats = policy.student_positions(params, model_cfg, batch, temperature,
                                     ops)
    return jnp.stack([vocab.vocab_kl(
        stats["h"], stats["w"], teacher_hidden[j], teacher_w[j],
        mask=batch["mask"], scale=stats["scale"], teacher_scale=1.0,
        ops=ops).reverse for j in range(teacher_w.shape[0])])

  return align_kl
