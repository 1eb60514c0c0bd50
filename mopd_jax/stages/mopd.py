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

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mopd_jax import atomic, parallel, runs
from mopd_jax import config as config_lib
from mopd_jax.config import non_negative, positive
from mopd_jax.data import mixture
from mopd_jax.data.domains import TRAIN_DOMAINS, completion_budget
from mopd_jax.distill import budget, teachers
from mopd_jax.errors import CheckpointError, ConfigError
from mopd_jax.evaluation import headroom
from mopd_jax.models import tokenizer as tokenizer_lib
from mopd_jax.objectives import opd
from mopd_jax.ops import vocab
from mopd_jax.stages import on_policy


def defaults() -> ml_collections.ConfigDict:
  """The student (``init``) on its own rollouts of the pooled
  ``data.domains``, each domain's samples scored by its teacher (one
  expert run per domain in ``teachers``); the ``rl`` section carries the
  batch shape, the clip of the ``pg`` loss and the outcome advantage."""
  c = on_policy.defaults("mopd", steps=300)
  c.data.domains = TRAIN_DOMAINS
  c.data.weights = ()  # empty: uniform over domains
  # run directories: a template with {domain}, or domain=dir pairs
  c.teachers = ""
  c.rl.update(group_size=4, prompts_per_step=64, minibatches=4)
  c.opd = ml_collections.ConfigDict(dict(
      # oracle: each sample to its domain's expert; delta: every token to
      # the delta teacher z_base + delta_scale * sum_i (z_expert_i - z_base);
      # label-free, per token from every expert's scores (MOPD-Router):
      # entropy (the lowest), novelty (the highest log T_i(y_t) - log
      # base(y_t)), expert_align (the lowest KL(student || T_i))
      router="oracle",
      delta_scale=1.0,
      # kl (exact, per position) | pg (sampled-token signal) | topk (dense);
      # kl recovered about twice pg's headroom on the built-in domains
      loss="kl",
      kl_alpha=0.0,  # kl: alpha * forward + (1 - alpha) * reverse
      top_k=8,  # topk: the student's K most likely tokens
      lambda_orm=0.0,  # weight of the verifier's group advantage
      entropy_threshold=0.0,  # > 0: forward KL where H(teacher) exceeds it
      gate=False,  # keep the signal only where T(y_t) > pi(y_t)
      proxy_teacher=False,  # student_base + (expert - expert_init) logits
      extrapolation=1.0,  # lambda of a_t + (lambda-1)(log T - log base)
      # Devices holding the teachers: 0, the student's mesh; k > 0, a
      # sub-mesh of the last k devices (teachers' parameters sharded over it).
      teacher_devices=0,
      # A token router's scoring, every teacher on every token: one pass
      # vmapped over the teachers' stacked parameters (on: teachers of one
      # architecture required; auto: so on an accelerator when they are
      # and its devices hold a second copy of them while stacking) or one
      # pass per teacher (off; auto on the CPU, where one pass at a time
      # already fills the cores)
      teacher_vmap="auto",
      # Who samples the completions the loss is taken on: the student
      # (on-policy) or each domain's expert (teacher prefixes, off-policy
      # distillation; with loss=kl, kl_alpha=1 is forward KL on them).
      prefix="student",
      # TRB warm-up: for the first trb_steps steps sample from the blend of
      # student and teacher inside KL(b || student) <= delta_t, delta_t
      # annealed linearly from trb_delta to 0 (0: off)
      trb_delta=0.0,
      trb_steps=0,
      # Entropy-gated length curriculum (0: off): the completion budget
      # starts at curriculum_start tokens and grows by curriculum_growth a
      # step while the student's mean entropy stays >= curriculum_entropy
      curriculum_entropy=0.0,
      curriculum_start=8,
      curriculum_growth=8,
  ))
  c.open_mopd = ml_collections.ConfigDict(dict(
      token_share=False,  # weight d by target_share_d / token_share_d
      target_shares=(),  # empty: uniform over domains
      # (target / share)^power: 1 balances fully, 0.5 part of the way
      token_share_power=1.0,
      gap_budget=False,  # weight d by clip((gap_d / ref)^alpha, lo, hi)
      gap_statistic="abs_signal",  # | reverse_kl | sequence_kl
      gap_relative=False,  # compare gap_d / gap_d(first batch) instead
      gap_alpha=1.0,
      gap_min=0.5,
      gap_max=2.0,
      gap_momentum=0.9,
      gap_steers="loss",  # loss | sampling | both
      reward_refresh=False,  # a_t under the current student at each update
  ))
  return c


_PREFIXES = ("student", "teacher")
_VMAP = ("auto", "on", "off")
CHECKS = (
    *on_policy.CHECKS,
    ("teachers", bool, "the expert runs: a template with {domain} or"
     " domain=dir pairs"),
    ("opd.router", lambda v: v in teachers.ROUTERS,
     " or ".join(teachers.ROUTERS)),
    ("opd.delta_scale", math.isfinite, "a finite number"),
    ("opd.loss", lambda v: v in opd.LOSSES, " or ".join(opd.LOSSES)),
    ("opd.kl_alpha", config_lib.is_fraction, "in [0, 1]"),
    ("opd.top_k", positive, "> 0"),
    ("opd.lambda_orm", non_negative, ">= 0"),
    ("opd.entropy_threshold", non_negative, ">= 0 (0 disables)"),
    ("opd.extrapolation", non_negative, ">= 0 (1 disables)"),
    ("opd.teacher_devices", non_negative, ">= 0 (0: the student's mesh)"),
    ("opd.teacher_vmap", lambda v: v in _VMAP, " or ".join(_VMAP)),
    ("opd.prefix", lambda v: v in _PREFIXES, " or ".join(_PREFIXES)),
    ("opd.trb_delta", non_negative, ">= 0 (0: off)"),
    ("opd.trb_steps", non_negative, ">= 0"),
    ("opd.curriculum_entropy", non_negative, ">= 0 (0: off)"),
    ("opd.curriculum_start", positive, "> 0"),
    ("opd.curriculum_growth", positive, "> 0"),
    ("open_mopd.target_shares", lambda v: all(w >= 0 for w in v) and (
        not v or sum(v) > 0), "empty or non-negative with a positive sum"),
    ("open_mopd.token_share_power", non_negative, ">= 0 (1: exact)"),
    ("open_mopd.gap_statistic", lambda v: v in budget.GAP_STATISTICS,
     " or ".join(budget.GAP_STATISTICS)),
    ("open_mopd.gap_alpha", non_negative, ">= 0"),
    ("open_mopd.gap_min", positive, "> 0"),
    ("open_mopd.gap_max", positive, "> 0"),
    ("open_mopd.gap_momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("open_mopd.gap_steers", lambda v: v in budget.GAP_STEERS,
     ", ".join(budget.GAP_STEERS)),
)


def validate(full) -> None:
  """The combinations of routing, prefixes, losses and rollouts that do
  not go together."""
  on_policy.validate(full)
  shares = full.open_mopd.target_shares
  if shares and len(shares) != len(full.data.domains):
    raise ConfigError(f"open_mopd.target_shares: {len(shares)} shares for"
                      f" {len(full.data.domains)} domains")
  if full.open_mopd.gap_min > full.open_mopd.gap_max:
    raise ConfigError("open_mopd.gap_min: must be <= open_mopd.gap_max")
  opd_cfg = full.opd
  if opd_cfg.router == "delta" and opd_cfg.proxy_teacher:
    raise ConfigError("opd.proxy_teacher: the delta teacher already"
                      " shifts every expert by the base; use one of them")
  if opd_cfg.loss != "pg" and opd_cfg.extrapolation != 1.0:
    raise ConfigError("opd.extrapolation: needs opd.loss='pg' (a sampled-token"
                      " signal)")
  if opd_cfg.teacher_vmap == "on" and (
      opd_cfg.router not in teachers.TOKEN_ROUTERS or opd_cfg.proxy_teacher):
    raise ConfigError("opd.teacher_vmap: 'on' stacks the teachers of a token"
                      " router (opd.router=" + "|".join(
                          teachers.TOKEN_ROUTERS) + "), without"
                      " proxy_teacher; routed by sample, each teacher scores"
                      " only its own rows")
  off_policy = opd_cfg.prefix == "teacher" or opd_cfg.trb_delta > 0
  if opd_cfg.trb_delta > 0 and not opd_cfg.trb_steps:
    raise ConfigError("opd.trb_steps: the TRB warm-up needs the steps its"
                      " radius anneals over (> 0)")
  if opd_cfg.prefix == "teacher" and opd_cfg.trb_delta > 0:
    raise ConfigError("opd.trb_delta: teacher prefixes are sampled by the"
                      " teacher alone; TRB blends it with the student")
  if off_policy and (opd_cfg.router != "oracle" or opd_cfg.proxy_teacher
                     or opd_cfg.teacher_devices):
    raise ConfigError("opd.prefix: teacher prefixes and TRB sample from each"
                      " domain's own expert (opd.router=oracle, no"
                      " proxy_teacher, teacher_devices=0)")
  if opd_cfg.prefix == "teacher" and opd_cfg.loss == "pg":
    raise ConfigError("opd.prefix: teacher prefixes need a per-position loss"
                      " (opd.loss=kl or topk); the sampled-token pg loss"
                      " would need importance weights to the teacher")
  if opd_cfg.trb_delta > 0 and opd_cfg.loss == "pg" and not full.rl.tis_cap:
    raise ConfigError("rl.tis_cap: the TRB warm-up with opd.loss=pg needs"
                      " the truncated importance weight student/behaviour"
                      " (> 0)")
  if full.rl.max_policy_lag and (off_policy
                                 or opd_cfg.curriculum_entropy > 0):
    raise ConfigError("rl.max_policy_lag: one-step-async rollouts are the"
                      " student's own at the full budget (no teacher"
                      " prefixes, TRB or curriculum)")
  if opd_cfg.curriculum_entropy > 0 and (
      opd_cfg.curriculum_start > full.sampling.max_new_tokens):
    raise ConfigError(f"opd.curriculum_start: {opd_cfg.curriculum_start}"
                      " exceeds sampling.max_new_tokens"
                      f" ({full.sampling.max_new_tokens})")


VARIANTS = ("open", "smoke", "hf")


def recipe(config, variant: str) -> None:
  """``open``: the Open-MOPD mechanisms, the ablation's best setting."""
  if variant == "open":
    config.open_mopd.update(token_share=True, gap_budget=True,
                            reward_refresh=True, token_share_power=0.5,
                            gap_statistic="sequence_kl")
  elif variant == "smoke":
    config_lib.shrink_for_smoke(config)
    config.rl.update(prompts_per_step=8, group_size=2, minibatches=2)


def stacked_unembeddings(teacher_params, teacher_cfgs) -> jax.Array:
  """[teachers, D_max, V]: each teacher's ``teachers.combined_unembedding``,
  zero-padded in D."""
  ws = [teachers.combined_unembedding(c, p)
        for c, p in zip(teacher_cfgs, teacher_params)]
  width = max(w.shape[0] for w in ws)
  return jnp.stack([jnp.pad(w, ((0, width - w.shape[0]), (0, 0)))
                    for w in ws])


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

  def __init__(self, config, dirs, tokenizer, model_cfg, mesh):
    self.config = config
    opd_cfg, self.open_cfg = config.opd, config.open_mopd
    if opd_cfg.loss == "topk" and opd_cfg.top_k > model_cfg.vocab_size:
      raise ConfigError(f"opd.top_k: {opd_cfg.top_k} exceeds the vocabulary"
                        f" of {model_cfg.vocab_size}")
    self.names = tuple(config.data.domains)
    self.base = mixture.base_weights(self.names, config.data.weights)
    self.teacher_mesh = teachers.teacher_mesh(mesh, opd_cfg.teacher_devices)
    delta = opd_cfg.router == "delta"
    self.teachers = teachers.load_teachers(
        dirs, tokenizer,
        self.teacher_mesh, with_init=opd_cfg.proxy_teacher or delta,
        execution=model_cfg)
    self.router = teachers.ROUTERS[opd_cfg.router](self.names, self.teachers)
    student_init = (teachers.Model(model_cfg, runs.load_params(
        config.init, model_cfg, self.teacher_mesh)) if opd_cfg.proxy_teacher
                    else None)
    # expert_align compares every teacher's distribution with the student's
    wide = opd.full_vocabulary(opd_cfg) or self.router.needs_align
    ops = vocab.VocabOps.of(config.ops)
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
    self.stacked = self._stack(opd_cfg.teacher_vmap)
    # teachers score only the columns their rows reach where the student's
    # update is cut by length too (a speed option, exact to float
    # rounding); otherwise the student's columns, so that a teacher equal
    # to the student scores exactly as it does (a KL of exactly 0)
    self.cut_columns = config.rl.length_buckets > 1
    self.shared = (teacher_w,)
    self.mesh, self.model_cfg = mesh, model_cfg
    self.max_new_tokens = completion_budget(self.names,
                                            config.sampling.max_new_tokens)
    if self.router.needs_align:
      self.align_kl = opd.make_align_kl(model_cfg, config.sampling.temperature,
                                    ops)

  def _stack(self, mode: str):
    """A token router's teachers stacked for one vmapped pass
    (``teachers.stack_teachers``), as ``opd.teacher_vmap`` says: ``on``,
    or ``auto`` where ``teachers.room_to_stack``; their separate copies
    are then dropped (a token router never samples from a teacher). Not
    for proxy teachers, whose student base would be stacked once per
    teacher (``validate`` refuses ``on`` with them)."""
    if not self.router.per_token or mode == "off" or (
        self.config.opd.proxy_teacher) or (
            mode == "auto" and not teachers.room_to_stack(
                self.teacher_params)):
      return None
    stacked = teachers.stack_teachers(self.scorers, self.teacher_params)
    if stacked is None:
      if mode == "on":
        raise ConfigError("opd.teacher_vmap: 'on' needs teachers of one"
                          " architecture; theirs differ")
      return None
    self.teacher_params = [None] * len(self.scorers)
    self.teachers = [dataclasses.replace(t, model=teachers.Model(
        t.model.cfg, None), init=None) for t in self.teachers]
    return stacked

  def init_state(self) -> dict:
    state = {"gap": budget.init_gap_state(len(self.names))}
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
    return budget.gap_factors(budget.remaining_gap(gap_state, open_cfg.gap_relative),
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
                                 self.hidden_width, self.cut_columns))
      data["teacher_id"] = np.broadcast_to(
          teacher_ids.astype(np.int32)[:, None], mask.shape).copy()
      return
    every = teachers.score_every(self.scorers, self.teacher_params, data,
                                 self.teacher_mesh, self.hidden_width,
                                 self.stacked, self.cut_columns)
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
    gap_state = budget.update_gap_state(
        state["gap"], *budget.gap_observations(signal, mask, seq_ids,
                                             open_cfg.gap_statistic),
        open_cfg.gap_momentum)
    tokens = np.bincount(token_domain, minlength=len(self.names)).astype(
        float)
    loss_w = budget.domain_loss_weights(tokens, self.gap_now(gap_state), open_cfg,
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
  for run_dir in runs.runs_by_domain(
      config.teachers, tuple(config.data.domains)).values():
    run_config = runs.load_run_config(run_dir)
    runs.check_same_tokens(run_dir, run_config, tokenizer, "teachers")
    runs.check_same_vocabulary(run_dir, run_config, config.model.vocab_size,
                               "teachers")


def as_trained(fields: dict) -> dict:
  """A MOPD run's config (as JSON: ``config.json``'s form) as far as it
  changes training. Reward refresh re-scores ``a_t`` under the current
  student, and with a dense loss (``kl``, ``topk``) and no gate ``a_t``
  only enters the logged ``signal``, so it is dropped there: two runs equal
  here train bit-identically (measured: the same ``params_sha256`` on the
  three seeds of the imbalanced study, docs/results.md)."""
  fields = json.loads(json.dumps(fields))
  fields.pop("tokenizer", None)  # config.json's record of it
  fields["model"] = runs.model_fields(fields["model"])  # older runs'
  if fields["opd"]["loss"] != "pg" and not fields["opd"]["gate"]:
    fields["open_mopd"]["reward_refresh"] = False
  return fields


def make_method(config, tokenizer, model_cfg, mesh, sampling, dirs=None):
  """``on_policy.run``'s ``(method, loss, needs_reference)``; ``dirs``: the
  teachers' runs by domain, parsed from ``config.teachers`` when not
  given."""
  dirs = dirs or runs.runs_by_domain(config.teachers,
                                     tuple(config.data.domains))
  method = MOPD(config, dirs, tokenizer, model_cfg, mesh)
  loss = opd.make_loss(model_cfg, sampling, config.rl, config.opd,
                       config.open_mopd.reward_refresh,
                       vocab.VocabOps.of(config.ops))
  needs_base = config.rl.beta > 0 or config.opd.extrapolation != 1.0
  return method, loss, needs_base


def run(config, workdir: str):
  """Distil the teachers into the student; returns the final state."""
  write_eval = runs.write_eval(workdir, config.train.steps)
  dirs = runs.runs_by_domain(config.teachers, tuple(config.data.domains))

  def on_final(scalars):
    write_eval(scalars)
    write_headroom(workdir, scalars, config.init,
                   {d: run_dir for d, run_dir in dirs.items()
                    if d in config.eval.domains})

  return on_policy.run(config, workdir, tuple(config.data.domains),
                       functools.partial(make_method, dirs=dirs), "mopd",
                       on_final)
