"""Benchmark: one-step-async rollouts against the synchronous loop.

    python experiments/bench_async.py [--steps=12] [--out=runs/bench_async]
        [--base=RUN] [--teachers='runs/expert_{domain}'] [--variant=smoke]

The same MOPD run twice on the same two devices (``mesh.cpu_devices=2``
on a CPU): synchronous (``rl.max_policy_lag=0``: sampling, then scoring
and the update, the batch split over both devices) and one-step async
(``rl.max_policy_lag=1``: step t+1's rollouts sampled on one device with
step t's parameters while step t scores and trains on the other), both
with the truncated importance weight (``rl.tis_cap=2``). Each figure is
the median seconds per step over the steps after the first two
(compilation), read from the runs' own step timings; the last line is the
ratio sync / async (> 1: async is faster).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from bench_mopd import DOMAINS, near_random_base, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seconds_per_step(out: str, base: str, teachers: str, data_dir: str,
                     steps: int, lag: int, variant: str) -> float:
  workdir = os.path.join(out, f"mopd_lag{lag}")
  config = f"{ROOT}/configs/mopd.py" + (f":{variant}" if variant else "")
  train(workdir, config, f"--config.init={base}",
        f"--config.teachers={teachers}", f"--config.rl.max_policy_lag={lag}",
        "--config.rl.tis_cap=2.0", f"--config.train.steps={steps}",
        "--config.train.log_every=1", "--config.train.eval_every=0",
        # a checkpoint halfway too (its test resumes the async run there)
        "--config.eval.num_prompts=8",
        f"--config.checkpoint.every={max(1, steps // 2)}",
        "--config.mesh.cpu_devices=2", f"--config.data.data_dir={data_dir}")
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "steps_per_sec" in r][2:]
  return float(np.median([1 / r["steps_per_sec"] for r in rows]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--out", default="runs/bench_async")
  parser.add_argument("--data_dir", default="")
  parser.add_argument("--base", default="", help="the student's init"
                      " (default: a near-random base of the built-in model)")
  parser.add_argument("--teachers", default="", help="the experts (default:"
                      " the base as every domain's teacher)")
  parser.add_argument("--variant", default="", help="of configs/mopd.py"
                      " (default: its defaults, the study's MOPD batch)")
  parser.add_argument("--json", default="", help="also write figures here")
  args = parser.parse_args()
  out = os.path.abspath(args.out)
  data_dir = args.data_dir or os.path.join(out, "data")
  base = args.base or near_random_base(out, data_dir, [])
  teachers = args.teachers or ",".join(f"{d}={base}" for d in DOMAINS)
  figures = {f"lag_{lag}": seconds_per_step(out, base, teachers, data_dir,
                                            args.steps, lag, args.variant)
             for lag in (0, 1)}
  figures["ratio"] = figures["lag_0"] / figures["lag_1"]
  for lag in (0, 1):
    print(f"max_policy_lag={lag}: {figures[f'lag_{lag}']:.3f} s/step")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(figures, f, indent=2)
  print(f"ratio sync / async per step: {figures['ratio']:.2f}x")


if __name__ == "__main__":
  main()
