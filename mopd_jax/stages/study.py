"""The fusion study: base -> one expert per training domain -> Merge (each
of ``merge_methods``, swept on validation) -> Mix RL -> MOPD -> Open-MOPD
-> evaluation of every model -> report, on shared artefacts.

Every step is an ordinary run in ``<workdir>/<name>`` started in this
process (``stages.run``), so a re-run skips finished steps (their
``summary.json`` is there) and resumes an interrupted one exactly as a
single run does. ``steps`` selects a subset; ``base`` and ``experts`` plug
in existing runs. The report is ``results.json`` and ``report.md`` with
figures (``evaluation/report.py``, ``evaluation/study_report.py``).

With ``seeds`` (more than none) the base is trained once and each seed is
a one-seed study of its own in ``<workdir>/seed_<s>`` (an ordinary run,
resumed or skipped as any step is) with every step's ``seed`` set to
``s``; the report then gives means over seeds with intervals and paired
differences between paradigms (``evaluation/seeded.py``).
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import ml_collections

from mopd_jax import config as config_lib
from mopd_jax import checkpointing, json_files, runs, stages
from mopd_jax.config import non_negative, positive
from mopd_jax.data.domains import (DOMAINS, EXTRA_DOMAINS, HELD_OUT_DOMAINS,
                                   TRAIN_DOMAINS, is_domain)
from mopd_jax.data import files
from mopd_jax.merge.methods import METHODS as MERGE_METHODS
from mopd_jax.stages import copd as copd_stage
from mopd_jax.stages import mopd as mopd_stage
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation.run_eval import eval_file_name, evaluate_run
from mopd_jax.evaluation import study_results
from mopd_jax.evaluation.study_results import RESULTS_FILE
from mopd_jax.training import SUMMARY_FILE

# the fields of the open_mopd section that go with each mechanism
_MECHANISMS = {"token_share": ("token_share_power",),
               "gap_budget": ("gap_statistic",), "reward_refresh": ()}


def _mechanism_alone(name: str) -> dict:
  """The fields ``:open`` sets for Open-MOPD's mechanism ``name``."""
  return {f"open_mopd.{k}": v for k, v in
          config_file("mopd", "open").open_mopd.items()
          if k == name or k in _MECHANISMS[name]}

# The MOPD runs a study can add beside plain MOPD, each a step of that
# name on the same base, experts, data and evaluation, reported against
# plain MOPD: the fields they set on configs/mopd.py (open_mopd: the :open
# variant's mechanisms; mopd_from_merge also starts from the best merge).
MOPD_VARIANTS = {
    "open_mopd": lambda: {f"open_mopd.{k}": v for k, v in
                          config_file("mopd", "open").open_mopd.items()},
    "mopd_delta": lambda: {"opd.router": "delta"},
    "mopd_entropy": lambda: {"opd.router": "entropy"},
    "mopd_novelty": lambda: {"opd.router": "novelty"},
    "mopd_align": lambda: {"opd.router": "expert_align"},
    "mopd_from_merge": dict,
    # one-step-async rollouts (a second device samples; on a CPU the study
    # needs mesh.cpu_devices=2, which :beyond sets), the truncated weight
    # of bench_async.py
    "mopd_async": lambda: {"rl.max_policy_lag": 1, "rl.tis_cap": 2.0},
    # prefix source x KL direction (plain MOPD: student prefixes, reverse)
    "mopd_forward": lambda: {"opd.kl_alpha": 1.0},
    "mopd_mixed": lambda: {"opd.kl_alpha": 0.5},
    "mopd_teacher_reverse": lambda: {"opd.prefix": "teacher"},
    "mopd_teacher_forward": lambda: {"opd.prefix": "teacher",
                                     "opd.kl_alpha": 1.0},
    # the student's entropy starts near 0.2 nats on the built-in domains
    "mopd_curriculum": lambda: {"opd.curriculum_entropy": 0.15,
                                "opd.curriculum_start": 8,
                                "opd.curriculum_growth": 4},
    "mopd_trb": lambda: {"opd.trb_delta": 0.5, "opd.trb_steps": 25},
    # each Open-MOPD mechanism alone, as the :open variant sets it
    **{f"mopd_{m}": functools.partial(_mechanism_alone, m)
       for m in _MECHANISMS},
}


def async_steps(steps) -> list[str]:
  """The MOPD variants among ``steps`` that sample one step ahead on a
  device of their own (``rl.max_policy_lag`` set)."""
  return [s for s in steps
          if MOPD_VARIANTS.get(s, dict)().get("rl.max_policy_lag")]


# Co-evolving experts (configs/copd.py) and the two ways to consolidate
# them: a merge (the study's copd_merge_method, swept as its merges are)
# and MOPD (the plain recipe, the co-evolved experts as teachers).
COPD_STEPS = ("copd", "copd_merge", "copd_mopd")
STEPS = ("base", "experts", "merge", "mix_rl", "mopd", *MOPD_VARIANTS,
         *COPD_STEPS, "evaluate", "report")
EVALUATIONS = "evaluations"


def defaults() -> ml_collections.ConfigDict:
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
  # the merge of the co-evolved experts (step copd_merge): the best merge
  # of 2026-12-02's default study over 3 seeds, 0.6 points below
  # task_arithmetic in 2026-12-04's (docs/results.md): one of the two best
  c.copd_merge_method = "dare_ties"
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
            "eval.num_prompts=128"),
      copd=()))
  # the final evaluation of every model: test prompts per domain, and
  # samples per prompt at temperature 1 on the first coverage_prompts of
  # them (pass@k up to k = samples; coverage at large k)
  c.eval = ml_collections.ConfigDict(dict(num_prompts=480, samples=64,
                                          coverage_prompts=64))
  c.mesh = config_lib.mesh()
  c.distributed = config_lib.distributed()
  return c


CHECKS = (
    ("seed", lambda v: 0 <= v < 2**31, "in [0, 2^31)"),
    ("seeds", lambda v: all(isinstance(x, int) and x >= 0 for x in v)
     and len(set(v)) == len(v), "empty or a tuple of distinct seeds >= 0"),
    ("seed_processes", positive, "> 0"),
    ("eval.num_prompts", positive, "> 0"),
    ("eval.samples", non_negative, ">= 0"),
    ("eval.coverage_prompts", non_negative, ">= 0 (0: all num_prompts)"),
    ("domains", lambda v: all(map(is_domain, v)),
     "empty (the built-in four) or a tuple of " + config_lib.DOMAIN_NAMES),
    ("merge_methods", lambda v: set(v) <= set(MERGE_METHODS),
     "a tuple of " + ", ".join(MERGE_METHODS)),
    ("copd_merge_method", lambda v: v in MERGE_METHODS,
     "one of " + ", ".join(MERGE_METHODS)),
    *config_lib.DEVICE_CHECKS,
)

# study variant -> the MOPD variants it adds (MOPD_VARIANTS)
STUDY_ADDITIONS = {
    "beyond": ("mopd_delta", "mopd_entropy", "mopd_novelty", "mopd_align",
               "mopd_from_merge", "mopd_async"),
    "variants": ("mopd_forward", "mopd_mixed", "mopd_teacher_reverse",
                 "mopd_teacher_forward", "mopd_curriculum", "mopd_trb",
                 *COPD_STEPS),
}
# :imbalanced's MOPD variants beside plain MOPD and Open-MOPD
IMBALANCED_STEPS = ("mopd_token_share", "mopd_gap_budget",
                    "mopd_reward_refresh")
VARIANTS = ("smoke", "hf", "seeds", "smoke_seeds", "beyond", "smoke_beyond",
            "variants", "smoke_variants", "imbalanced", "smoke_imbalanced")


def recipe(config, variant: str) -> None:
  """``smoke``: every step's own smoke config, a few prompts; ``seeds``:
  three seeds, two at a time (a 2-core CPU); ``hf``: every step's ``hf``
  variant; ``beyond`` and ``variants``: the MOPD variants of
  ``STUDY_ADDITIONS`` beside plain MOPD (``smoke_*`` at smoke size)."""
  if variant.startswith("smoke"):
    config.variant = "smoke"
    config.merge_methods = ("ties",)
    for name in config.overrides:  # the smoke configs' own sizes
      config.overrides[name] = ()
    config.eval.update(num_prompts=8, samples=2, coverage_prompts=4)
  added = next((steps for name, steps in STUDY_ADDITIONS.items()
                if variant.endswith(name)), ())
  if added:  # MOPD variants beside plain MOPD, before the evaluations
    at = config.steps.index("evaluate")
    config.steps = config.steps[:at] + added + config.steps[at:]
  if async_steps(added):  # their sampler's own device (CPU hosts only)
    config.mesh.cpu_devices = max(config.mesh.cpu_devices, 2)
  if variant.endswith("imbalanced"):
    imbalanced(config, smoke=variant.startswith("smoke"))
  if variant == "seeds":
    config.update(seeds=(0, 1, 2), seed_processes=2)  # a 2-core CPU
  elif variant == "smoke_seeds":
    config.seeds = (0, 1)
  elif variant == "hf":
    config.variant = "hf"
    config.mesh.update(data=1, fsdp=-1)


def imbalanced(config, smoke: bool) -> None:
  """The conditions of Open-MOPD's misallocation, built-in data only: a
  long derivation (``derive``, about 113 tokens an answer) beside a
  concise domain (``instruct``, about 2.7), 43 times shorter, so that
  ``instruct`` holds about 2% of MOPD's loss tokens; the paper's
  multi-update staleness (``rl.epochs=2`` over ``rl.minibatches=4``:
  eight updates per batch of rollouts, so reward refresh has something to
  fix); plain MOPD, each mechanism alone and all three, each reported
  against plain MOPD. No merges or Mix RL: the question is MOPD's."""
  config.domains = ("derive", "instruct")
  config.steps = ("base", "experts", "mopd", "open_mopd",
                  *IMBALANCED_STEPS, "evaluate", "report")
  config.merge_methods = ()
  # completions long enough for derive's (up to 155 tokens; the base's
  # packed rows follow); an expert or MOPD run's budget is each domain's
  # own (completion_budget)
  # and every model's layers as a loop, not a scan: on a CPU the built-in
  # model's gradient ran 1.2-1.4x faster (``model.scan_layers``), which
  # this variant's 60-minute budget needs
  config.overrides.all = tuple(config.overrides.all) + (
      "sampling.max_new_tokens=192", "model.scan_layers=false")
  # derive's long answers are learned slowly from scratch (5% greedy at
  # step 550 where chain had 25% by 1400): the base stops at 10% on every
  # training domain instead of 25%, still far from its experts
  if not smoke:
    config.overrides.pretrain = tuple(config.overrides.pretrain) + (
        "select.target=0.1",)
  # derive's rollouts are 40 times instruct's: half the default batches
  # (32 prompts a step), 50 MOPD steps evaluated every 10 on 64 prompts
  # (the dynamics while the domains still improve), experts stopped by
  # step 200 at the latest
  # (each minibatch's updates in four parts by length,
  # ``rl.length_buckets``: the same steps, a concise row no longer padded
  # to a derivation's width; 2.1 times faster updates, docs/performance.md)
  config.overrides.mopd = ("rl.epochs=2",) + (
      () if smoke else ("train.steps=50", "train.eval_every=10",
                        "eval.num_prompts=64", "rl.prompts_per_step=32",
                        "rl.length_buckets=4"))
  if not smoke:
    config.overrides.grpo = ("rl.prompts_per_step=16", "train.steps=200",
                             "rl.length_buckets=4")
    config.eval.update(samples=4, coverage_prompts=64)


def config_file(name: str, variant: str = ""):
  """``configs/<name>.py:<variant>``, from the package (what that file
  returns), so an installed package needs no configs folder."""
  return stages.recipe(name, variant)


def child_config(name: str, variant: str, overrides=(), **fields):
  """``configs/<name>.py:<variant>`` with ``fields`` set and the
  ``field=value`` strings of ``overrides`` applied (values read as JSON
  where they parse, else as strings), validated."""
  config = config_file(name, variant)
  for key, value in fields.items():
    _set(config, key, value)
  for item in overrides:
    key, sep, text = item.partition("=")
    if not sep:
      raise ConfigError(f"overrides.{name}: {item!r} is not field=value")
    try:
      value = json.loads(text)
    except ValueError:
      value = text
    _set(config, key.strip(), tuple(value) if isinstance(value, list)
         else value, where=f"overrides.{name}: ")
  return stages.validate(config)


def _set(config, dotted: str, value, where: str = "") -> None:
  """``config.<dotted> = value`` for a field the config has (``where``
  names the setting in errors)."""
  *parents, last = dotted.split(".")
  node = config
  for part in parents + [last]:
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f"{where}{dotted}: unknown field")
    parent, node = node, node[part]
  if isinstance(node, ml_collections.ConfigDict):
    raise ConfigError(f"{where}{dotted}: a section, not a value")
  try:
    parent[last] = value
  except (TypeError, ValueError):
    raise ConfigError(f"{where}{dotted}: {value!r} does not fit the field"
                      f" ({type(node).__name__})") from None


class Study:
  """The runs of one study workdir, and the order they are made in."""

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, workdir
    self.domains = domains(config)
    # Evaluated on: the built-in five (transfer to the held-out one); a
    # choice of built-in domains and the held-out one (the base trains on
    # them); or the user's own domains alone.
    built_in = all(d in DOMAINS or d in EXTRA_DOMAINS
                   for d in config.domains)
    self.eval_domains = (tuple(DOMAINS) if not config.domains else
                         self.domains + tuple(
                             d for d in HELD_OUT_DOMAINS
                             if d not in self.domains) if built_in
                         else self.domains)
    self.held_out = tuple(d for d in HELD_OUT_DOMAINS
                          if d in self.eval_domains)
    self.base = config.base or os.path.join(workdir, "base")
    self.experts = (runs.runs_by_domain(config.experts, self.domains, "experts")
                    if config.experts else
                    {d: os.path.join(workdir, f"expert_{files.label(d)}")
                     for d in self.domains})
    self.template = ",".join(f"{d}={p}" for d, p in self.experts.items())
    self.variant = config.variant

  def models(self) -> dict[str, str]:
    """``{model name: run dir}`` of every model the study compares."""
    out = {"base": self.base}
    out.update({f"expert/{d}": p for d, p in self.experts.items()})
    out.update({f"merge/{m}": os.path.join(self.workdir, f"merge_{m}")
                for m in self.config.merge_methods})
    for name in ("mix_rl", "mopd", "open_mopd"):
      out[name] = os.path.join(self.workdir, name)
    for name in (*MOPD_VARIANTS, *COPD_STEPS[1:]):
      # the added ones: selected, or run before
      run_dir = os.path.join(self.workdir, name)
      if name in self.config.steps or os.path.exists(
          os.path.join(run_dir, "config.json")):
        out[name] = run_dir
    return out

  def copd_experts(self) -> str:
    """The co-evolved experts as a ``domain=run`` list."""
    workdir = os.path.join(self.workdir, "copd")
    return ",".join(f"{d}={copd_stage.expert_dir(workdir, d)}"
                    for d in self.domains)

  def runs(self) -> study_results.StudyRuns:
    """What the report reads of this study."""
    models = self.models()
    c = self.config.eval
    return study_results.StudyRuns(
        workdir=self.workdir, models=models,
        evaluations={m: evaluation_path(self, m) for m in models},
        domains=self.domains, held_out=self.held_out,
        eval_domains=self.eval_domains, num_prompts=c.num_prompts,
        samples=c.samples, coverage_prompts=c.coverage_prompts,
        merges=tuple(f"merge/{m}" for m in self.config.merge_methods),
        curves=tuple(n for n in ("mix_rl", "mopd", *MOPD_VARIANTS,
                                 "copd_mopd") if n in models),
        copd=os.path.join(self.workdir, "copd"))

  def best_merge(self) -> str:
    """The run of the merge method with the highest mean greedy validation
    accuracy (each merge's ``validation_greedy_mean``; a merge written
    before it was recorded: the mean of its sweep's chosen point in
    ``sweep.json``; the first of equals)."""
    scores = {}
    for m in self.config.merge_methods:
      run_dir = self.models()[f"merge/{m}"]
      if not runs.finished(run_dir):
        continue
      score = json_files.read_object(os.path.join(
          run_dir, SUMMARY_FILE)).get("validation_greedy_mean")
      sweep = os.path.join(run_dir, "sweep.json")
      if score is None and os.path.exists(sweep):
        found = json_files.read_object(sweep)
        score = next((g["mean"] for g in found.get("grid", ())
                      if all(g.get(k) == v for k, v in
                             found.get("best", {}).items())), None)
      if score is not None:
        scores[run_dir] = score
    if not scores:
      raise ConfigError("study: mopd_from_merge needs a finished merge with"
                        " a validation score (steps merge)")
    return max(scores, key=scores.get)

  def child_config(self, name: str, **fields):
    """``configs/<name>.py`` as this study runs it: its variant, the
    overrides of every step (``overrides.all``) then its own, the study's
    data directory, domains and mesh, and ``fields``."""
    for key, value in self.config.mesh.items():
      fields[f"mesh.{key}"] = value
    if self.config.data_dir:
      fields["data.data_dir"] = self.config.data_dir
    if self.config.domains:
      if name == "pretrain":  # built-in domains only (check), uniform
        fields["data.domains"] = self.eval_domains
        fields["data.weights"] = ()
      else:
        fields["eval.domains"] = self.eval_domains
      if name in ("mix_rl", "mopd", "merge", "copd"):
        fields["data.domains"] = self.domains
    overrides = (tuple(self.config.overrides.get("all", ()))
                 + tuple(self.config.overrides.get(name, ())))
    return child_config(name, self.variant, overrides, **fields)

  @functools.cached_property
  def eval_settings(self):
    """What evaluates every model: the settings a run lacks (an imported
    base has no data or sampling sections) and the precision, from the
    study's own variant."""
    return self.child_config("mix_rl", init=self.base)

  def child(self, label: str, name: str, workdir: str, **fields) -> None:
    """Train (or resume) one run, unless it is finished or is plain MOPD's
    twin (then a link to that run)."""
    if os.path.exists(os.path.join(workdir, SUMMARY_FILE)):
      print(f"study: {label} finished before ({workdir})")
      return
    config = self.child_config(name, **fields)
    twin = self.twin(name, workdir, config)
    if twin:
      try:
        os.symlink(os.path.relpath(twin, os.path.dirname(workdir)), workdir)
      except OSError:  # a file system without links: train it after all
        pass
      else:
        print(f"study: {label} trains bit-identically to plain MOPD"
              f" (mopd.as_trained): {workdir} links to {twin}")
        return
    stages.run(config, workdir)

  def twin(self, name: str, workdir: str, config) -> str | None:
    """The finished plain MOPD run when the new MOPD run ``workdir`` would
    train exactly as it did (``mopd.as_trained``, the model resolved from
    ``init`` as the run would resolve it), else None."""
    plain = self.models()["mopd"]
    if (name != "mopd" or workdir == plain or os.path.lexists(workdir)
        or not runs.finished(plain)):
      return None
    config = config.copy_and_resolve_references()
    runs.resolve_model(config)
    ours = mopd_stage.as_trained(config.to_dict())
    theirs = mopd_stage.as_trained(json_files.read_object(
        os.path.join(plain, runs.CONFIG_FILE)))
    return plain if ours == theirs else None


def seed_dir(workdir: str, seed: int) -> str:
  return os.path.join(workdir, f"seed_{seed}")


def seed_config(config, seed: int, workdir: str):
  """Seed ``seed`` of a seeded study: a one-seed study of the same steps
  (the base's aside) from the shared base, every step's ``seed`` set to
  ``seed`` (after ``overrides.all``, before each step's own)."""
  c = config.copy_and_resolve_references()
  c.seeds = ()
  c.base = config.base or os.path.join(workdir, "base")
  c.steps = tuple(s for s in config.steps if s != "base")
  c.overrides.all = tuple(config.overrides.all) + (f"seed={seed}",)
  return c


def _seed_tasks(study: Study, seed: int):
  """The seed's sub-study as one task; its config thunk builds every step
  config of the seed (nothing is run or read)."""
  config = seed_config(study.config, seed, study.workdir)
  workdir = seed_dir(study.workdir, seed)

  def configs():
    for *_, child in _tasks(Study(config, workdir)):
      if child is not None:
        child()
  # re-run whole: its finished steps are skipped as in any study
  return ("seed", f"seed {seed}", lambda: stages.run(config, workdir),
          configs)


def _seed_process(config, workdir: str, log: str) -> None:
  """One seed's sub-study in a process of its own (spawned: JAX is not
  fork-safe), its output and its error line in ``log``; exits 2 on a
  user error, as the command line does."""
  import sys
  from mopd_jax import cli, parallel
  with open(log, "a", encoding="utf-8", buffering=1) as out:
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = out

    def main():
      parallel.use_cpu_devices(config.mesh.cpu_devices)
      stages.run(config, workdir)
    cli.use_compilation_cache()  # the parent's, from the environment
    cli.guarded(main)


def _run_side_by_side(study: Study) -> None:
  """Every seed's sub-study, ``seed_processes`` at a time: independent
  programs of one shape, so on a CPU each process takes a core (one
  process runs the toy's small ops on one). A seed that fails stops the
  others (each checkpoints, as on SIGTERM; a re-run resumes them) and is
  one error line naming its log; so does this process being stopped."""
  import multiprocessing
  import time as time_lib
  c = study.config
  context = multiprocessing.get_context("spawn")
  waiting = list(c.seeds)  # a finished seed's steps are skipped in it
  running: dict = {}  # seed -> (process, log)
  try:
    while waiting or running:
      while waiting and len(running) < c.seed_processes:
        s = waiting.pop(0)
        workdir = seed_dir(study.workdir, s)
        os.makedirs(workdir, exist_ok=True)
        log = os.path.join(workdir, "study.log")
        process = context.Process(
            target=_seed_process, args=(seed_config(c, s, study.workdir),
                                        workdir, log), daemon=True)
        process.start()
        running[s] = (process, log)
        print(f"study: seed {s} in a process of its own (log: {log})",
              flush=True)
      for s, (process, log) in list(running.items()):
        if process.exitcode is None:
          continue
        del running[s]
        if process.exitcode != 0:
          raise ConfigError(f"study: seed {s} failed (exit"
                            f" {process.exitcode}); its last lines are in"
                            f" {log}")
        print(f"study: seed {s} finished", flush=True)
      time_lib.sleep(0.5)
  finally:
    for process, _ in running.values():  # they checkpoint and stop
      process.terminate()
    for process, _ in running.values():
      process.join()


def _tasks(study: Study):
  """``(step, label, thunk, config)`` of every run the selected steps make;
  ``config()`` builds (and validates) the run's config, None for the
  evaluations and the report."""
  c = study.config
  tasks = []

  def train(kind, label, name, workdir, **fields):
    tasks.append((kind, label,
                  lambda: study.child(label, name, workdir, **fields),
                  lambda: study.child_config(name, **fields)))

  if "base" in c.steps and not c.base:
    train("base", "base", "pretrain", study.base, seed=c.seed)
  if c.seeds:
    seeds = [_seed_tasks(study, s) for s in c.seeds]
    if c.seed_processes > 1:  # one task: the seeds side by side
      tasks.append(("seeds", f"seeds {', '.join(map(str, c.seeds))} in"
                    f" {c.seed_processes} processes",
                    lambda: _run_side_by_side(study),
                    lambda: [child() for *_, child in seeds]))
    else:
      tasks += seeds
    if "report" in c.steps:
      tasks.append(("report", "report over seeds",
                    lambda: study_results.write_seeded_results(
                        study.workdir, c.seeds, [Study(
                            seed_config(c, s, study.workdir),
                            seed_dir(study.workdir, s)).runs()
                            for s in c.seeds]), None))
    return tasks
  if "experts" in c.steps and not c.experts:
    for d in study.domains:
      train("experts", f"expert {d}", "grpo", study.experts[d], domain=d,
            init=study.base)
  if "merge" in c.steps:
    for m in c.merge_methods:
      train("merge", f"merge {m}", "merge", study.models()[f"merge/{m}"],
            init=study.base, experts=study.template,
            **{"merge.method": m, "merge.sweep": c.merge_sweep})
  if "mix_rl" in c.steps:
    train("mix_rl", "Mix RL", "mix_rl", study.models()["mix_rl"],
          init=study.base)
  for name in ("mopd", *MOPD_VARIANTS):
    if name not in c.steps:
      continue
    fields = dict(teachers=study.template, **MOPD_VARIANTS.get(
        name, dict)())
    if name != "mopd_from_merge":
      train(name if name in MINUTES else "mopd", name, "mopd",
            study.models()[name], init=study.base, **fields)
      continue
    # The merge is chosen once the merges are done; any stands in for it
    # in the early check of the config.
    tasks.append((
        "mopd", "MOPD from the best merge",
        lambda f=fields: study.child(
            "MOPD from the best merge", "mopd",
            study.models()["mopd_from_merge"], init=study.best_merge(), **f),
        lambda f=fields: study.child_config(
            "mopd", init=study.models()[f"merge/{c.merge_methods[0]}"],
            **f)))
  if "copd" in c.steps:
    train("copd", "co-evolving experts", "copd",
          os.path.join(study.workdir, "copd"), init=study.base)
  if "copd_merge" in c.steps:
    train("merge", "merge of the co-evolved experts", "merge",
          study.models()["copd_merge"], init=study.base,
          experts=study.copd_experts(),
          **{"merge.method": c.copd_merge_method,
             "merge.sweep": c.merge_sweep})
  if "copd_mopd" in c.steps:
    train("mopd", "MOPD of the co-evolved experts", "mopd",
          study.models()["copd_mopd"], init=study.base,
          teachers=study.copd_experts())
  if "evaluate" in c.steps:
    for model, run_dir in study.models().items():
      tasks.append(("evaluate", f"evaluate {model}",
                    lambda m=model, r=run_dir: _evaluate(study, m, r), None))
  if "report" in c.steps:
    tasks.append(("report", "report",
                  lambda: study_results.write_results(study.runs()), None))
  return tasks


def evaluation_path(study: Study, model: str) -> str:
  """Where the study keeps ``model``'s evaluation (in the study's workdir,
  so that plugged-in runs are only read)."""
  kind, _, domain = model.partition("/")  # expert/<domain>: its label
  name = f"{kind}_{files.label(domain)}" if domain else kind
  return os.path.join(study.workdir, EVALUATIONS,
                      name + "_" + eval_file_name(study.config.eval.num_prompts))


def _evaluate(study: Study, model: str, run_dir: str) -> None:
  """Evaluate one model's run, once; a model whose step was not run (no
  run directory) is left out of the comparison with a note."""
  c = study.config.eval
  path = evaluation_path(study, model)
  if not os.path.exists(os.path.join(run_dir, "config.json")):
    print(f"study: no {model} run ({run_dir}); left out")
    return
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    evaluate_run(run_dir, c.num_prompts, list(study.eval_domains),
                 study.eval_settings, output=path, samples=c.samples,
                 coverage_prompts=c.coverage_prompts)


# Minutes each kind of task took in the default study on the 2-core CPU
# (the README's run; an expert's time depends on when it reaches its
# target: 0.7-3.1): the ETA's prior, rescaled by this machine's pace.
MINUTES = {"base": 5.1, "experts": 1.5, "merge": 0.33, "mix_rl": 4.6,
           "copd": 10.0,
           "mopd": 4.8, "open_mopd": 5.4, "evaluate": 0.23, "report": 0.05}
# a seed of a seeded study: four experts, seven merges, Mix RL, MOPD,
# Open-MOPD, fourteen evaluations
MINUTES["seed"] = (4 * MINUTES["experts"] + 7 * MINUTES["merge"]
                   + MINUTES["mix_rl"] + MINUTES["mopd"]
                   + MINUTES["open_mopd"] + 14 * MINUTES["evaluate"])
MINUTES["seeds"] = 2 * MINUTES["seed"]  # three seeds, two at a time


def eta_minutes(kinds, ran: list[tuple[str, float]]) -> float | None:
  """Minutes left for the tasks of ``kinds`` (still to run): their
  ``MINUTES`` times this machine's pace, ``sum(seconds) / sum(MINUTES)``
  over the tasks that ``ran`` (``(kind, seconds)``; finished earlier ones
  took no time and say nothing); None before any ran."""
  if not ran:
    return None
  pace = sum(sec for _, sec in ran) / 60 / sum(MINUTES[k] for k, _ in ran)
  return pace * sum(MINUTES[k] for k in kinds)


def run(config, workdir: str):
  """Run the selected steps in order, with a progress line and an ETA
  before each; returns the results (or None without the report step)."""
  study = Study(config, workdir)
  tasks = _tasks(study)
  started, ran = time.perf_counter(), []
  for i, (kind, label, thunk, _) in enumerate(tasks):
    eta = eta_minutes([k for k, *_ in tasks[i:]], ran)
    print(f"\nstudy [{i + 1}/{len(tasks)}] {label}  (elapsed"
          f" {(time.perf_counter() - started) / 60:.1f} min"
          + (f", ETA {eta:.1f} min" if eta is not None else "") + ")",
          flush=True)
    begun = time.perf_counter()
    thunk()
    if time.perf_counter() - begun > 1.0:  # not one finished before
      ran.append((kind, time.perf_counter() - begun))
  path = os.path.join(workdir, RESULTS_FILE)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  return None


def domains(config) -> tuple[str, ...]:
  """The study's training domains: ``domains``, else the built-in four."""
  return tuple(config.domains) or tuple(TRAIN_DOMAINS)


def check(config) -> None:
  """Plugged-in runs exist before anything is written; a study on the
  user's own domains has a base to start from."""
  if config.base and not os.path.isdir(os.path.expanduser(config.base)):
    raise ConfigError(f"base: {config.base} is not a run directory")
  built_in = [d for d in config.domains if not files.is_file_domain(d)]
  if built_in and len(built_in) < len(config.domains):
    raise ConfigError("domains: either built-in domains (the study trains"
                      " a base on them) or your own files, not both")
  labels = [files.label(d) for d in domains(config)]
  if len(set(labels)) < len(labels):
    twice = next(x for x in labels if labels.count(x) > 1)
    raise ConfigError(f"domains: two domains would share the folder"
                      f" expert_{twice}; give each file its own name")
  if ((any(map(files.is_file_domain, config.domains))
       or config.variant == "hf") and not config.base
      and "base" in config.steps):
    raise ConfigError("base: a study of real models or your own domains"
                      " starts from a base run (--config.base, e.g. a"
                      " checkpoint imported with mopd_jax.convert); the"
                      " built-in base learns the built-in domains only")
  if config.experts:
    for run_dir in runs.runs_by_domain(config.experts, domains(config),
                                  "experts").values():
      if not os.path.isdir(os.path.expanduser(run_dir)):
        raise ConfigError(f"experts: {run_dir} is not a run directory")
  if config.eval.coverage_prompts > config.eval.num_prompts:
    raise ConfigError(f"eval.coverage_prompts: {config.eval.coverage_prompts}"
                      f" must be <= eval.num_prompts"
                      f" ({config.eval.num_prompts})")
  lagged = async_steps(config.steps)
  if lagged and jax.device_count() < 2:
    raise ConfigError(f"steps: {lagged[0]} samples on a device of its own;"
                      " this host has one (on a CPU:"
                      " --config.mesh.cpu_devices=2)")
  if "mopd_from_merge" in config.steps and not config.merge_methods:
    raise ConfigError("steps: mopd_from_merge starts from the best of"
                      " merge_methods, which is empty")
  bad = [s for s in config.steps if s not in STEPS]
  if bad:
    raise ConfigError(f"steps: unknown step {bad[0]!r}; known: "
                      + ", ".join(STEPS))
  for name, path in [("base", config.base)] + [
      ("experts", p) for p in (runs.runs_by_domain(
          config.experts, domains(config), "experts").values()
          if config.experts else ())]:
    if path:
      runs.load_run_config(path)  # a run's config.json, or one line
      if checkpointing.newest_step(os.path.expanduser(path)) is None:
        raise ConfigError(f"{name}: {path} holds no checkpoint")
  # Every step's config, before the first step trains (a bad override
  # would otherwise surface after the steps before it).
  for *_, child in _tasks(Study(config, "<workdir>")):
    if child is not None:
      child()
