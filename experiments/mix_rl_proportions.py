"""Mix RL's domain proportions: how each domain's result moves with them.

    python experiments/mix_rl_proportions.py --base=runs/base \
        --out=runs/proportions [--boost=3] [--domains=add,chain,...] \
        [--variant=smoke] [--eval_prompts=480] [-- field=value ...]

Runs Mix RL from ``--base`` once with uniform proportions and once per
training domain with that domain's weight multiplied by ``--boost``
(``<out>/uniform``, ``<out>/boost_<domain>`` for each of ``--domains``,
all training domains by default; ordinary runs, so re-running
skips finished ones; ``field=value`` arguments after ``--`` go to every
run's config). Each is evaluated on ``--eval_prompts`` test prompts per
domain, then ``<out>/proportions.md``, ``.json`` and ``.png``: every
domain's greedy accuracy against its own share of the prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from mopd_jax import stages
from mopd_jax.atomic import (write_bytes_atomic, write_json_atomic,
                             write_text_atomic)
from mopd_jax.data.domains import DOMAINS, TRAIN_DOMAINS
from mopd_jax.errors import UserError, fail
from mopd_jax.evaluation.run_eval import evaluate_run
from mopd_jax.evaluation import figures, headroom
from mopd_jax.stages.study import child_config
from mopd_jax.training import SUMMARY_FILE


def mixtures(boost: float, boosted=TRAIN_DOMAINS
             ) -> dict[str, tuple[float, ...]]:
  """``{run name: data.weights}``: uniform, then each of ``boosted``."""
  out = {"uniform": (1.0,) * len(TRAIN_DOMAINS)}
  for i, d in enumerate(TRAIN_DOMAINS):
    if d not in boosted:
      continue
    out[f"boost_{d}"] = tuple(boost if j == i else 1.0
                              for j in range(len(TRAIN_DOMAINS)))
  return out


def shares(weights) -> dict[str, float]:
  w = np.asarray(weights, np.float64)
  return dict(zip(TRAIN_DOMAINS, (w / w.sum()).tolist()))


def sweep(args, overrides) -> dict:
  """Train and evaluate every mixture; ``{name: {weights, shares,
  accuracy: {mode: {domain: acc}}}}``."""
  found = {}
  for name, weights in mixtures(args.boost, args.domains).items():
    workdir = os.path.join(args.out, name)
    if not os.path.exists(os.path.join(workdir, SUMMARY_FILE)):
      config = child_config("mix_rl", args.variant, overrides,
                            init=args.base, **{"data.weights": weights})
      stages.run(config, workdir)
    path = os.path.join(workdir, f"eval_{args.eval_prompts}.json")
    if not os.path.exists(path):
      evaluate_run(workdir, args.eval_prompts, list(DOMAINS),
                   stages.defaults("mix_rl"), execution=False)
    with open(path, encoding="utf-8") as f:
      scalars = json.load(f)
    found[name] = dict(weights=list(weights), shares=shares(weights),
                       accuracy={m: headroom.accuracies(scalars, m)
                                 for m in ("greedy", "sampled")})
  return found


def table(found: dict) -> str:
  cols = [*TRAIN_DOMAINS, "reverse"]
  rows = ["| mixture | " + " | ".join(cols) + " |",
          "|---" * (len(cols) + 1) + "|"]
  for name, r in found.items():
    g, s = r["accuracy"]["greedy"], r["accuracy"]["sampled"]
    rows.append(f"| {name} | " + " | ".join(
        f"{100 * g[d]:.1f} ({100 * s[d]:.1f})" for d in cols) + " |")
  return "\n".join(rows)


def plot(found: dict) -> bytes:
  """Each domain's greedy accuracy against its share of the prompts."""
  plt = figures.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for d in TRAIN_DOMAINS:
    points = sorted((r["shares"][d], 100 * r["accuracy"]["greedy"][d])
                    for r in found.values())
    ax.plot(*zip(*points), marker="o", label=d)
  ax.set(xlabel="share of the prompts", ylabel="greedy accuracy (%)",
         title="Mix RL: accuracy against the domain's proportion")
  ax.legend()
  fig.tight_layout()
  return figures.png_bytes(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--base", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--boost", type=float, default=3.0)
  parser.add_argument("--domains", default=",".join(TRAIN_DOMAINS),
                      type=lambda v: tuple(d for d in v.split(",") if d))
  parser.add_argument("--variant", default="")
  parser.add_argument("--eval_prompts", type=int, default=480)
  argv, overrides = sys.argv[1:], []
  if "--" in argv:
    cut = argv.index("--")
    argv, overrides = argv[:cut], argv[cut + 1:]
  args = parser.parse_args(argv)
  try:
    if args.boost <= 0:
      raise UserError(f"--boost: {args.boost} must be > 0")
    unknown = sorted(set(args.domains) - set(TRAIN_DOMAINS))
    if unknown:
      raise UserError(f"--domains: {unknown[0]!r} is not a training domain")
    found = sweep(args, overrides)
  except UserError as e:
    fail(str(e))
  write_json_atomic(os.path.join(args.out, "proportions.json"), found)
  write_text_atomic(os.path.join(args.out, "proportions.md"),
                    "# Mix RL proportions\n\nGreedy (sampled) accuracy on"
                    f" {args.eval_prompts} test prompts per domain; each"
                    f" boost multiplies one domain's weight by {args.boost}."
                    "\n\n" + table(found) + "\n\n![](proportions.png)\n")
  write_bytes_atomic(os.path.join(args.out, "proportions.png"), plot(found))
  print(table(found))


if __name__ == "__main__":
  main()
