"""``report.md`` and its figures from a study's ``results.json``: the
per-domain table of every model, the spread between paradigms, pass@k
curves, the cosine heatmap beside the transfer matrix, per-domain accuracy
over training for Mix RL and MOPD, the cost table, the MOPD variants against plain MOPD (with each token
router's routing matrix) and the recommendation.
"""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from mopd_jax.atomic import write_bytes_atomic, write_text_atomic
from mopd_jax.evaluation.figures import png_bytes, pyplot
from mopd_jax.evaluation.report import mean_over, versus_mopd
from mopd_jax.metrics import read_metrics

REPORT_FILE = "report.md"


def accuracy_curves(run_dir: str) -> dict:
  """``{mode: {domain: [(step, accuracy), ...]}}`` from the run's
  evaluations during training."""
  out: dict = {}
  for record in read_metrics(run_dir):
    for key, value in record.items():
      # eval/<mode>/<domain>/accuracy; a file domain's name holds slashes
      if key.startswith("eval/") and key.endswith("/accuracy"):
        mode, _, domain = key[len("eval/"):-len("/accuracy")].partition("/")
        out.setdefault(mode, {}).setdefault(domain, []).append(
            (record["step"], value))
  return out


def _step_means(run_dir: str, keys) -> dict | None:
  """The mean of each metric of ``keys`` over the run's logged steps that
  hold the last; None when no step does (or the run did not train)."""
  if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
    return None
  rows = [[record.get(k, 0.0) for k in keys]
          for record in read_metrics(run_dir) if keys[-1] in record]
  if not rows:
    return None
  return dict(zip(keys, np.mean(rows, axis=0).tolist()))


def routing_matrix(run_dir: str, domains) -> dict | None:
  """``{domain: {teacher: share}}``: the share of each domain's tokens a
  token router sent to each domain's teacher, the mean over the run's
  steps (its ``route/<domain>/<teacher>`` metrics); None for a run that
  routed by the label or did not train (a merge)."""
  means = _step_means(run_dir, [f"route/{d}/{t}" for d in domains
                                for t in domains])
  return None if means is None else {
      d: {t: means[f"route/{d}/{t}"] for t in domains} for d in domains}


SHARES = ("tokens", "loss")


def loss_shares(run_dir: str, domains) -> dict | None:
  """``{"tokens": {domain: share}, "loss": {domain: share}}``: each
  domain's share of the completion tokens MOPD's loss is taken on, and of
  the loss's weighted terms after Open-MOPD's domain weights (its share of
  the gradient's terms), the mean over the run's steps
  (``share/tokens/<d>``, ``share/loss/<d>``); None for a run that does
  not distil (every on-policy run logs its token shares; only a
  distillation logs loss shares)."""
  means = _step_means(run_dir, [f"share/{kind}/{d}" for kind in SHARES
                                for d in domains])
  return None if means is None else {
      kind: {d: means[f"share/{kind}/{d}"] for d in domains}
      for kind in SHARES}


SHARES_CAPTION = ("Each domain's share of the distillation loss, %, mean"
                  " over steps{}: `tokens`, of the completion tokens the"
                  " loss is taken on; `loss`, of its terms after"
                  " Open-MOPD's domain weights (the gradient's terms).")


def shares_table(entries: Mapping, domains, cell) -> str:
  """Markdown: each model's token and loss shares per domain, ``cell``
  formatting one share (a number, or a seed interval)."""
  rows = ["| model | " + " | ".join(f"{kind} {d}" for kind in SHARES
                                    for d in domains) + " |",
          "|---|" + "---|" * (len(SHARES) * len(domains))]
  for name, entry in entries.items():
    if entry.get("shares"):
      rows.append(f"| {name} | " + " | ".join(
          cell(entry["shares"][kind][d]) for kind in SHARES
          for d in domains) + " |")
  return "\n".join(rows)


def _pct(v) -> str:
  return "n/a" if v is None else f"{100 * v:.1f}"


def _table(results: Mapping) -> str:
  domains, held = results["domains"], results["held_out"]
  cols = [*domains, "mean", *held]
  rows = ["| model | " + " | ".join(cols) + " | recovery (mean) |",
          "|---" * (len(cols) + 2) + "|"]
  for name, entry in results["methods"].items():
    acc, sampled, se = (entry["accuracy"], entry["sampled_accuracy"],
                        entry["stderr"])
    cells = [f"{_pct(acc[d])} ({_pct(sampled[d])}) ±{_pct(se[d])}"
             for d in domains]
    cells.append(f"{_pct(mean_over(acc, domains))}"
                 f" ({_pct(mean_over(sampled, domains))})")
    cells += [f"{_pct(acc[d])} ({100 * entry['retention'][d]:+.1f})"
              if d in acc else "n/a" for d in held]
    rows.append(f"| {name} | " + " | ".join(cells) + " | "
                + _pct(entry["headroom_recovery"]["mean"]) + " |")
  return "\n".join(rows)


def _paradigms(results: Mapping) -> dict[str, str]:
  """The best model of each paradigm (as in the recommendation)."""
  return {f: b["model"] for f, b in results["recommendation"]["best"].items()}


def _spread(results: Mapping) -> str:
  best = _paradigms(results)
  domains = results["domains"]
  rows = ["| domain | " + " | ".join(f"{f} ({m})" for f, m in best.items())
          + " | spread |", "|---" * (len(best) + 2) + "|"]
  for d in [*domains, "mean"]:
    values = [(mean_over(results["methods"][m]["accuracy"], domains)
               if d == "mean" else results["methods"][m]["accuracy"][d])
              for m in best.values()]
    rows.append(f"| {d} | " + " | ".join(_pct(v) for v in values)
                + f" | {_pct(max(values) - min(values))} |")
  return "\n".join(rows)


def _costs(results: Mapping) -> str:
  rows = ["| model | tokens sampled | teacher-scored | trained | FLOPs"
          " (with experts) | train wall s |", "|---|---|---|---|---|---|"]
  for name, entry in results["methods"].items():
    cost = entry["cost"]
    if not cost:
      continue
    total = cost.get("with_experts", cost)
    rows.append(f"| {name} | {cost['tokens_sampled']:.3g} |"
                f" {cost['tokens_teacher_scored']:.3g} |"
                f" {cost['tokens_trained']:.3g} | {total['flops']:.3g} |"
                f" {cost['wall_seconds']:.0f} |")
  return "\n".join(rows)


def _beyond(results: Mapping) -> list[str]:
  """The MOPD variants against plain MOPD: mean accuracy, its difference,
  recovery and compute; each token router's routing matrix."""
  methods, domains = results["methods"], results["domains"]
  variants = [m for m in methods if versus_mopd(m)]
  if "mopd" not in methods or not variants:
    return []
  plain = methods["mopd"]
  plain_mean = mean_over(plain["accuracy"], domains)
  plain_flops = plain["cost"].get("with_experts", plain["cost"]).get("flops")
  rows = ["| model | mean | minus MOPD | recovery (mean) | FLOPs / MOPD's"
          " (with experts) |", "|---|---|---|---|---|"]
  for m in ["mopd", *variants]:
    entry = methods[m]
    mean = mean_over(entry["accuracy"], domains)
    flops = entry["cost"].get("with_experts", entry["cost"]).get("flops")
    rows.append(f"| {m} | {_pct(mean)} | {100 * (mean - plain_mean):+.1f} |"
                f" {_pct(entry['headroom_recovery']['mean'])} | "
                + (f"{flops / plain_flops:.2f}" if flops and plain_flops
                   else "n/a") + " |")
  parts = ["## Beyond plain MOPD",
           "Greedy accuracy, one seed (differences of one seed have the"
           " standard errors of the main table; a study over seeds gives"
           " their intervals).", "\n".join(rows)]
  if any(methods[m].get("shares") for m in ["mopd", *variants]):
    parts += [SHARES_CAPTION.format(""),
              shares_table({m: methods[m] for m in ["mopd", *variants]},
                           domains, lambda v: f"{100 * v:.1f}")]
  for m in variants:
    if methods[m].get("routing"):
      parts += [f"Routing of {m}: the share of each domain's tokens (rows)"
                " sent to each domain's teacher (columns), %, mean over"
                " steps; the oracle is the diagonal.",
                markdown_matrix(methods[m]["routing"], domains, domains,
                        fmt="{:.1f}")]
  return parts


def markdown_matrix(matrix: Mapping, rows, cols, scale=100.0,
                    fmt="{:+.1f}") -> str:
  """A markdown table of ``matrix[row][col]``, each ``fmt.format(scale *
  value)``."""
  out = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for r in rows:
    out.append(f"| {r} | " + " | ".join(
        fmt.format(scale * matrix[r][c]) for c in cols) + " |")
  return "\n".join(out)


def figures(results: Mapping, curves: Mapping) -> dict[str, bytes]:
  """PNG bytes of the report's figures."""
  plt = pyplot()
  domains = results["domains"]
  out = {}
  names = list(results["methods"])
  fig, ax = plt.subplots(figsize=(max(8, len(names) * 0.6), 4))
  width = 0.8 / len(domains)
  for i, d in enumerate(domains):
    ax.bar(np.arange(len(names)) + i * width,
           [100 * results["methods"][n]["accuracy"][d] for n in names],
           width, label=d)
  ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=60,
                ha="right", fontsize=7)
  ax.set(ylabel="greedy accuracy (%)", title="every model, per domain")
  ax.legend(fontsize=7)
  fig.tight_layout()
  out["accuracy.png"] = png_bytes(fig)

  fig, axes = plt.subplots(1, len(domains), figsize=(3.2 * len(domains), 3),
                           sharey=True)
  for ax, d in zip(np.atleast_1d(axes), domains):
    for n in names:
      by_k = results["methods"][n]["pass_at_k"].get(d, {})
      if by_k:
        ks = sorted(int(k) for k in by_k)
        ax.plot(ks, [100 * by_k[k if k in by_k else str(k)] for k in ks],
                marker="o", label=n)
    ax.set(xscale="log", xlabel="k", title=d)
  np.atleast_1d(axes)[0].set_ylabel("pass@k (%)")
  np.atleast_1d(axes)[-1].legend(fontsize=6)
  fig.tight_layout()
  out["pass_at_k.png"] = png_bytes(fig)

  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  tv = results.get("task_vectors", {})
  if tv:
    cos = np.array([[tv["cosine"][a][b] for b in domains] for a in domains])
    axes[0].imshow(cos, cmap="RdBu_r", vmin=-1, vmax=1)
    axes[0].set_title("task-vector cosine")
  transfer = np.array([[100 * results["transfer"][a][b] for b in domains]
                       for a in domains])
  lim = max(1.0, np.abs(transfer).max())
  axes[1].imshow(transfer, cmap="RdBu_r", vmin=-lim, vmax=lim)
  axes[1].set_title("transfer: expert (row) on domain (column), points")
  for ax, m in zip(axes, (cos if tv else None, transfer)):
    ax.set_xticks(range(len(domains)), domains, rotation=45)
    ax.set_yticks(range(len(domains)), domains)
    if m is not None:
      for i in range(len(domains)):
        for j in range(len(domains)):
          ax.text(j, i, f"{m[i, j]:.2f}" if m is not transfer
                  else f"{m[i, j]:+.0f}", ha="center", va="center",
                  fontsize=7)
  fig.tight_layout()
  out["geometry_transfer.png"] = png_bytes(fig)

  if curves:
    fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves), 3.2),
                             sharey=True)
    for ax, (name, by_mode) in zip(np.atleast_1d(axes), curves.items()):
      for d, points in sorted(by_mode.get("greedy", {}).items()):
        ax.plot(*zip(*points), marker=".", label=d)
      ax.set(title=name, xlabel="step")
    np.atleast_1d(axes)[0].set_ylabel("greedy accuracy")
    np.atleast_1d(axes)[-1].legend(fontsize=6)
    fig.tight_layout()
    out["dynamics.png"] = png_bytes(fig)
  return out


def markdown(results: Mapping) -> str:
  domains = results["domains"]
  ev = results["eval"]
  parts = [
      "# Fusion study",
      f"Every model evaluated on {ev['num_prompts']} test prompts per"
      f" domain; pass@k from {ev['samples']} samples at temperature 1."
      " Cells: greedy (sampled) accuracy, ± one standard error of the"
      " greedy accuracy; held-out columns: accuracy (signed change from the"
      " base); recovery: mean headroom recovery (greedy).",
      _table(results), "![accuracy](accuracy.png)",
      "## Recommendation", results["recommendation"]["text"],
      "## Between paradigms (best of each, greedy)", _spread(results),
      "## Coverage (pass@k)", "![pass@k](pass_at_k.png)",
      "## Geometry and transfer",
      markdown_matrix(results["transfer"], domains, domains),
      "![geometry and transfer](geometry_transfer.png)",
  ]
  tv = results.get("task_vectors")
  if tv:
    parts.insert(-1, markdown_matrix(tv["cosine"], domains, domains,
                                     scale=1.0, fmt="{:.3f}"))
  parts += _beyond(results)
  parts += ["## Cost", _costs(results)]
  return "\n\n".join(parts) + "\n"


def write(workdir: str, results: Mapping, curves: Mapping) -> None:
  """``report.md`` and the figures into ``workdir`` (atomically)."""
  pngs = figures(results, curves)
  for name, data in pngs.items():
    write_bytes_atomic(os.path.join(workdir, name), data)
  text = markdown(results)
  if "dynamics.png" in pngs:
    text = text.replace("## Cost", "## Training dynamics\n\n"
                        "![dynamics](dynamics.png)\n\n## Cost")
  write_text_atomic(os.path.join(workdir, REPORT_FILE), text)
