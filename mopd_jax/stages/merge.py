"""Merge: the experts' task vectors combined into one model, no training.

Loads the base (``init``) and reads the experts (``experts``, one run per
domain, checked against the base's architecture and tokenizer) one leaf at
a time; merges with ``merge.method`` (``mopd_jax/merge/``), after choosing
``lambda`` (and ``density``) on the validation split when ``merge.sweep``;
writes the merged model as an ordinary finished run (a checkpoint of step
0 and ``config.json``, so it can be any later run's init, teacher or
expert), its evaluation on the test split (``eval.json``), the task-vector
geometry (``geometry.json`` and figures; ``merge.geometry``), ``sweep.json``
and ``summary.json`` (with ``validation_greedy_mean``, the merge's mean greedy
accuracy on the sweep's validation prompts: what a study picks its best
merge by).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import ml_collections
import numpy as np

from mopd_jax import atomic, parallel, runs, training
from mopd_jax import config as config_lib
from mopd_jax.checkpointing import Checkpointer
from mopd_jax.checksum import named_leaves
from mopd_jax.config import positive
from mopd_jax.data import splits
from mopd_jax.data.domains import DOMAINS, TRAIN_DOMAINS
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation import evaluator, geometry, headroom
from mopd_jax.merge import methods, parameters, tree
from mopd_jax.merge.parameters import PARAMETERS

SWEEP_FILE = "sweep.json"


def defaults() -> ml_collections.ConfigDict:
  """The ``experts`` (one run per domain of ``data.domains``, each from the
  base run ``init``) merged by their task vectors; no training."""
  c = config_lib.common("merge", init=True)
  c.data.domains = TRAIN_DOMAINS
  c.eval.domains = tuple(DOMAINS)
  # run directories: a template with {domain}, or domain=dir pairs; or a
  # plain list of runs (dir,dir,...): no data, nothing evaluated
  c.experts = ""
  c.merge = ml_collections.ConfigDict({
      "method": "task_arithmetic",
      "weights": (),  # one per expert, in data.domains order; empty: 1 each
      # lambda, density, gamma, t, tolerance: merge/parameters.py
      **{p.name: p.default for p in PARAMETERS.values()},
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


# the sweep's grid field of each swept parameter
_SWEEP_FIELDS = {"lambda": "sweep_lambdas", "density": "sweep_densities"}
CHECKS = (
    *config_lib.COMMON_CHECKS,
    ("merge.method", lambda v: v in methods.METHODS,
     "one of " + ", ".join(methods.METHODS)),
    *((f"merge.{p.name}", p.valid, p.must_be) for p in PARAMETERS.values()),
    ("merge.normalize", lambda v: v in parameters.NORMALIZE,
     " or ".join(parameters.NORMALIZE)),
    *((f"merge.{field}", lambda v, p=PARAMETERS[name]: len(v) > 0 and all(
        map(p.valid, v)), "a non-empty tuple of values "
       + PARAMETERS[name].must_be) for name, field in _SWEEP_FIELDS.items()),
    ("merge.sweep_prompts", positive, "> 0"),
)


def validate(full) -> None:
  config_lib.check_common(full)
  # Merge's own: a study's `experts` may be empty (it trains them).
  if not full.experts:
    raise ConfigError("experts: must be the expert runs: a template with"
                      " {domain} or domain=dir pairs, got ''")
  data_free = runs.is_run_list(full.experts)
  experts = (len(runs.run_list(full.experts)) if data_free
             else len(full.data.domains))
  if full.merge.weights and len(full.merge.weights) != experts:
    raise ConfigError(f"merge.weights: {len(full.merge.weights)} weights"
                      f" for {experts} experts")
  if full.merge.sweep and data_free:
    raise ConfigError("merge.sweep: needs the experts' domains to score"
                      " on (domain=dir pairs or a {domain} template), not"
                      " a plain list of runs")
  parameters.parse_overrides(full.merge.overrides)


VARIANTS = ("smoke", "hf")


def recipe(config, variant: str) -> None:
  if variant == "smoke":
    config.data.update(train_examples=64, test_examples=16)
    config.eval.update(num_prompts=8, batch_size=8)
    config.merge.update(sweep_lambdas=(0.5, 1.0), sweep_densities=(0.5,),
                        sweep_prompts=8)


def settings_from(section, count: int) -> parameters.Settings:
  """The ``merge`` config section as ``Settings`` for ``count`` experts."""
  normalize = {"auto": None, "on": True, "off": False}[section.normalize]
  return parameters.Settings(
      method=section.method,
      weights=tuple(section.weights) or (1.0,) * count,
      density=section.density, gamma=section.gamma, lam=section["lambda"],
      t=section.t, tolerance=section.tolerance, normalize=normalize,
      rescale=section.rescale)


def sweep_grid(settings: parameters.Settings, section) -> list[dict]:
  """The settings the sweep scores: the grid of the swept parameters the
  method reads (``methods.sweep_axes``: ``lambda`` for the methods that
  scale the mixed task vector, times ``density`` for those that sparsify
  it), each over its ``merge.sweep_*`` values; empty for a method with
  neither."""
  axes = {parameters.settings_field(p): tuple(section[_SWEEP_FIELDS[p]])
          for p in methods.sweep_axes(settings.method)}
  if not axes:
    return []
  return [dict(zip(axes, values))
          for values in itertools.product(*axes.values())]


def _is_stacked(name: str) -> bool:
  return name.startswith("layers/")


def expert_dirs(config) -> dict[str, str]:
  """``{domain: expert run}`` (``{name: run}`` for a plain list of
  runs)."""
  if runs.is_run_list(config.experts):
    return runs.run_list(config.experts)
  return runs.runs_by_domain(config.experts, tuple(config.data.domains),
                             field="experts")


def check(config) -> None:
  """Every expert run checked against the base's tokenizer and
  architecture; the method's expert count."""
  tokenizer, model_cfg, _ = runs.setup(config)
  dirs = expert_dirs(config)
  for run_dir in dirs.values():
    run_config = runs.load_run_config(run_dir)
    runs.check_same_tokens(run_dir, run_config, tokenizer, "experts")
    runs.check_same_model(run_dir, run_config, model_cfg, "experts")
  methods.check_experts(config.merge.method, len(dirs))


def run(config, workdir: str):
  """Merge, evaluate and describe; returns ``{"params": merged}``. Experts
  given as a plain list of runs need no data: nothing is evaluated (as
  mergekit, the merge alone)."""
  tokenizer, model_cfg, mesh = runs.setup(config)
  dirs = expert_dirs(config)  # checked before (``check``)
  names = tuple(dirs)
  data_free = runs.is_run_list(config.experts)
  settings = settings_from(config.merge, len(dirs))
  rules = parameters.parse_overrides(config.merge.overrides)
  base = runs.load_params(config.init, model_cfg, mesh)
  score = None if data_free else _validation(config, model_cfg, tokenizer,
                                             mesh)
  validation = found = None
  with runs.LeafLoader(list(dirs.values()), model_cfg, mesh) as expert_leaves:

    def merged(s):
      with parallel.activate(mesh):
        return tree.merge_params(base, expert_leaves, s, rules, config.seed,
                                 _is_stacked)

    grid = sweep_grid(settings, config.merge) if config.merge.sweep else []
    if grid:
      settings, validation = _sweep(config, workdir, settings, grid, merged,
                                    score)
    params = merged(settings)
    ckpt = Checkpointer(workdir, every=1, keep=1)
    try:
      if 0 not in ckpt.all_steps():
        ckpt.save(0, {"params": params}, force=True)
    finally:
      ckpt.close()
    if config.merge.geometry:  # written after the evaluation, as before
      base_leaves = dict(named_leaves(base))
      found = geometry.task_vector_geometry(
          list(base_leaves), base_leaves.__getitem__, expert_leaves, names,
          model_cfg.embed_dim, _is_stacked, tolerance=config.merge.tolerance)

  if not data_free:
    if validation is None:
      validation = score(params)[1]
    test_sets = splits.eval_sets(config, config.eval.domains)
    scalars = evaluator.make_eval_fn(config, model_cfg, tokenizer, test_sets,
                                     mesh)({"params": params}, 0)
    runs.write_eval(workdir, 0)(scalars)
  if found:
    geometry.write(workdir, found)
    print("task-vector cosine:\n" + "\n".join(
        f"  {d:9s}" + " ".join(f"{found['cosine'][d][e]:6.3f}"
                               for e in names) for d in names))
  training.write_summary(workdir, 0, params,
                         merge=dataclasses.asdict(settings),
                         validation_greedy_mean=validation)
  return {"params": params}


def _validation(config, model_cfg, tokenizer, mesh):
  """``score(params) -> ({domain: accuracy}, mean)``: greedy accuracy on
  the first ``merge.sweep_prompts`` validation prompts of every merged
  domain (what the sweep chooses by and a study chooses merges by)."""
  sets = splits.domain_splits(config, config.data.domains, splits.VALIDATION)
  evaluate = evaluator.make_eval_fn(config, model_cfg, tokenizer, sets, mesh,
                                    greedy_only=True, prefix=splits.VALIDATION,
                                    num_prompts=config.merge.sweep_prompts)

  def score(params):
    accuracy = headroom.accuracies(evaluate({"params": params}, 0), "greedy",
                                   splits.VALIDATION)
    return accuracy, float(np.mean(list(accuracy.values())))
  return score


def _sweep(config, workdir, settings, grid, merged, score
           ) -> tuple[parameters.Settings, float]:
  """Score each grid point by ``score`` (the mean greedy validation
  accuracy); write ``sweep.json``; return the best settings (the first of
  equals) and their score."""
  scored = []
  for point in grid:
    candidate = dataclasses.replace(settings, **point)
    accuracy, mean = score(merged(candidate))
    scored.append(dict(point, accuracy=accuracy, mean=mean))
    print(f"sweep {point}: mean validation greedy {mean:.3f}")
  best = max(range(len(scored)), key=lambda i: (scored[i]["mean"], -i))
  atomic.write_json_atomic(os.path.join(workdir, SWEEP_FILE), dict(
      method=settings.method, prompts=config.merge.sweep_prompts,
      split=splits.VALIDATION, grid=scored, best=grid[best]))
  return dataclasses.replace(settings, **grid[best]), scored[best]["mean"]
