"""Every knob of every method, with its default, and the checks on them.

``defaults(method)`` is the single source of the fields a method accepts; the
files under ``configs/`` start from it and change what differs. ``validate``
rejects an unknown field, a wrong type or an impossible value with a
``ConfigError`` naming the dotted field, which the entry point prints as one
line (exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Callable

import ml_collections

from mopd_jax import parallel
from mopd_jax.data.domains import DOMAINS, HELD_OUT_DOMAINS, TRAIN_DOMAINS
from mopd_jax.data.files import is_file_domain
from mopd_jax.errors import ConfigError
from mopd_jax.fusion import merge, teachers
from mopd_jax.objectives import grpo, opd
from mopd_jax.ops import vocab
from mopd_jax.models.config import (ATTENTION_IMPLS, EXECUTION_FIELDS,
                                    ModelConfig)
from mopd_jax.rollout.sampler import SamplingConfig

ALL_DOMAINS = tuple(DOMAINS)


def _domain(name) -> bool:
  """A built-in domain's name or a file domain's ``<kind>:<path>``."""
  return name in ALL_DOMAINS or (isinstance(name, str)
                                  and is_file_domain(name))


_DOMAIN_NAMES = ", ".join(ALL_DOMAINS) + " or <kind>:<path> (data/files.py)"
# The check of a tuple of domains (data.domains, eval.domains).
_DOMAIN_TUPLE = (lambda v: len(v) > 0 and all(map(_domain, v)),
                 "a non-empty tuple of " + _DOMAIN_NAMES)

# (dotted field, predicate, what it must be): each section's checks sit
# below the builder of its defaults; ``validate`` applies every one whose
# field the config has.
Checks = tuple[tuple[str, Callable[[Any], bool], str], ...]


def _positive(v):
  return v > 0


def _non_negative(v):
  return v >= 0


def _model(fields=None) -> ml_collections.ConfigDict:
  """``ModelConfig``'s defaults (only ``fields`` when given)."""
  values = dataclasses.asdict(ModelConfig())
  return ml_collections.ConfigDict(
      {k: v for k, v in values.items() if fields is None or k in fields})


def _mesh() -> ml_collections.ConfigDict:
  """Device mesh (one size may be -1: the rest of the devices), the
  logical-axis rule set (fsdp_tp | fsdp | dp, see mopd_jax/parallel.py) and
  how many devices a host without an accelerator is split into at the
  start of ``train`` (``parallel.use_cpu_devices``; 1 leaves the host as
  it is)."""
  return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1,
                                        rules="fsdp_tp", cpu_devices=1))


def _sampling(**overrides) -> ml_collections.ConfigDict:
  fields = dataclasses.asdict(SamplingConfig())
  for special in ("stop_ids", "pad_id"):  # taken from the tokenizer
    fields.pop(special)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def _common(method: str, init: bool) -> ml_collections.ConfigDict:
  """What every method has: its name, the seed, the data, sampling and
  evaluation settings, the mesh; ``init``: it starts from an earlier run
  (whose architecture it takes) instead of building a ``model``, and
  ``model`` holds only how to compute it."""
  c = ml_collections.ConfigDict()
  c.method = method
  c.seed = 0
  if init:
    c.init = ""  # workdir of the run to start from (the base model)
    # How that run's architecture is computed here (bfloat16, remat,
    # blocked attention); the rest of ``model`` comes with its weights.
    c.model = _model(EXECUTION_FIELDS)
  else:
    c.model = _model()
  c.data = ml_collections.ConfigDict(dict(
      data_dir=os.path.join("~", ".cache", "mopd_jax", "tfds"),
      train_examples=20_000,
      test_examples=256,  # of each held-out split: test and validation
      max_prompt_len=24,
      # A JSONL file of {"prompt", "answer", "domain"} lines to evaluate on
      # instead of the built-in test splits; empty: the built-in ones.
      eval_jsonl="",
  ))
  c.sampling = _sampling()
  c.eval = ml_collections.ConfigDict(dict(
      num_prompts=256, batch_size=128, temperature=1.0, greedy=True))
  c.mesh = _mesh()
  # Multi-host runs: jax.distributed.initialize when enabled (or when the
  # JAX_COORDINATOR_ADDRESS environment variable is set); empty or negative
  # fields are detected (TPU pods, SLURM) or read from JAX_NUM_PROCESSES and
  # JAX_PROCESS_ID.
  c.distributed = ml_collections.ConfigDict(dict(
      enabled=False, coordinator_address="", num_processes=0, process_id=-1))
  return c


_COMMON_CHECKS: Checks = (
    ("seed", lambda v: 0 <= v < 2**31, "in [0, 2^31)"),
    ("model.vocab_size", _positive, "> 0"),
    ("model.embed_dim", _positive, "> 0"),
    ("model.num_layers", _positive, "> 0"),
    ("model.num_heads", _positive, "> 0"),
    ("model.num_kv_heads", _positive, "> 0"),
    ("model.head_dim", lambda v: v > 0 and v % 2 == 0, "positive and even"),
    ("model.mlp_dim", _positive, "> 0"),
    ("model.rope_theta", _positive, "> 0"),
    ("model.dtype", lambda v: v in ("float32", "bfloat16"),
     "float32 or bfloat16"),
    ("model.param_dtype", lambda v: v in ("float32", "bfloat16"),
     "float32 or bfloat16"),
    ("model.attention_chunk", _non_negative, ">= 0 (0: dense attention)"),
    ("model.attention_impl", lambda v: v in ATTENTION_IMPLS,
     " or ".join(ATTENTION_IMPLS)),
    ("init", lambda v: bool(v), "the workdir of the run to start from"),
    ("data.domains", *_DOMAIN_TUPLE),
    ("data.weights", lambda v: all(w >= 0 for w in v) and (
        not v or sum(v) > 0), "empty or non-negative with a positive sum"),
    ("data.train_examples", _positive, "> 0"),
    ("data.test_examples", lambda v: 0 < v <= 10_000,
     "in [1, 10000] (prompts per held-out split)"),
    ("data.max_prompt_len", _positive, "> 0"),
    ("sampling.max_new_tokens", _positive, "> 0"),
    ("sampling.temperature", _non_negative, ">= 0 (0: greedy)"),
    ("sampling.top_k", _non_negative, ">= 0 (0 disables)"),
    ("sampling.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.num_prompts", _positive, "> 0"),
    ("eval.batch_size", _positive, "> 0"),
    ("eval.temperature", _non_negative, ">= 0"),
    ("mesh.cpu_devices", _positive, "> 0"),
    ("mesh.rules", lambda v: v in parallel.RULE_SETS,
     " or ".join(parallel.RULE_SETS)),
    ("distributed.num_processes", _non_negative, ">= 0 (0: detected)"),
)


def _training(c: ml_collections.ConfigDict, steps: int, rl: bool) -> None:
  """The sections of a method that trains: the step loop, the optimiser,
  checkpoints and the fused vocabulary ops of its loss."""
  c.train = ml_collections.ConfigDict(dict(
      steps=steps, log_every=5 if rl else 25, eval_every=100 if rl else 0,
      # Steps in a row whose update was skipped (non-finite loss or
      # gradient) before the run stops with exit code 2.
      max_consecutive_skips=5))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=2e-4 if rl else 3e-3, warmup_steps=5 if rl else 100,
      end_lr_fraction=1.0 if rl else 0.1,
      # 0: the decay spans the run after warm-up; N > 0: constant until the
      # last N steps (warmup-stable-decay; see training.learning_rate_schedule)
      decay_steps=0,
      weight_decay=0.0 if rl else 0.01,
      b1=0.9, b2=0.99 if rl else 0.95, grad_clip=1.0))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25 if rl else 250,
                                                keep=2))
  # The fused vocabulary ops of every loss: auto (Pallas on TPU, XLA
  # elsewhere) | xla | pallas; block_v: vocabulary tile (0: the op's default).
  c.ops = ml_collections.ConfigDict(dict(impl="auto", block_v=0))


_TRAINING_CHECKS: Checks = (
    ("train.steps", _positive, "> 0"),
    ("train.log_every", _positive, "> 0"),
    ("train.eval_every", _non_negative, ">= 0 (0: only at the end)"),
    ("train.max_consecutive_skips", _positive, "> 0"),
    # float32 holds the rate: above its range it is inf on the device
    ("optim.learning_rate", lambda v: 0 < v < 3.4e38,
     "finite, > 0 and within float32"),
    ("optim.warmup_steps", _non_negative, ">= 0"),
    ("optim.end_lr_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.decay_steps", _non_negative, ">= 0 (0: the whole run)"),
    ("optim.weight_decay", _non_negative, ">= 0"),
    ("optim.b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.grad_clip", _non_negative, ">= 0 (0 disables)"),
    ("checkpoint.every", _positive, "> 0"),
    ("checkpoint.keep", _positive, "> 0"),
    ("ops.impl", lambda v: v in ("auto", "xla", "pallas"),
     "auto, xla or pallas"),
    ("ops.block_v", _non_negative, ">= 0 (0: the op's default)"),
)


def _pretrain() -> ml_collections.ConfigDict:
  """Supervised next-token training of a ``model`` built from scratch on
  every domain's demonstrations."""
  c = _common("pretrain", init=False)
  c.data.domains = ALL_DOMAINS
  c.data.weights = ()  # empty: uniform over domains
  _training(c, steps=1500, rl=False)
  c.train.batch_size = 32  # packed rows of max_prompt_len+max_new_tokens
  # Stop by measurement: at the first evaluation (every train.eval_every
  # steps) where every training domain's greedy accuracy on its validation
  # split reaches ``target``; train.steps is then the limit (not reached:
  # one line, exit 2). 0: off, train.steps steps. ``ceiling`` is the top
  # of the band the base should land in: a domain above it at an
  # evaluation is drawn at ``hold_weight`` x its weight until the next.
  c.select = ml_collections.ConfigDict(dict(
      target=0.0, ceiling=1.0, hold_weight=0.1, num_prompts=256))
  return c


_PRETRAIN_CHECKS: Checks = (
    ("train.batch_size", _positive, "> 0"),
    ("select.target", lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    ("select.ceiling", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("select.num_prompts", _positive, "> 0"),
    ("select.hold_weight", lambda v: 0 < v <= 1, "in (0, 1]"),
)


def _on_policy(method: str) -> ml_collections.ConfigDict:
  """What GRPO, Mix RL and MOPD share: they start from ``init``, sample
  rollouts (``rl`` holds the batch shape and the clipped surrogate) and
  evaluate every domain (transfer and forgetting) as they go."""
  c = _common(method, init=True)
  # Mix RL: 800 steps, where every built-in expert of the earlier fixed
  # recipe had gained over 20 greedy points (docs/history.md); an expert
  # stops by measurement instead (_grpo).
  _training(c, steps=300 if method == "mopd" else 800, rl=True)
  c.eval.domains = ALL_DOMAINS
  c.rl = ml_collections.ConfigDict(dict(
      group_size=8,
      prompts_per_step=32,
      epochs=1,
      minibatches=1,
      advantage="grpo",  # grpo | drgrpo | rloo | passk
      pass_k=4,  # passk: the group is rewarded for its best of k samples
      advantage_eps=1e-6,
      eps_low=0.2,
      eps_high=0.28,
      dual_clip=0.0,  # c > 1 bounds negative-advantage losses; 0: off
      tis_cap=0.0,  # truncated sampler/trainer importance weight; 0: off
      beta=0.0,  # KL-to-reference weight; 0: no reference forward at all
      kl_estimator="k3",  # k1 | k2 | k3
      # weight of the entropy bonus -c H(pi) per token (keeps exploring)
      entropy_coef=0.0,
      aggregation="token_mean",  # | seq_mean_token_mean | constant
      drop_equal_groups=False,
      # 1: one-step-async rollouts, step t+1's sampled with step t's
      # parameters on a device of their own while step t trains (needs
      # tis_cap > 0 and two devices: mesh.cpu_devices=2 on a CPU); 0: off
      max_policy_lag=0,
  ))
  return c


_ON_POLICY_CHECKS: Checks = (
    ("eval.domains", *_DOMAIN_TUPLE),
    ("rl.group_size", lambda v: v >= 2, ">= 2"),
    ("rl.prompts_per_step", _positive, "> 0"),
    ("rl.epochs", _positive, "> 0"),
    ("rl.minibatches", _positive, "> 0"),
    ("rl.advantage", lambda v: v in grpo.ADVANTAGES,
     " or ".join(grpo.ADVANTAGES)),
    ("rl.advantage_eps", _positive, "> 0"),
    ("rl.eps_low", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("rl.eps_high", _non_negative, ">= 0"),
    ("rl.dual_clip", lambda v: v == 0 or v > 1, "0 (off) or > 1"),
    ("rl.tis_cap", _non_negative, ">= 0 (0 disables)"),
    ("rl.beta", _non_negative, ">= 0"),
    ("rl.kl_estimator", lambda v: v in grpo.KL_ESTIMATORS,
     " or ".join(grpo.KL_ESTIMATORS)),
    ("rl.entropy_coef", _non_negative, ">= 0"),
    ("rl.aggregation", lambda v: v in grpo.AGGREGATIONS,
     " or ".join(grpo.AGGREGATIONS)),
    ("rl.max_policy_lag", lambda v: v in (0, 1), "0 (synchronous) or 1"),
)


def _grpo() -> ml_collections.ConfigDict:
  """One ``domain``'s expert."""
  c = _on_policy("grpo")
  c.domain = "add"
  # Stop by measurement (stages/expert_stop.py): at the first evaluation
  # (every train.eval_every steps) where the domain's greedy accuracy on
  # stop.num_prompts validation prompts has gained ``gain`` over the
  # start; train.steps is then the limit. 0: off, train.steps steps.
  # On the built-in base the experts stop at 75-250 steps
  # (docs/results.md).
  c.stop = ml_collections.ConfigDict(dict(gain=0.2, num_prompts=128))
  c.train.update(steps=300, eval_every=25)
  return c


_GRPO_CHECKS: Checks = (
    ("domain", _domain, "one of " + _DOMAIN_NAMES),
    ("stop.gain", lambda v: 0 <= v <= 1, "in [0, 1] (0: off)"),
    ("stop.num_prompts", _positive, "> 0"),
)


def _mix_rl() -> ml_collections.ConfigDict:
  """GRPO on the pooled ``data.domains``, drawn by ``data.weights`` or by
  the adaptive ``mixture``."""
  c = _on_policy("mix_rl")
  c.data.domains = TRAIN_DOMAINS
  c.data.weights = ()  # empty: uniform over domains
  c.mixture = ml_collections.ConfigDict(dict(
      adaptive=False, exploration=0.5, floor=0.05, momentum=0.9))
  return c


_MIX_RL_CHECKS: Checks = (
    ("mixture.exploration", _non_negative, ">= 0"),
    ("mixture.floor", _non_negative, ">= 0"),
    ("mixture.momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
)


def _merge() -> ml_collections.ConfigDict:
  """The ``experts`` (one run per domain of ``data.domains``, each from the
  base run ``init``) merged by their task vectors; no training."""
  c = _common("merge", init=True)
  c.data.domains = TRAIN_DOMAINS
  c.eval.domains = ALL_DOMAINS
  # run directories: a template with {domain}, or domain=dir pairs; or a
  # plain list of runs (dir,dir,...): no data, nothing evaluated
  c.experts = ""
  c.merge = ml_collections.ConfigDict({
      "method": "task_arithmetic",
      "weights": (),  # one per expert, in data.domains order; empty: 1 each
      # lambda, density, gamma, t, tolerance: merge.PARAMETERS
      **{p.name: p.default for p in merge.PARAMETERS.values()},
      "normalize": "auto",  # auto (the method's mergekit default) | on | off
      "rescale": True,  # DARE: survivors divided by density
      # task-vector geometry (geometry.json): a top-r eigendecomposition
      # per layer matrix and expert, the slow part of a large model's merge
      "geometry": True,
      # per-leaf settings by name pattern, first match wins:
      # "pattern:key=value[,key=value];..." (a value a..b ramps over layers)
      "overrides": "",
      # Choose lambda (and density, for the sparsifying methods) on the
      # validation split: the best mean greedy accuracy of the grid.
      "sweep": False,
      "sweep_lambdas": (0.25, 0.5, 0.75, 1.0),
      "sweep_densities": (0.2, 0.5, 0.8),
      "sweep_prompts": 128,
  })
  return c


_MERGE_CHECKS: Checks = (
    ("merge.method", lambda v: v in merge.METHODS,
     "one of " + ", ".join(merge.METHODS)),
    *((f"merge.{p.name}", p.valid, p.must_be)
      for p in merge.PARAMETERS.values()),
    ("merge.normalize", lambda v: v in merge.NORMALIZE,
     " or ".join(merge.NORMALIZE)),
    *((f"merge.sweep_{p.name}s", lambda v, p=p: len(v) > 0 and all(
        map(p.valid, v)), f"a non-empty tuple of values {p.must_be}")
      for p in (merge.PARAMETERS["lambda"], merge.PARAMETERS["density"])),
    ("merge.sweep_prompts", _positive, "> 0"),
)


def _study() -> ml_collections.ConfigDict:
  """Every paradigm on shared artefacts: base, experts, Merge, Mix RL,
  MOPD, Open-MOPD, then every model evaluated and compared."""
  c = ml_collections.ConfigDict()
  c.method = "study"
  c.seed = 0  # the base's
  # more than one: the base shared, the experts and every fusion method
  # once per seed (seed_<s>/, each a one-seed study with every step's
  # seed set to s), the report with intervals over seeds; empty: one
  # study with every step's default seed, as before
  c.seeds = ()
  # seeds trained side by side, each in a process of its own (on a CPU,
  # up to one per core; on an accelerator 1: the processes would share it)
  c.seed_processes = 1
  c.steps = ("base", "experts", "merge", "mix_rl", "mopd", "open_mopd",
             "evaluate", "report")
  # the training domains (empty: the built-in four); file domains
  # (<kind>:<path>) need a base run given (an imported checkpoint)
  c.domains = ()
  c.base = ""  # an existing base run to use instead of training one
  c.experts = ""  # existing expert runs: a {domain} template or pairs
  c.variant = ""  # the configs' variant every step uses (smoke: "smoke")
  c.data_dir = ""  # the TFDS directory of every step (empty: its default)
  c.merge_methods = ("task_arithmetic", "ties", "dare_ties", "breadcrumbs",
                     "model_stock", "karcher", "sparse_union")
  c.merge_sweep = True  # lambda/density chosen on validation
  # Per step config, "field=value" strings (a value is read as JSON where
  # it parses); setting one replaces that step's tuple. The defaults are
  # the study's budget, about an hour on a 2-core CPU (docs/results.md):
  # experts as configs/grpo.py (each stops once its domain gained 20
  # greedy points on validation); Mix RL and MOPD train 100 steps,
  # evaluated every 25 on 128 prompts for the report's curves; Merge
  # sweeps lambda and density over two values each.
  c.overrides = ml_collections.ConfigDict(dict(
      all=(),  # applied to every step first (e.g. data.max_prompt_len)
      pretrain=(),
      grpo=(),
      merge=("merge.sweep_lambdas=[0.5,1.0]",
             "merge.sweep_densities=[0.3,0.7]"),
      mix_rl=("train.steps=100", "train.eval_every=25",
              "eval.num_prompts=128"),
      mopd=("train.steps=100", "train.eval_every=25",
            "eval.num_prompts=128")))
  # the final evaluation of every model: test prompts per domain, and
  # samples per prompt at temperature 1 on the first coverage_prompts of
  # them (pass@k up to k = samples; coverage at large k)
  c.eval = ml_collections.ConfigDict(dict(num_prompts=480, samples=64,
                                          coverage_prompts=64))
  c.mesh = _mesh()
  c.distributed = ml_collections.ConfigDict(dict(
      enabled=False, coordinator_address="", num_processes=0, process_id=-1))
  return c


_STUDY_CHECKS: Checks = (
    ("seeds", lambda v: all(isinstance(x, int) and x >= 0 for x in v)
     and len(set(v)) == len(v), "empty or a tuple of distinct seeds >= 0"),
    ("seed_processes", _positive, "> 0"),
    ("eval.num_prompts", _positive, "> 0"),
    ("eval.samples", lambda v: v >= 0, ">= 0"),
    ("eval.coverage_prompts", lambda v: v >= 0, ">= 0 (0: all num_prompts)"),
    ("domains", lambda v: all(map(_domain, v)),
     "empty (the built-in four) or a tuple of " + _DOMAIN_NAMES),
    ("merge_methods", lambda v: set(v) <= set(merge.METHODS),
     "a tuple of " + ", ".join(merge.METHODS)),
)


def _mopd_method() -> ml_collections.ConfigDict:
  c = _on_policy("mopd")
  c.data.domains = TRAIN_DOMAINS
  c.data.weights = ()  # empty: uniform over domains
  _mopd(c)
  return c


# method -> its complete default config
BUILDERS: dict[str, Callable[[], ml_collections.ConfigDict]] = {
    "pretrain": _pretrain, "grpo": _grpo, "mix_rl": _mix_rl,
    "mopd": _mopd_method, "merge": _merge, "study": _study}
METHODS = tuple(BUILDERS)


def defaults(method: str) -> ml_collections.ConfigDict:
  """The complete default config of ``method``.

  ``pretrain`` builds a model from ``model``; every other method starts
  from the run in ``init`` and takes its architecture from there. ``grpo``
  trains one ``domain``'s expert; ``mix_rl`` pools ``data.domains`` by
  ``data.weights`` (or the adaptive ``mixture``); ``mopd`` distils the
  ``teachers`` (one expert run per domain) into the student on its own
  rollouts of the pooled prompts; ``merge`` combines the ``experts``'
  task vectors.
  """
  if method not in BUILDERS:
    raise ConfigError(f"method: unknown method {method!r}; known: "
                      + ", ".join(METHODS))
  return BUILDERS[method]()


def _mopd(c: ml_collections.ConfigDict) -> None:
  """The distillation sections of ``mopd`` (the ``rl`` section carries the
  batch shape, the clip of the ``pg`` loss and the outcome advantage)."""
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


_MOPD_CHECKS: Checks = (
    ("teachers", lambda v: bool(v), "the expert runs: a template with"
     " {domain} or domain=dir pairs"),
    ("opd.router", lambda v: v in teachers.ROUTERS,
     " or ".join(teachers.ROUTERS)),
    ("opd.delta_scale", math.isfinite, "a finite number"),
    ("opd.loss", lambda v: v in opd.LOSSES, " or ".join(opd.LOSSES)),
    ("opd.kl_alpha", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("opd.top_k", _positive, "> 0"),
    ("opd.lambda_orm", _non_negative, ">= 0"),
    ("opd.entropy_threshold", _non_negative, ">= 0 (0 disables)"),
    ("opd.extrapolation", _non_negative, ">= 0 (1 disables)"),
    ("opd.teacher_devices", _non_negative, ">= 0 (0: the student's mesh)"),
    ("opd.prefix", lambda v: v in ("student", "teacher"),
     "student or teacher"),
    ("opd.trb_delta", _non_negative, ">= 0 (0: off)"),
    ("opd.trb_steps", _non_negative, ">= 0"),
    ("opd.curriculum_entropy", _non_negative, ">= 0 (0: off)"),
    ("opd.curriculum_start", _positive, "> 0"),
    ("opd.curriculum_growth", _positive, "> 0"),
    ("open_mopd.target_shares", lambda v: all(w >= 0 for w in v) and (
        not v or sum(v) > 0), "empty or non-negative with a positive sum"),
    ("open_mopd.token_share_power", _non_negative, ">= 0 (1: exact)"),
    ("open_mopd.gap_statistic", lambda v: v in opd.GAP_STATISTICS,
     " or ".join(opd.GAP_STATISTICS)),
    ("open_mopd.gap_alpha", _non_negative, ">= 0"),
    ("open_mopd.gap_min", _positive, "> 0"),
    ("open_mopd.gap_max", _positive, "> 0"),
    ("open_mopd.gap_momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("open_mopd.gap_steers", lambda v: v in ("loss", "sampling", "both"),
     "loss, sampling or both"),
)


def shrink_for_smoke(config: ml_collections.ConfigDict) -> None:
  """The sizes every ``:smoke`` variant shares: 4 steps, tiny data, an
  evaluation and a checkpoint every 2 steps (seconds on a CPU, for tests)."""
  config.data.update(train_examples=64, test_examples=16)
  config.train.update(steps=4, log_every=2, eval_every=2)
  config.checkpoint.update(every=2, keep=2)
  config.eval.update(num_prompts=8, batch_size=8)


def for_real_models(config: ml_collections.ConfigDict) -> None:
  """What every ``:hf`` variant shares: a Hugging Face checkpoint
  (imported with ``mopd_jax.convert``) on accelerators. bfloat16 matmuls
  over float32 master weights, per-layer remat and blocked attention (the
  memory plan's 7B rows), prompts of up to 512 tokens and completions of up
  to 1,024, parameters sharded over every device (FSDP), a learning rate
  of 1e-6 (a pretrained model's RL rate, not the tiny model's 2e-4) and
  train minibatches of 32 sequences (a rollout batch of 256 in 8; the
  memory plan's rows). The checkpoint and the data come from flags
  (``--config.init``, ``--config.base``, ``--config.data.domains``,
  ``--config.domain``)."""
  if "optim" in config:
    config.optim.learning_rate = 1e-6
  if "rl" in config:
    config.rl.minibatches = (config.rl.prompts_per_step
                             * config.rl.group_size) // 32
  if "model" in config:
    config.model.update(dtype="bfloat16", remat=True, attention_chunk=512)
  if "data" in config:
    config.data.max_prompt_len = 512
  if "sampling" in config:
    config.sampling.max_new_tokens = 1024
  config.mesh.update(data=1, fsdp=-1)
  if "batch_size" in config.eval:
    config.eval.update(num_prompts=256, batch_size=64)


_CHECKS: Checks = (_COMMON_CHECKS + _TRAINING_CHECKS + _PRETRAIN_CHECKS
                   + _ON_POLICY_CHECKS + _GRPO_CHECKS + _MIX_RL_CHECKS
                   + _MERGE_CHECKS + _STUDY_CHECKS + _MOPD_CHECKS)


def _type_ok(default, value) -> bool:
  if isinstance(default, bool) or isinstance(value, bool):
    return type(default) is type(value)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  if isinstance(default, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(default))


def _compare(schema, config, prefix: str) -> None:
  for key in config.keys():
    path = prefix + key
    if key not in schema:
      close = difflib.get_close_matches(key, list(schema.keys()), n=1)
      hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
      raise ConfigError(f"{path}: unknown field{hint}")
    default, value = schema[key], config[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: must be a section, got {value!r}")
      _compare(default, value, path + ".")
    elif not _type_ok(default, value):
      raise ConfigError(f"{path}: expected {type(default).__name__}, got"
                        f" {type(value).__name__} {value!r}")


def _get(config, path: str):
  for part in path.split("."):
    config = config[part]
  return config


def _has(config, path: str) -> bool:
  for part in path.split("."):
    if not isinstance(config, ml_collections.ConfigDict) or part not in config:
      return False
    config = config[part]
  return True


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Check ``config`` against ``defaults(config.method)``; fill missing fields.

  Returns the complete config (defaults for any field the file left out).
  """
  if "method" not in config:
    raise ConfigError("method: missing; known: " + ", ".join(METHODS))
  schema = defaults(config.method)
  _compare(schema, config, "")
  full = schema
  full.update(config)
  for path, ok, what in _CHECKS:
    if _has(full, path) and not ok(_get(full, path)):
      raise ConfigError(f"{path}: must be {what}, got {_get(full, path)!r}")
  if "num_heads" in full.get("model", {}) and (
      full.model.num_heads % full.model.num_kv_heads):
    raise ConfigError("model.num_kv_heads: must divide model.num_heads"
                      f" ({full.model.num_heads}), got"
                      f" {full.model.num_kv_heads}")
  if _has(full, "model.attention_impl") and (
      full.model.attention_impl == "cudnn" and full.model.dtype != "bfloat16"):
    raise ConfigError("model.attention_impl: cudnn needs model.dtype="
                      "bfloat16 (cuDNN's flash attention has no float32)")
  if _has(full, "data.weights") and full.data.weights and len(
      full.data.weights) != len(full.data.domains):
    raise ConfigError(
        f"data.weights: {len(full.data.weights)} weights for"
        f" {len(full.data.domains)} domains")
  if "select" in full and full.select.target > 0:
    _validate_select(full)
  if "stop" in full and full.stop.gain > 0 and full.train.eval_every <= 0:
    raise ConfigError("train.eval_every: stop.gain needs a validation"
                      " evaluation every N > 0 steps")
  if "rl" in full:
    _validate_rl(full)
  if "opd" in full:
    _validate_mopd(full)
  if "merge" in full:
    # Merge's own: a study's `experts` may be empty (it trains them).
    if not full.experts:
      raise ConfigError("experts: must be the expert runs: a template with"
                        " {domain} or domain=dir pairs, got ''")
    experts = (len(merge.run_list(full.experts))
               if merge.is_run_list(full.experts) else len(full.data.domains))
    if full.merge.weights and len(full.merge.weights) != experts:
      raise ConfigError(f"merge.weights: {len(full.merge.weights)} weights"
                        f" for {experts} experts")
    if full.merge.sweep and merge.is_run_list(full.experts):
      raise ConfigError("merge.sweep: needs the experts' domains to score"
                        " on (domain=dir pairs or a {domain} template), not"
                        " a plain list of runs")
    merge.parse_overrides(full.merge.overrides)
  return full


def _validate_select(full) -> None:
  if not [d for d in full.data.domains if d not in HELD_OUT_DOMAINS]:
    raise ConfigError("select.target: data.domains has no training domain to"
                      " select on")
  if full.train.eval_every <= 0:
    raise ConfigError("train.eval_every: select.target needs a validation"
                      " evaluation every N > 0 steps")
  if full.optim.end_lr_fraction != 1.0:
    # A decay tied to train.steps (the limit) would make the chosen base
    # depend on the limit.
    raise ConfigError("optim.end_lr_fraction: select.target needs a constant"
                      f" rate after warm-up (1.0), got"
                      f" {full.optim.end_lr_fraction}")
  if full.select.ceiling < full.select.target:
    raise ConfigError("select.ceiling: must be >= select.target")


def _validate_rl(full) -> None:
  batch = full.rl.prompts_per_step * full.rl.group_size
  if full.rl.advantage == "passk" and not (
      1 <= full.rl.pass_k <= full.rl.group_size):
    raise ConfigError(f"rl.pass_k: {full.rl.pass_k} must be in [1,"
                      f" rl.group_size = {full.rl.group_size}]")
  if batch % full.rl.minibatches:
    raise ConfigError(f"rl.minibatches: {full.rl.minibatches} does not divide"
                      f" the {batch} sequences of a step")
  if full.rl.max_policy_lag and not full.rl.tis_cap:
    raise ConfigError("rl.tis_cap: one-step-async rollouts are trained on"
                      " with the truncated importance weight to the"
                      " previous policy (> 0)")
  if full.sampling.top_k or full.sampling.top_p < 1:
    raise ConfigError("sampling.top_k: RL rollouts must sample the full"
                      " distribution (top_k=0, top_p=1)")
  if full.sampling.temperature <= 0:
    raise ConfigError("sampling.temperature: RL rollouts need temperature > 0")
  if "mixture" in full and full.mixture.floor * len(full.data.domains) >= 1:
    raise ConfigError(f"mixture.floor: {full.mixture.floor} times"
                      f" {len(full.data.domains)} domains must be < 1")


def _validate_mopd(full) -> None:
  shares = full.open_mopd.target_shares
  if shares and len(shares) != len(full.data.domains):
    raise ConfigError(f"open_mopd.target_shares: {len(shares)} shares for"
                      f" {len(full.data.domains)} domains")
  if full.open_mopd.gap_min > full.open_mopd.gap_max:
    raise ConfigError("open_mopd.gap_min: must be <= open_mopd.gap_max")
  if full.opd.router == "delta" and full.opd.proxy_teacher:
    raise ConfigError("opd.proxy_teacher: the delta teacher already"
                      " shifts every expert by the base; use one of them")
  if full.opd.loss != "pg" and full.opd.extrapolation != 1.0:
    raise ConfigError("opd.extrapolation: needs opd.loss='pg' (a sampled-token"
                      " signal)")
  opd_cfg = full.opd
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


def op_options(config: ml_collections.ConfigDict) -> vocab.VocabOps:
  """The fused vocabulary ops' options, from ``config.ops``."""
  return vocab.VocabOps(impl=config.ops.impl,
                        block_v=config.ops.block_v or None)


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict())


def sampling_config(section: ml_collections.ConfigDict, tokenizer,
                    **overrides) -> SamplingConfig:
  fields = dict(section.to_dict(), stop_ids=tuple(tokenizer.stop_ids),
                pad_id=tokenizer.pad_id)
  fields.update(overrides)
  return SamplingConfig(**fields)
