"""MOPD: multi-teacher on-policy distillation, with the Open-MOPD fixes.

One step: draw prompts of every training domain, let the student sample
``rl.group_size`` completions each (temperature 1 by default; or each
domain's expert, ``opd.prefix=teacher``; or their trust-region blend in
the TRB warm-up), route every sample to its domain's teacher, which scores
the sampled tokens (one teacher and only its samples at a time; a
label-free token router has every teacher score every token and picks one
per token), then take ``rl.epochs x rl.minibatches`` optimiser steps on
the distillation loss (``opd.loss``). Open-MOPD, each
switchable: per-domain loss weights from token-share balancing and from the
gap-aware budget (which can also steer the prompt proportions), and the
student reward refresh (``a_t`` under the current student at every update).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import atomic, parallel, runs
from mopd_jax import config as config_lib
from mopd_jax.data import mixture
from mopd_jax.data.domains import completion_budget
from mopd_jax.errors import CheckpointError, ConfigError
from mopd_jax.evaluation import headroom
from mopd_jax.fusion import open_mopd, teachers
from mopd_jax.models import tokenizer as tokenizer_lib
from mopd_jax.objectives import opd, policy
from mopd_jax.ops import vocab
from mopd_jax.reductions import masked_sum_count
from mopd_jax.stages import on_policy


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

  With ``a_t = log T(y_t) - log pi(y_t)`` (``pi`` the current student under
  ``refresh``, else the rollout-time one), per token (``opd.LOSSES``):
  * ``pg``:   ``L_t = clipped PG with advantage g_t a_t + lambda_orm A``;
  * ``topk``: ``L_t = g_t opd.topk_dense_loss + lambda_orm PG(A)``;
  * ``kl``:   ``L_t = g_t KL_alpha(pi || T) + lambda_orm PG(A)``;
  ``g_t = opd.gate`` when ``opd.gate`` (else 1), ``A`` the sequence's
  group advantage, plus the forward KL where ``H(T) > entropy_threshold``.
  Each token's loss is multiplied by its sequence's ``weight``.
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
    signal = opd.token_signal(mb["teacher_logp"], student)
    if opd_cfg.extrapolation != 1.0:
      signal = opd.extrapolate(signal, mb["teacher_logp"], mb["ref_logp"],
                               opd_cfg.extrapolation)
    gate = opd.gate(signal) if opd_cfg.gate else jnp.ones_like(signal)
    per_token, clipped, metrics = opd.LOSSES[opd_cfg.loss](opd.LossInputs(
        logp=logp, old_logp=mb["old_logp"], signal=signal, gate=gate,
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
                   gated=masked_sum_count(1.0 - gate, mask))
    return policy.aggregate_loss(per_token, clipped, stats, mb, rl_cfg,
                         sampling.max_new_tokens, metrics)

  return loss_fn


def stacked_unembeddings(teacher_params, teacher_cfgs) -> jax.Array:
  """[teachers, D_max, V]: each teacher's ``teachers.combined_unembedding``,
  zero-padded in D."""
  ws = [teachers.combined_unembedding(c, p)
        for c, p in zip(teacher_cfgs, teacher_params)]
  width = max(w.shape[0] for w in ws)
  return jnp.stack([jnp.pad(w, ((0, width - w.shape[0]), (0, 0)))
                    for w in ws])


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


def write_headroom(workdir: str, scalars: dict, base_dir: str,
                   teacher_dirs: dict) -> None:
  """``<workdir>/headroom.json``: the final evaluation's headroom recovery
  on the evaluated domains against the base run and the oracle ensemble,
  printed too; skipped with a note when the base or a teacher has no final
  evaluation of a domain to compare with."""
  try:
    result = headroom.report(scalars, base_dir, teacher_dirs)
  except CheckpointError as e:
    print(f"headroom recovery not computed: {e}")
    return
  atomic.write_json_atomic(os.path.join(workdir, "headroom.json"), result)
  for mode, r in result.items():
    print(f"headroom recovery ({mode}): " + ", ".join(
        f"{d} {100 * v:.1f}%" for d, v in r.items()))


class MOPD:
  """The ``on_policy.Method`` of multi-teacher distillation: each sample
  scored by its domain's teacher (or every sample by the delta teacher);
  Open-MOPD's loss weights and gap state."""

  def __init__(self, config, tokenizer, model_cfg, mesh):
    self.config = config
    opd_cfg, self.open_cfg = config.opd, config.open_mopd
    if opd_cfg.loss == "topk" and opd_cfg.top_k > model_cfg.vocab_size:
      raise ConfigError(f"opd.top_k: {opd_cfg.top_k} exceeds the vocabulary"
                        f" of {model_cfg.vocab_size}")
    self.names = on_policy.domains(config)
    self.base = mixture.base_weights(self.names, config.data.weights)
    self.teacher_mesh = teachers.teacher_mesh(mesh, opd_cfg.teacher_devices)
    delta = opd_cfg.router == "delta"
    self.teachers = teachers.load_teachers(
        teachers.parse_teachers(config.teachers, self.names), tokenizer,
        self.teacher_mesh, with_init=opd_cfg.proxy_teacher or delta,
        execution=model_cfg)
    self.router = teachers.ROUTERS[opd_cfg.router](self.names, self.teachers)
    student_init = (teachers.Model(model_cfg, runs.load_params(
        config.init, model_cfg, self.teacher_mesh)) if opd_cfg.proxy_teacher
                    else None)
    # expert_align compares every teacher's distribution with the student's
    wide = full_vocabulary(opd_cfg) or self.router.needs_align
    ops = config_lib.op_options(config)
    self.scorers, self.teacher_params, teacher_cfgs = [], [], []
    composed = ([teachers.delta_models(self.teachers, opd_cfg.delta_scale)]
                if delta else [teachers.teacher_models(t, student_init)
                               for t in self.teachers])
    for models, signs in composed:
      teacher_cfgs.append(tuple(m.cfg for m in models))
      self.teacher_params.append(tuple(m.params for m in models))
      self.scorers.append(teachers.make_scorer(
          teacher_cfgs[-1], signs, opd_cfg.entropy_threshold > 0
          or opd_cfg.router == "entropy", wide, ops))
    # The loss reads the teachers' unembeddings on the student's mesh.
    teacher_w = jax.device_put(
        stacked_unembeddings(self.teacher_params, teacher_cfgs) if wide
        else jnp.zeros((len(composed), 1, 1)),
        parallel.replicated(mesh))
    self.hidden_width = int(teacher_w.shape[1]) if wide else 0
    self.shared = (teacher_w,)
    self.mesh, self.model_cfg = mesh, model_cfg
    self.max_new_tokens = completion_budget(self.names,
                                            config.sampling.max_new_tokens)
    if self.router.needs_align:
      self.align_kl = make_align_kl(model_cfg, config.sampling.temperature,
                                    ops)

  def init_state(self) -> dict:
    state = {"gap": open_mopd.init_gap_state(len(self.names))}
    if self.config.opd.curriculum_entropy > 0:  # checkpointed with it
      state["budget"] = np.asarray(self.config.opd.curriculum_start,
                                   np.int32)
    return state

  def trb_radius(self, step: int) -> float:
    """``delta_t = trb_delta (1 - t / trb_steps)`` for ``t < trb_steps``,
    then 0 (the student's own rollouts)."""
    opd_cfg = self.config.opd
    if step >= opd_cfg.trb_steps:
      return 0.0
    return opd_cfg.trb_delta * (1.0 - step / opd_cfg.trb_steps)

  def behaviour(self, state, step: int):
    """Teacher prefixes (each domain's expert samples its prompts), the
    TRB warm-up (the blend of student and expert inside ``trb_radius``),
    or the student; the curriculum's budget when it is on."""
    opd_cfg = self.config.opd
    budget = (int(state["budget"]) if opd_cfg.curriculum_entropy > 0
              else 0)
    delta = self.trb_radius(step)
    if opd_cfg.prefix != "teacher" and delta <= 0:
      return None, budget
    student_cfg = self.model_cfg

    def sample(params, prompt, prompt_mask, seq_ids, key, sampling):
      return teachers.sample_routed(
          teachers.Model(student_cfg, params), self.teachers,
          self.router.route(seq_ids), prompt, prompt_mask, key, sampling,
          None if opd_cfg.prefix == "teacher" else delta)
    return sample, budget

  def gap_now(self, gap_state) -> np.ndarray:
    open_cfg = self.open_cfg
    if not open_cfg.gap_budget:
      return np.ones(len(self.names))
    return open_mopd.gap_factors(open_mopd.remaining_gap(gap_state, open_cfg.gap_relative),
                            gap_state["count"] > 0, self.base, open_cfg.gap_alpha,
                            open_cfg.gap_min, open_cfg.gap_max)

  def proportions(self, state) -> np.ndarray:
    if self.open_cfg.gap_budget and self.open_cfg.gap_steers in ("sampling", "both"):
      weights = self.base * self.gap_now(state["gap"])
      return weights / weights.sum()
    return self.base

  def signal(self, state, data, seq_ids) -> None:
    """Each sample routed to one teacher, which scores its tokens; or, for
    a token router, every teacher scores every token and the router picks
    each token's teacher."""
    mask = data["mask"]
    if not self.router.per_token:
      teacher_ids = self.router.route(seq_ids)
      data.update(teachers.score(self.scorers, self.teacher_params,
                                 teacher_ids, data, self.teacher_mesh,
                                 self.hidden_width))
      data["teacher_id"] = np.broadcast_to(
          teacher_ids.astype(np.int32)[:, None], mask.shape).copy()
      return
    every = teachers.score_every(self.scorers, self.teacher_params, data,
                                 self.teacher_mesh, self.hidden_width)
    if self.router.needs_align:
      with parallel.activate(self.mesh):
        batch = parallel.shard_batch(self.mesh, {
            k: data[k] for k in ("prompt", "prompt_mask", "completion",
                                 "mask")})
        every["align_kl"] = np.asarray(parallel.to_host(self.align_kl(
            state["params"], batch, jnp.asarray(every["teacher_hidden"]),
            self.shared[0])))
    choice = self.router.choose(every)
    every.pop("align_kl", None)
    data.update(teachers.pick(every, choice))
    data["teacher_id"] = choice

  def weigh(self, state, data, seq_ids) -> dict:
    """The gap state and the per-domain loss weights of this batch."""
    open_cfg = self.open_cfg
    mask = data["mask"].astype(bool)
    signal = np.where(mask, opd.token_signal(data["teacher_logp"],
                                             data["old_logp"]), 0.0)
    token_domain = np.broadcast_to(seq_ids[:, None], mask.shape)[mask]
    gap_state = open_mopd.update_gap_state(
        state["gap"], *open_mopd.gap_observations(signal, mask, seq_ids,
                                             open_cfg.gap_statistic),
        open_cfg.gap_momentum)
    tokens = np.bincount(token_domain, minlength=len(self.names)).astype(
        float)
    loss_w = open_mopd.domain_loss_weights(tokens, self.gap_now(gap_state), open_cfg,
                                 len(self.names))
    data["weight"] = loss_w[seq_ids].astype(np.float32)
    return {"gap": gap_state}, (signal[mask], token_domain, tokens, loss_w)

  def metrics(self, state, new_state, ids, data, informative, notes,
              trained):
    """Per domain: loss share, signal, reverse KL, gap, loss weight; with a
    token router, the confusion matrix of its routing against the
    oracle; the TRB radius; the curriculum's budget, which grows by
    ``curriculum_growth`` (up to the full budget) while the student's mean
    entropy on the update's tokens stays ``>= curriculum_entropy``."""
    signal, token_domain, tokens, loss_w = notes
    opd_cfg = self.config.opd
    updates = {}
    if opd_cfg.curriculum_entropy > 0:
      total, count = trained["entropy"]
      budget = int(state["budget"])
      if float(total) / max(float(count), 1.0) >= opd_cfg.curriculum_entropy:
        budget = min(budget + opd_cfg.curriculum_growth, self.max_new_tokens)
      updates["budget"] = np.asarray(budget, np.int32)
    effective = loss_w * tokens
    signal_sums = np.bincount(token_domain, weights=signal,
                              minlength=len(self.names))
    pairs = {}
    for d, name in enumerate(self.names):
      pairs[f"share/loss/{name}"] = (effective[d], effective.sum())
      pairs[f"signal/{name}"] = (signal_sums[d], tokens[d])
      pairs[f"reverse_kl/{name}"] = (-signal_sums[d], tokens[d])
      pairs[f"gap/{name}"] = (new_state["gap"]["signal"][d], 1.0)
      pairs[f"loss_weight/{name}"] = (loss_w[d], 1.0)
    if self.router.per_token:
      seq_ids = np.repeat(ids, self.config.rl.group_size)
      pairs.update(teachers.confusion(data["teacher_id"], data["mask"],
                                      seq_ids, self.names,
                                      [t.domain for t in self.teachers]))
    if opd_cfg.trb_delta > 0:
      pairs["trb_delta"] = (self.trb_radius(int(state["step"])), 1.0)
    if opd_cfg.curriculum_entropy > 0:
      pairs["budget"] = (float(state["budget"]), 1.0)
    return updates, pairs


def check(config) -> None:
  """Every teacher names a run that shares the student's token ids and its
  vocabulary size (a larger teacher's KL would run over a truncated row),
  before anything is written."""
  tokenizer = tokenizer_lib.for_config(config)
  for run_dir in teachers.parse_teachers(
      config.teachers, tuple(config.data.domains)).values():
    run_config = runs.load_run_config(run_dir)
    runs.check_same_tokens(run_dir, run_config, tokenizer, "teachers")
    runs.check_same_vocabulary(run_dir, run_config, config.model.vocab_size,
                               "teachers")


def make_method(config, tokenizer, model_cfg, mesh, sampling):
  method = MOPD(config, tokenizer, model_cfg, mesh)
  loss = make_loss(model_cfg, sampling, config.rl, config.opd,
                   config.open_mopd.reward_refresh,
                   config_lib.op_options(config))
  needs_base = config.rl.beta > 0 or config.opd.extrapolation != 1.0
  return method, loss, needs_base


def run(config, workdir: str):
  """Distil the teachers into the student; returns the final state."""
  write_eval = runs.write_eval(workdir, config.train.steps)
  dirs = teachers.parse_teachers(config.teachers, tuple(config.data.domains))

  def on_final(scalars):
    write_eval(scalars)
    write_headroom(workdir, scalars, config.init,
                   {d: run_dir for d, run_dir in dirs.items()
                    if d in config.eval.domains})

  return on_policy.run(config, workdir, make_method, "mopd", on_final)
