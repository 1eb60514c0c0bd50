"""A study's results from its runs' evaluations: ``results.json`` and
``report.md`` (+ figures) of one study, and over seeds from each seed's.

What the report reads is described by ``StudyRuns`` (built by the study
stage): every model's run directory and evaluation file, the domains and
the evaluation's sizes; nothing here knows how the runs were made.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

from mopd_jax import json_files
from mopd_jax.atomic import (write_bytes_atomic, write_json_atomic,
                             write_text_atomic)
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation import costs, headroom, report, seeded, study_report

RESULTS_FILE = "results.json"


@dataclasses.dataclass(frozen=True)
class StudyRuns:
  """What a study's report reads: ``models`` (model -> run directory),
  ``evaluations`` (model -> its evaluation file), the training
  ``domains``, the ``held_out`` ones, ``eval_domains``, the evaluation's
  ``num_prompts``, ``samples`` and ``coverage_prompts``, the merges whose
  geometry the report may show (in order) and the models whose training
  curves it draws."""
  workdir: str
  models: Mapping[str, str]
  evaluations: Mapping[str, str]
  domains: tuple[str, ...]
  held_out: tuple[str, ...]
  eval_domains: tuple[str, ...]
  num_prompts: int
  samples: int
  coverage_prompts: int
  merges: tuple[str, ...]
  curves: tuple[str, ...]
  copd: str = ""  # the co-evolving experts' run, when the study has one


def write_results(study: StudyRuns) -> dict:
  """``results.json`` and ``report.md`` (+ figures) from every model's
  evaluation on the study's prompts."""
  scalars, configs = {}, {}
  for model, run_dir in study.models.items():
    path = study.evaluations[model]
    run_config = os.path.join(run_dir, "config.json")
    if not (os.path.exists(path) and os.path.exists(run_config)):
      print(f"study: {model} has no evaluation ({path}) or no run"
            f" ({run_dir}); left out of the report")
      continue
    with open(path, encoding="utf-8") as f:
      scalars[model] = json.load(f)
    with open(run_config, encoding="utf-8") as f:
      configs[model] = json.load(f)
  if "base" not in scalars or any(f"expert/{d}" not in scalars
                                  for d in study.domains):
    raise ConfigError("study: the report needs the base and every expert"
                      " evaluated (steps evaluate)")
  base = {m: headroom.accuracies(scalars["base"], m) for m in report.MODES}
  experts = {d: {m: headroom.accuracies(scalars[f"expert/{d}"], m)
                 for m in report.MODES} for d in study.domains}
  oracle = {m: {d: experts[d][m][d] for d in study.domains}
            for m in report.MODES}
  expert_costs = [costs.run_cost(study.models[f"expert/{d}"],
                                 configs[f"expert/{d}"])
                  for d in study.domains]
  experts_total = {k: sum(cst[k] for cst in expert_costs)
                   for k in expert_costs[0]}
  oracle_scalars = {}
  for d in study.domains:
    for key, value in scalars[f"expert/{d}"].items():
      if f"/{d}/" in key or key.endswith(f"/{d}"):
        oracle_scalars[key] = value
  copd_cost = (costs.run_cost(study.copd, json_files.read_object(
      os.path.join(study.copd, "config.json"))) if study.copd
               and os.path.exists(os.path.join(study.copd, "config.json"))
               else None)
  entries = {}
  for model, found in {**scalars, "oracle": oracle_scalars}.items():
    # what the model's own run stands on: the experts, or the co-evolved
    # ones
    before = (experts_total if model.startswith(("merge/", "mopd",
                                                  "open_mopd"))
              else copd_cost if model.startswith("copd_") else None)
    run_dir = study.models.get(model)
    cost = (costs.run_cost(run_dir, configs[model], before)
            if run_dir and model in configs else {})
    entries[model] = report.model_entry(
        found, base, oracle, study.domains, study.held_out,
        study.num_prompts, cost)
    routing = (study_report.routing_matrix(run_dir, study.domains)
               if run_dir and report.versus_mopd(model) else None)
    if routing:
      entries[model]["routing"] = routing
    shares = study_report.loss_shares(run_dir, study.domains) if (
        run_dir) else None
    if shares:
      entries[model]["shares"] = shares
  geometry_path = next((os.path.join(study.models[m], "geometry.json")
                        for m in study.merges
                        if os.path.exists(os.path.join(
                            study.models[m], "geometry.json"))), None)
  task_vectors = {}
  if geometry_path:
    with open(geometry_path, encoding="utf-8") as f:
      task_vectors = json.load(f)
  results = dict(
      domains=list(study.domains), held_out=list(study.held_out),
      eval=dict(num_prompts=study.num_prompts, samples=study.samples,
                coverage_prompts=study.coverage_prompts),
      methods=entries,
      transfer=report.transfer({d: experts[d]["greedy"]
                                for d in study.domains}, base["greedy"],
                               list(study.eval_domains)),
      task_vectors=task_vectors)
  results["recommendation"] = report.recommendation(results)
  write_json_atomic(os.path.join(study.workdir, RESULTS_FILE), results)
  curves = {name: study_report.accuracy_curves(study.models[name])
            for name in study.curves
            if os.path.exists(os.path.join(study.models[name],
                                           "metrics.jsonl"))}
  study_report.write(study.workdir, results, curves)
  print(f"study: wrote {os.path.join(study.workdir, RESULTS_FILE)} and"
        " report.md\n" + results["recommendation"]["text"])
  return results


def per_prompt(study: StudyRuns) -> tuple[dict, dict]:
  """``(outcomes, coverage)`` of every model evaluated in ``study``:
  ``{model: {"<mode>/<domain>": [1/0 per prompt]}}`` and ``{model:
  {samples, counts: {domain: [correct samples per prompt]}}}``, the oracle
  composed from each expert on its own domain."""
  outcomes, coverage = {}, {}
  for model in study.models:
    path = study.evaluations[model]
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        found = json.load(f)
      outcomes[model] = found.get("outcomes", {})
      if found.get("coverage"):
        coverage[model] = found["coverage"]
  outcomes["oracle"] = {key: outcomes[f"expert/{d}"][key]
                        for d in study.domains
                        for key in outcomes.get(f"expert/{d}", {})
                        if key.endswith(f"/{d}")}
  if all(f"expert/{d}" in coverage for d in study.domains):
    coverage["oracle"] = dict(
        samples=min(coverage[f"expert/{d}"]["samples"]
                    for d in study.domains),
        counts={d: coverage[f"expert/{d}"]["counts"][d]
                for d in study.domains})
  return outcomes, coverage


def write_seeded_results(workdir: str, seeds, studies: list[StudyRuns]
                         ) -> dict:
  """``results.json`` and ``report.md`` (+ the pass@k figure) in
  ``workdir`` over ``seeds``, from each seed's study (its results and
  per-prompt outcomes)."""
  per_seed, outcomes, coverage = [], [], []
  for seed, study in zip(seeds, studies):
    path = os.path.join(study.workdir, RESULTS_FILE)
    if not os.path.exists(path):
      raise ConfigError(f"study: seed {seed} has no {RESULTS_FILE} ({path});"
                        " run its steps evaluate and report first")
    per_seed.append(json_files.read_object(path))
    found = per_prompt(study)
    outcomes.append(found[0])
    coverage.append(found[1])
  results = seeded.aggregate(seeds, per_seed, outcomes, coverage)
  write_json_atomic(os.path.join(workdir, RESULTS_FILE), results)
  png = seeded.coverage_figure(results)
  if png:
    write_bytes_atomic(os.path.join(workdir, "pass_at_k.png"), png)
  write_text_atomic(os.path.join(workdir, study_report.REPORT_FILE),
                    seeded.markdown(results))
  print(f"study: wrote {os.path.join(workdir, RESULTS_FILE)} and"
        " report.md over seeds\n" + results["recommendation"]["text"])
  return results
