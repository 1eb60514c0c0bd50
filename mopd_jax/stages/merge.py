"""Merge: the experts' task vectors combined into one model, no training.

Loads the base (``init``) and reads the experts (``experts``, one run per
domain, checked against the base's architecture and tokenizer) one leaf at
a time; merges with ``merge.method`` (``fusion/merge.py``), after choosing
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

import numpy as np

from mopd_jax import atomic, parallel, runs, training
from mopd_jax.checkpointing import Checkpointer
from mopd_jax.checksum import named_leaves
from mopd_jax.data import splits
from mopd_jax.evaluation import evaluator, geometry, headroom
from mopd_jax.fusion import merge, teachers

SWEEP_FILE = "sweep.json"


def settings_from(section, count: int) -> merge.Settings:
  """The ``merge`` config section as ``Settings`` for ``count`` experts."""
  normalize = {"auto": None, "on": True, "off": False}[section.normalize]
  return merge.Settings(
      method=section.method,
      weights=tuple(section.weights) or (1.0,) * count,
      density=section.density, gamma=section.gamma, lam=section["lambda"],
      t=section.t, tolerance=section.tolerance, normalize=normalize,
      rescale=section.rescale)


def sweep_grid(settings: merge.Settings, lambdas, densities) -> list[dict]:
  """The settings the sweep scores: ``lambda`` for the methods that scale
  the mixed task vector, times ``density`` for those that sparsify it;
  empty for the methods with neither."""
  axes = {}
  if settings.method in merge.SCALED:
    axes["lam"] = tuple(lambdas)
  if settings.method in merge.SPARSIFIED:
    axes["density"] = tuple(densities)
  if not axes:
    return []
  return [dict(zip(axes, values))
          for values in itertools.product(*axes.values())]


def _is_stacked(name: str) -> bool:
  return name.startswith("layers/")


def check(config) -> dict[str, str]:
  """``{domain: expert run}`` (``{name: run}`` for a plain list of runs),
  each run checked against the base's tokenizer and architecture; the
  method's expert count."""
  tokenizer, model_cfg, _ = runs.setup(config)
  if merge.is_run_list(config.experts):
    dirs = merge.run_list(config.experts)
  else:
    dirs = teachers.parse_teachers(config.experts,
                                   tuple(config.data.domains),
                                   field="experts")
  for run_dir in dirs.values():
    run_config = runs.load_run_config(run_dir)
    runs.check_same_tokens(run_dir, run_config, tokenizer, "experts")
    runs.check_same_model(run_dir, run_config, model_cfg, "experts")
  merge.check_experts(config.merge.method, len(dirs))
  return dirs


def run(config, workdir: str):
  """Merge, evaluate and describe; returns ``{"params": merged}``. Experts
  given as a plain list of runs need no data: nothing is evaluated (as
  mergekit, the merge alone)."""
  tokenizer, model_cfg, mesh = runs.setup(config)
  dirs = check(config)
  names = tuple(dirs)
  data_free = merge.is_run_list(config.experts)
  settings = settings_from(config.merge, len(dirs))
  rules = merge.parse_overrides(config.merge.overrides)
  base = runs.load_params(config.init, model_cfg, mesh)
  expert_leaves = runs.leaf_loader(list(dirs.values()), model_cfg, mesh)

  def merged(s):
    with parallel.activate(mesh):
      return merge.merge_params(base, expert_leaves, s, rules, config.seed,
                                _is_stacked)

  grid = sweep_grid(settings, config.merge.sweep_lambdas,
                    config.merge.sweep_densities) if config.merge.sweep else []
  score = None if data_free else _validation(config, model_cfg, tokenizer,
                                             mesh)
  validation = None
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

  if not data_free:
    if validation is None:
      validation = score(params)[1]
    test_sets = splits.eval_sets(config, config.eval.domains)
    scalars = evaluator.make_eval_fn(config, model_cfg, tokenizer, test_sets,
                                     mesh)({"params": params}, 0)
    runs.write_eval(workdir, 0)(scalars)
  if config.merge.geometry:
    base_leaves = dict(named_leaves(base))
    found = geometry.task_vector_geometry(
        list(base_leaves), base_leaves.__getitem__, expert_leaves, names,
        model_cfg.embed_dim, _is_stacked, tolerance=config.merge.tolerance)
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
           ) -> tuple[merge.Settings, float]:
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
