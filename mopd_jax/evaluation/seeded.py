"""A seeded study's comparison: the per-seed ``results.json`` of
``evaluation/report.py`` and every model's per-prompt outcomes turned
into means with intervals (``evaluation/intervals.py``).

* each cell (model, domain; the training-domain mean; headroom recovery;
  held-out retention; pass@k): the mean over seeds and its Student-t
  interval;
* between paradigms (the best model of each, chosen on the mean over
  seeds of the training-domain mean; and Open-MOPD against MOPD): the
  paired difference of per-prompt outcomes, same seeds and same prompts,
  with the two-level bootstrap interval, per domain and on the mean;
* a domain's winner is named only where its difference from every other
  paradigm excludes 0; otherwise the paradigms whose difference from the
  top one does not are tied.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from mopd_jax.evaluation import intervals, pass_at_k
from mopd_jax.evaluation.report import FAMILIES, mean_over, versus_mopd
from mopd_jax.evaluation import study_report

UNIT = (0.0, 1.0)  # the range of an accuracy or a pass@k


def _cells(per_seed: Sequence[Mapping], get) -> dict | None:
  """``seed_interval`` of ``get(results_of_a_seed)`` over seeds (None when
  a seed has no value)."""
  values = [get(r) for r in per_seed]
  if any(v is None for v in values):
    return None
  return intervals.seed_interval(values)


def _model_cells(per_seed, model, domains, held_out) -> dict:
  entries = [r["methods"][model] for r in per_seed]
  out = dict(
      accuracy={d: intervals.seed_interval([e["accuracy"][d]
                                            for e in entries], bounds=UNIT)
                for d in entries[0]["accuracy"]},
      mean=intervals.seed_interval([mean_over(e["accuracy"], domains)
                                    for e in entries], bounds=UNIT),
      headroom_recovery={d: _cells(entries,
                                   lambda e, d=d: e["headroom_recovery"][d])
                         for d in [*domains, "mean"]},
      retention={d: intervals.seed_interval([e["retention"][d]
                                             for e in entries])
                 for d in held_out if d in entries[0]["retention"]},
      pass_at_k={d: {int(k): intervals.seed_interval(
          [e["pass_at_k"][d][k] for e in entries], bounds=UNIT) for k in by_k}
                 for d, by_k in entries[0]["pass_at_k"].items()},
      flops=float(np.mean([e["cost"].get("with_experts", e["cost"]).get(
          "flops", 0.0) for e in entries])) if entries[0]["cost"] else None)
  if all(e.get("shares") for e in entries):  # a distillation's
    out["shares"] = {kind: {d: intervals.seed_interval(
        [e["shares"][kind][d] for e in entries], bounds=UNIT) for d in by_d}
                     for kind, by_d in entries[0]["shares"].items()}
  if all(e.get("routing") for e in entries):  # a token router's
    out["routing"] = {d: {t: float(np.mean([e["routing"][d][t]
                                            for e in entries]))
                          for t in row}
                      for d, row in entries[0]["routing"].items()}
  return out


def best_of_families(per_seed: Sequence[Mapping], domains) -> dict[str, str]:
  """``{family: model}``: each paradigm's model with the highest mean over
  seeds of its training-domain mean (greedy)."""
  models = per_seed[0]["methods"]
  out = {}
  for family, member in FAMILIES.items():
    names = [m for m in models if member(m)
             and all(m in r["methods"] for r in per_seed)]
    if names:
      out[family] = max(names, key=lambda n: np.mean(
          [mean_over(r["methods"][n]["accuracy"], domains)
           for r in per_seed]))
  return out


def _scores(outcomes, model, domains, mode="greedy") -> np.ndarray:
  """``[S, D, N]`` per-prompt 1/0 of ``model`` (``outcomes``: per seed,
  ``{model: {"<mode>/<domain>": [...]}}``)."""
  return np.array([[o[model][f"{mode}/{d}"] for d in domains]
                   for o in outcomes], dtype=np.float64)


def _coverage_scores(coverage, model, domain, k) -> np.ndarray:
  """``[S, N]`` per-prompt pass@k of ``model`` on ``domain``
  (``coverage``: per seed, ``{model: {samples, counts}}``)."""
  return np.array([pass_at_k.per_prompt(c[model]["samples"],
                                        c[model]["counts"][domain], k)
                   for c in coverage])


def differences(outcomes, coverage, pairs, domains, ks=()) -> dict:
  """``{"a - b": {domain: interval, "mean": interval, "pass@k": {"<k>/<d>":
  interval}}}``: paired differences of greedy outcomes (and of pass@k for
  each of ``ks`` where both have coverage)."""
  out = {}
  for a, b in pairs:
    sa, sb = _scores(outcomes, a, domains), _scores(outcomes, b, domains)
    entry = {d: intervals.paired_difference(sa[:, i], sb[:, i])
             for i, d in enumerate(domains)}
    entry["mean"] = intervals.paired_difference(sa, sb)
    if all(a in c and b in c for c in coverage):
      n = min(min(c[a]["samples"], c[b]["samples"]) for c in coverage)
      entry["pass@k"] = {
          f"{k}/{d}": intervals.paired_difference(
              _coverage_scores(coverage, a, d, k),
              _coverage_scores(coverage, b, d, k))
          for k in ks if k <= n for d in domains}
    out[f"{a} - {b}"] = entry
  return out


def verdicts(cells: Mapping, diffs: Mapping, best: Mapping, domains
             ) -> tuple[dict, dict]:
  """``(winners, tied)`` per domain (and ``mean``): the top paradigm by
  mean accuracy is the winner where its difference from every other
  excludes 0 (else None); ``tied``: the top one and those whose
  difference from it does not exclude 0."""
  winners, tied = {}, {}
  for d in [*domains, "mean"]:
    def acc(f, d=d):
      c = cells[best[f]]
      return (c["mean"] if d == "mean" else c["accuracy"][d])["mean"]
    top = max(best, key=acc)
    level = []
    for f in best:
      if f == top:
        continue
      key = (f"{best[top]} - {best[f]}" if f"{best[top]} - {best[f]}"
             in diffs else f"{best[f]} - {best[top]}")
      if not intervals.excludes_zero(diffs[key][d]):
        level.append(f)
    winners[d] = None if level else top
    tied[d] = sorted([top, *level], key=lambda f: -acc(f))
  return winners, tied


def aggregate(seeds: Sequence[int], per_seed: Sequence[Mapping],
              outcomes: Sequence[Mapping], coverage: Sequence[Mapping]
              ) -> dict:
  """The seeded ``results.json``: ``seeds``, ``methods`` (every model's
  cells with intervals), ``paradigms`` (best of each), ``differences``,
  ``recommendation`` and each seed's own results (``per_seed``)."""
  first = per_seed[0]
  domains, held_out = first["domains"], first["held_out"]
  models = [m for m in first["methods"]
            if all(m in r["methods"] for r in per_seed)]
  cells = {m: _model_cells(per_seed, m, domains, held_out) for m in models}
  best = best_of_families(per_seed, domains)
  pairs = list(itertools.combinations(best.values(), 2))
  if "mopd" in models:
    pairs += [(other, "mopd") for other in models if versus_mopd(other)]
  samples = first["eval"].get("samples") or 0
  ks = sorted({1, samples}) if samples else []  # accuracy and coverage
  diffs = differences(outcomes, coverage, pairs, domains, ks)
  winners, tied = verdicts(cells, diffs, best, domains)
  results = dict(seeds=list(seeds), domains=domains, held_out=held_out,
                 eval=first["eval"], coverage_ks=ks, methods=cells,
                 paradigms=best,
                 differences=diffs,
                 per_seed={str(s): r for s, r in zip(seeds, per_seed)})
  results["recommendation"] = dict(
      best=best, winners=winners, tied=tied,
      text=_text(results, winners, tied))
  return results


def _pct(x: dict) -> str:
  """``mean [low, high]`` in points."""
  if x["low"] is None:
    return f"{100 * x['mean']:.1f}"
  return f"{100 * x['mean']:.1f} [{100 * x['low']:.1f}, {100 * x['high']:.1f}]"


def _text(results, winners, tied) -> str:
  seeds, n = len(results["seeds"]), results["eval"]["num_prompts"]
  cells, best = results["methods"], results["paradigms"]
  lines = [f"Over {seeds} seed(s) x {n} test prompts per domain (95%"
           " intervals: Student-t over seeds for a model; paired bootstrap"
           " over seeds and prompts for a difference)."]
  if best:
    lines.append("Training-domain mean (greedy): " + ", ".join(
        f"{f} ({best[f]}) {_pct(cells[best[f]]['mean'])}" for f in best)
                 + ".")
  if len(best) > 1:  # a study of one paradigm (MOPD variants) ranks none
    top = max(best, key=lambda f: cells[best[f]]["mean"]["mean"])
    lines.append(
        "On the mean, " + (f"{winners['mean']} is ahead of every other"
                           " paradigm (each difference's interval excludes"
                           " 0)" if winners["mean"] else
                           f"{' = '.join(tied['mean'])} are tied (the"
                           f" interval of {top}'s lead includes 0)") + ".")
    lines.append("Per domain: " + "; ".join(
        f"{d}: {winners[d]}" if winners[d] else
        f"{d}: tied ({' = '.join(tied[d])})" for d in results["domains"])
                 + ".")
  for key, diff in results["differences"].items():
    if key.endswith(" - mopd") and versus_mopd(key):
      lines.append(f"{key.split(' - ')[0]} minus MOPD on the mean:"
                   f" {_pct(diff['mean'])} points.")
  return " ".join(lines)


def markdown(results: Mapping) -> str:
  """``report.md`` of a seeded study."""
  domains, held = results["domains"], results["held_out"]
  cells = results["methods"]
  cols = [*domains, "mean", *held]
  table = ["| model | " + " | ".join(cols) + " | recovery (mean) |",
           "|---" * (len(cols) + 2) + "|"]
  for name, c in cells.items():
    row = [_pct(c["accuracy"][d]) for d in domains] + [_pct(c["mean"])]
    row += [f"{_pct(c['retention'][d])} (change)" if d in c["retention"]
            else "n/a" for d in held]
    rec = c["headroom_recovery"]["mean"]
    table.append(f"| {name} | " + " | ".join(row) + " | "
                 + (_pct(rec) if rec else "n/a") + " |")
  diff = ["| difference | " + " | ".join([*domains, "mean"]) + " |",
          "|---" * (len(domains) + 2) + "|"]
  for name, d in results["differences"].items():
    diff.append(f"| {name} | " + " | ".join(_pct(d[x]) for x in
                                           [*domains, "mean"]) + " |")
  ks = results["coverage_ks"]
  cover = ["| model | " + " | ".join(f"{d} pass@{k}" for d in domains
                                     for k in ks) + " |",
           "|---" * (len(domains) * len(ks) + 1) + "|"]
  for name, c in cells.items():
    if ks and all(k in c["pass_at_k"].get(d, {}) for d in domains
                  for k in ks):
      cover.append(f"| {name} | " + " | ".join(
          _pct(c["pass_at_k"][d][k]) for d in domains for k in ks) + " |")
  cover_diff = [f"| {name} | " + " | ".join(
      _pct(d["pass@k"][f"{k}/{x}"]) for x in domains for k in ks)
                + " |" for name, d in results["differences"].items()
                if ks and len(d.get("pass@k", {})) == len(domains) * len(ks)]
  ev = results["eval"]
  parts = [
      "# Fusion study over seeds",
      f"Seeds {', '.join(map(str, results['seeds']))}: the base is shared,"
      " the experts and every fusion method are trained once per seed, and"
      f" every model is evaluated on the same {ev['num_prompts']} test"
      " prompts per domain. Cells: greedy accuracy, mean over seeds"
      " [95% Student-t interval over seeds]; held-out columns: the signed"
      " change from the base. Each seed's own report is in"
      " `seed_<s>/report.md`.",
      "\n".join(table),
      "## Recommendation", results["recommendation"]["text"],
      "## Paired differences (points; same seeds, same prompts)",
      "Mean over seeds and prompts [95% two-level bootstrap interval].",
      "\n".join(diff)]
  if len(cover) > 2:
    parts += ["## Coverage (pass@k)",
              f"From {ev.get('samples')} samples per prompt on the first"
              f" {ev.get('coverage_prompts') or ev['num_prompts']} test"
              " prompts of each domain (unbiased estimator).",
              "\n".join(cover), "![pass@k](pass_at_k.png)"]
    if cover_diff:
      parts += ["Paired differences of pass@k (points):",
                "\n".join(cover[:2] + cover_diff).replace("| model |",
                                                          "| difference |",
                                                          1)]
  if any(c.get("shares") for c in cells.values()):
    parts += ["## Loss shares",
              study_report.SHARES_CAPTION.format(
                  " and seeds [95% interval over seeds]"),
              study_report.shares_table(cells, domains, _share_cell)]
  for name, c in cells.items():
    if c.get("routing"):
      parts += [f"Routing of {name}: the share of each domain's tokens"
                " (rows) sent to each domain's teacher (columns), %, mean"
                " over steps and seeds; the oracle is the diagonal.",
                study_report.markdown_matrix(c["routing"], domains, domains,
                                fmt="{:.1f}")]
  return "\n\n".join(parts) + "\n"


def _share_cell(c: Mapping) -> str:
  """``mean [low, high]`` in %, the mean alone for one seed."""
  if c["low"] is None:
    return f"{100 * c['mean']:.1f}"
  return f"{100 * c['mean']:.1f} [{100 * c['low']:.1f}, {100 * c['high']:.1f}]"


def coverage_figure(results: Mapping) -> bytes | None:
  """pass@k against k per domain, every model's mean over seeds with its
  interval as error bars (None without coverage)."""
  from mopd_jax.evaluation.figures import png_bytes, pyplot
  domains, cells = results["domains"], results["methods"]
  if not any(c["pass_at_k"] for c in cells.values()):
    return None
  plt = pyplot()
  fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3),
                           sharey=True)
  for ax, d in zip(np.atleast_1d(axes), domains):
    for name, c in cells.items():
      by_k = c["pass_at_k"].get(d)
      if not by_k or name.startswith("merge/") and name not in (
          results["paradigms"].values()):
        continue
      ks = sorted(by_k)
      mean = np.array([by_k[k]["mean"] for k in ks])
      low = np.array([by_k[k]["low"] if by_k[k]["low"] is not None
                      else by_k[k]["mean"] for k in ks])
      high = np.array([by_k[k]["high"] if by_k[k]["high"] is not None
                       else by_k[k]["mean"] for k in ks])
      ax.errorbar(ks, 100 * mean, yerr=100 * np.stack([mean - low,
                                                       high - mean]),
                  marker="o", capsize=2, label=name)
    ax.set(xscale="log", xlabel="k", title=d)
  np.atleast_1d(axes)[0].set_ylabel("pass@k (%)")
  np.atleast_1d(axes)[-1].legend(fontsize=6)
  fig.tight_layout()
  return png_bytes(fig)
