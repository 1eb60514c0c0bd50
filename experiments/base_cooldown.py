"""Calibrate the base model: one constant-rate run, cooled from several steps.

    python experiments/base_cooldown.py --out=runs/base_cooldown \
        [--stable_steps=1100] [--every=50] [--starts=250,300,350,400,450] \
        [--decay=150] [--config=configs/pretrain.py] [-- --config.seed=1 ...]

The base has to stop part-way (room for RL), and its skills appear abruptly
at seed-dependent steps, so where to stop is read off a sweep. Under the
warmup-stable-decay schedule (``optim.decay_steps``) a run of ``k + D``
steps is, up to step ``k``, the same as a constant-rate run; each cooled
base is therefore the constant-rate run's checkpoint at ``k`` resumed for
``D`` decaying steps, and it is exactly what
``--config.train.steps=k+D --config.optim.decay_steps=D`` trains from
scratch.

Runs are ordinary ``python -m mopd_jax.train`` runs (arguments after ``--``
go to every one): ``<out>/stable`` (constant rate, a checkpoint every
``--every`` steps, all kept) and ``<out>/start_<k>``; re-running resumes
unfinished ones and skips finished ones. Writes ``<out>/cooldown.md``,
``cooldown.json`` and ``cooldown.png``: each cooled base's greedy and
sampled accuracy per domain against ``k``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from mopd_jax import launch
from mopd_jax.atomic import (write_bytes_atomic, write_json_atomic,
                             write_text_atomic)
from mopd_jax.errors import UserError, fail
from mopd_jax.evaluation import figures, headroom

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("greedy", "sampled")


def train(workdir: str, overrides: list[str], args, extra) -> None:
  """Trains (or resumes, or skips if finished) one run into ``workdir``."""
  cmd = [f"--config={args.config}", f"--workdir={workdir}", *overrides,
         *extra]
  print(f"== {' '.join(cmd)}", flush=True)
  launch.train(cmd)


def cool(stable: str, start: int, args, extra) -> str:
  """The base cooled from ``stable``'s checkpoint at ``start``: that
  checkpoint copied into a fresh workdir, resumed for ``--decay`` steps."""
  workdir = os.path.join(args.out, f"start_{start}")
  if not os.path.isdir(os.path.join(workdir, "ckpt")):
    shutil.copytree(os.path.join(stable, "ckpt", str(start)),
                    os.path.join(workdir, "ckpt", str(start)))
  train(workdir, [f"--config.train.steps={start + args.decay}",
                  f"--config.optim.decay_steps={args.decay}"], args, extra)
  return workdir


def table(results: dict, mode: str) -> str:
  domains = sorted(next(iter(results.values()))[mode])
  rows = ["| cool-down start | " + " | ".join(domains) + " |",
          "|---" * (len(domains) + 1) + "|"]
  for start, acc in results.items():
    rows.append(f"| {start} | " + " | ".join(
        f"{100 * acc[mode][d]:.1f}%" for d in domains) + " |")
  return "\n".join(rows)


def plot(results: dict, title: str) -> bytes:
  """PNG bytes: accuracy per domain against the cool-down start, one panel
  per decoding mode."""
  plt = figures.pyplot()

  starts = list(results)
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, mode in zip(axes, MODES):
    for domain in sorted(results[starts[0]][mode]):
      ax.plot(starts, [100 * results[s][mode][domain] for s in starts],
              marker="o", label=domain)
    ax.set_xlabel("cool-down start (step)")
    ax.set_title("greedy" if mode == "greedy" else "temperature 1")
  axes[0].set_ylabel("test accuracy (%)")
  axes[1].legend(fontsize="small")
  fig.suptitle(title)
  fig.tight_layout()
  return figures.png_bytes(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--config", default=f"{ROOT}/configs/pretrain.py")
  parser.add_argument("--stable_steps", type=int, default=1100)
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--starts", default="250,300,350,400,450")
  parser.add_argument("--decay", type=int, default=150)
  args, extra = parser.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  try:
    starts = sorted(int(s) for s in args.starts.split(","))
  except ValueError:
    fail(f"--starts: {args.starts!r} is not a comma-separated list of"
         " integers")
  try:
    sweep(args, extra, starts)
  except UserError as e:
    fail(str(e))


def sweep(args, extra, starts: list[int]) -> None:
  """Trains the constant-rate run and every cool-down, and writes the
  table, the JSON and the chart into ``args.out``."""
  stable = os.path.join(args.out, "stable")
  train(stable, ["--config.optim.end_lr_fraction=1.0",
                 f"--config.train.steps={args.stable_steps}",
                 f"--config.checkpoint.every={args.every}",
                 f"--config.checkpoint.keep={args.stable_steps // args.every + 1}"],
        args, extra)
  warmup = json.load(open(os.path.join(stable, "config.json")))[
      "optim"]["warmup_steps"]
  if starts[0] < warmup:
    raise UserError(f"--starts: {starts[0]} is inside the warm-up ({warmup}"
                    " steps), where the two schedules differ")
  for start in starts:
    if not os.path.isdir(os.path.join(stable, "ckpt", str(start))):
      raise UserError(f"--starts: {stable} has no checkpoint at step {start}"
                      f" (one every --every={args.every} steps)")
  cooled = {k: cool(stable, k, args, extra) for k in starts}
  results = {k: {mode: headroom.run_accuracies(run, mode) for mode in MODES}
             for k, run in cooled.items()}
  title = (f"Base cooled for {args.decay} steps from a constant-rate run"
           f" ({args.config}{' ' + ' '.join(extra) if extra else ''})")
  report = "\n\n".join([f"# {title}", "Greedy accuracy:",
                        table(results, "greedy"), "Temperature 1:",
                        table(results, "sampled")]) + "\n"
  write_text_atomic(os.path.join(args.out, "cooldown.md"), report)
  write_json_atomic(os.path.join(args.out, "cooldown.json"), results)
  write_bytes_atomic(os.path.join(args.out, "cooldown.png"),
                     plot(results, title))
  print(report)


if __name__ == "__main__":
  main()
