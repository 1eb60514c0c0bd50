"""Open-MOPD ablation: plain MOPD, each mechanism alone, and all three.

    python experiments/open_mopd_ablation.py --base=runs/base \
        --teachers='runs/expert_{domain}' --out=runs/ablation [--steps=200] \
        [--variants=plain,token_share,gap_budget,reward_refresh,all] \
        [--config_variant=:smoke] [--jobs=1] [--eval_prompts=960] \
        [--seeds=0,1,2] [-- --config.x=y ...]

Each variant and seed is an ordinary ``python -m mopd_jax.train`` run under
``<out>/<variant>`` (seed 0) or ``<out>/<variant>_seed<k>`` (re-running
resumes unfinished ones and skips finished ones; with ``--jobs`` > 1 that
many run at once, each printing to ``<out>/<run>.log``; arguments after
``--`` go to every run). Then writes ``<out>/ablation.md`` and
``<out>/ablation.json``: per domain and on average, the headroom recovery
``(acc_student - acc_base) / (acc_oracle - acc_base)`` of every variant,
greedy and sampled, with the oracle ensemble = each domain's own expert;
with several seeds, each cell is the mean over the seeds and the table adds
the seeds' standard deviation of the four-domain mean (seed-to-seed spread
is as large as the differences between variants at 200 steps); the JSON
keeps every seed's own recovery under ``per_seed``, and
``<out>/ablation.png`` draws the same cells as bars (one group per domain
and the mean, one bar per variant; with several seeds, error bars of one
standard deviation over them).
With ``--eval_prompts=N`` the base, the experts and every variant are
first evaluated on ``N`` test prompts per domain (``mopd_jax.evaluate``,
kept as ``eval_<N>.json`` in each run, done once) instead of the runs' own
256: a standard error of 1.6 points instead of 3.1 near 50% accuracy.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os

import numpy as np

from mopd_jax import launch, stages
from mopd_jax.data.domains import TRAIN_DOMAINS
from mopd_jax.errors import UserError, fail
from mopd_jax.evaluation.run_eval import eval_file_name, evaluate_run
from mopd_jax.evaluation import figures, headroom
from mopd_jax.runs import runs_by_domain
from mopd_jax.atomic import (write_bytes_atomic, write_json_atomic,
                             write_text_atomic)

MECHANISMS = ("token_share", "gap_budget", "reward_refresh")
VARIANTS = {"plain": (), **{m: (m,) for m in MECHANISMS}, "all": MECHANISMS}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_name(variant: str, seed: int) -> str:
  return variant if seed == 0 else f"{variant}_seed{seed}"


def train(variant: str, seed: int, args, extra) -> str:
  """Trains (or resumes, or skips if finished) one variant's run with
  ``seed``; returns its workdir."""
  name = run_name(variant, seed)
  workdir = os.path.join(args.out, name)
  cmd = [f"--config={ROOT}/configs/mopd.py{args.config_variant}",
         f"--workdir={workdir}",
         f"--config.init={args.base}", f"--config.teachers={args.teachers}",
         f"--config.train.steps={args.steps}", f"--config.seed={seed}"]
  cmd += [f"--config.open_mopd.{m}=True" for m in VARIANTS[variant]]
  print(f"== {name}: {' '.join(cmd)}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  launch.train(cmd + list(extra),
               None if args.jobs <= 1 else os.path.join(args.out,
                                                        f"{name}.log"))
  return workdir


def train_all(runs: list[tuple[str, int]], args, extra) -> list[str]:
  """The workdirs of ``runs`` ((variant, seed) pairs), trained
  ``args.jobs`` at a time. The first failure stops the ablation: runs not
  yet started are not started (those in flight finish first)."""
  if args.jobs <= 1:
    return [train(*r, args, extra) for r in runs]
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(train, *r, args, extra) for r in runs]
    done, pending = concurrent.futures.wait(
        futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    for future in pending:
      future.cancel()
    for future in futures:
      if future in done and future.exception() is not None:
        raise future.exception()
    return [future.result() for future in futures]


def over_seeds(reports: list[dict]) -> dict:
  """The seeds' reports averaged per mode and domain, with ``mean_std``:
  the standard deviation over seeds of the mean recovery."""
  out = {}
  for mode in ("greedy", "sampled"):
    per_seed = [r[mode] for r in reports]
    out[mode] = {k: float(np.mean([r[k] for r in per_seed]))
                 for k in per_seed[0]}
    out[mode]["mean_std"] = float(np.std([r["mean"] for r in per_seed]))
  return out


def table(results: dict, domains, mode: str, seeds: int) -> str:
  spread = seeds > 1
  rows = [f"| variant | {' | '.join(domains)} | mean |"
          + (f" sd of the mean over {seeds} seeds |" if spread else ""),
          "|---" * (len(domains) + 2 + spread) + "|"]
  for variant, per_mode in results.items():
    r = per_mode[mode]
    rows.append(f"| {variant} | " + " | ".join(
        f"{100 * r[d]:.1f}%" if d in r else "n/a" for d in domains)
                + f" | {100 * r['mean']:.1f}% |"
                + (f" {100 * r['mean_std']:.1f} |" if spread else ""))
  return "\n".join(rows)


def plot(results: dict, domains, title: str) -> bytes:
  """PNG bytes: for each decoding mode a panel of grouped bars, recovery in
  percent per domain and on average, one bar per variant, with the
  seeds' standard deviation of each cell as its error bar."""
  plt = figures.pyplot()

  groups = [*domains, "mean"]
  x = np.arange(len(groups))
  width = 0.8 / len(results)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
  for ax, mode in zip(axes, ("greedy", "sampled")):
    for i, (variant, r) in enumerate(results.items()):
      seeds = list(r["per_seed"].values())
      spread = [np.std([100 * s[mode].get(g, np.nan) for s in seeds])
                for g in groups]
      ax.bar(x + (i - (len(results) - 1) / 2) * width,
             [100 * r[mode].get(g, np.nan) for g in groups], width,
             label=variant, yerr=spread if len(seeds) > 1 else None,
             capsize=2)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(x, groups)
    ax.set_title("greedy" if mode == "greedy" else "temperature 1")
  axes[0].set_ylabel("headroom recovery (%)")
  fig.legend(*axes[0].get_legend_handles_labels(), loc="center right",
             fontsize="small")
  fig.suptitle(title)
  fig.tight_layout(rect=(0, 0, 0.88, 1))
  return figures.png_bytes(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--base", required=True)
  parser.add_argument("--teachers", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--config_variant", default="",
                      help="e.g. ':smoke' (configs/mopd.py variants)")
  parser.add_argument("--jobs", type=int, default=1,
                      help="runs trained at once")
  parser.add_argument("--seeds", default="0",
                      help="comma-separated seeds; cells average over them")
  parser.add_argument("--eval_prompts", type=int, default=0,
                      help="N > 0: evaluate every run on N test prompts per"
                      " domain (0: use the runs' own final evaluation)")
  args, extra = parser.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  variants = args.variants.split(",")
  for variant in variants:
    if variant not in VARIANTS:
      parser.error(f"--variants: unknown {variant!r}; known: "
                   + ", ".join(VARIANTS))
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of"
                 " integers")
  try:
    ablation(args, extra, variants, seeds)
  except UserError as e:
    fail(str(e))


def ablation(args, extra, variants: list[str], seeds: list[int]) -> None:
  """Trains every variant and seed, evaluates them, and writes the table,
  the JSON and the chart into ``args.out``."""
  domains = TRAIN_DOMAINS
  dirs = runs_by_domain(args.teachers, domains)
  runs = [(v, s) for v in variants for s in seeds]
  workdirs = train_all(runs, args, extra)
  eval_file = headroom.EVAL_FILE
  if args.eval_prompts:
    eval_file = eval_file_name(args.eval_prompts)
    for run in dict.fromkeys([args.base, *dirs.values(), *workdirs]):
      if not os.path.exists(os.path.join(run, eval_file)):
        evaluate_run(run, args.eval_prompts, TRAIN_DOMAINS,
                     stages.defaults("mix_rl"), execution=False)
  reports = {r: headroom.report(headroom.final_scalars(w, eval_file),
                                args.base, dirs, eval_file,
                                os.path.join(w, eval_file))
             for r, w in zip(runs, workdirs)}
  for (variant, seed), r in reports.items():
    if set(r) != {"greedy", "sampled"}:
      raise UserError(f"{run_name(variant, seed)}: the table needs greedy and"
                      " sampled evaluations (eval.greedy=True)")
  results = {v: dict(over_seeds([reports[v, s] for s in seeds]),
                    per_seed={s: reports[v, s] for s in seeds})
             for v in variants}
  title = (f"Open-MOPD ablation ({args.steps} steps, {eval_file}, seeds "
           f"{args.seeds})")
  report = "\n\n".join(
      [f"# {title}",
       "Headroom recovery, greedy decoding:",
       table(results, domains, "greedy", len(seeds)),
       "Headroom recovery, temperature 1:",
       table(results, domains, "sampled", len(seeds))]) + "\n"
  os.makedirs(args.out, exist_ok=True)
  write_text_atomic(os.path.join(args.out, "ablation.md"), report)
  write_json_atomic(os.path.join(args.out, "ablation.json"), results)
  write_bytes_atomic(os.path.join(args.out, "ablation.png"),
                     plot(results, domains, title))
  print(report)


if __name__ == "__main__":
  main()
