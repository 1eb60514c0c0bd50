"""Benchmark: a batch of concise and long rows sampled by one call or by
budget (``sampler.sample_by_budget``).

    python experiments/bench_sampling_budgets.py [--preset=tiny]
        [--rows=128] [--prompt_len=24] [--short_share=0.5] [--short=8]
        [--long=192] [--repeats=5]

The rollouts of one MOPD step of ``configs/study.py:imbalanced``'s shape
by default: ``rows`` rows, a ``short_share`` of them of the concise
domain (budget ``short`` tokens, ``instruct``'s) and the rest of the
long one (``long``, ``derive``'s), random parameters and prompts, no
stop token, so every row runs to its budget (the most the split can
save: a trained model's rows end earlier). Timed, the calls
interleaved: ``sampler.sample`` of every row up to ``long`` tokens (one
call, what Rollouts did before), and ``sample_by_budget`` (the concise
rows by a call of their own). Prints both and their ratio.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from mopd_jax.models import decoder
from mopd_jax.models.config import PRESETS
from mopd_jax.rollout import sampler
from mopd_jax.timing import interleaved


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--prompt_len", type=int, default=24)
  parser.add_argument("--short_share", type=float, default=0.5)
  parser.add_argument("--short", type=int, default=8)
  parser.add_argument("--long", type=int, default=192)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)

  cfg = PRESETS[args.preset]
  params = decoder.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompt = rng.integers(3, cfg.vocab_size, (args.rows, args.prompt_len),
                        dtype=np.int32)
  mask = np.ones_like(prompt)
  budgets = np.where(rng.random(args.rows) < args.short_share, args.short,
                     args.long)
  sampling = sampler.SamplingConfig(max_new_tokens=args.long, stop_ids=())
  keys = iter(jax.random.split(jax.random.key(1), 2 * args.repeats + 2))

  def one_call():
    jax.block_until_ready(sampler.sample(params, cfg, prompt, mask,
                                         next(keys), sampling))

  def by_budget():
    jax.block_until_ready(sampler.sample_by_budget(
        params, cfg, prompt, mask, next(keys), sampling, budgets))

  seconds = interleaved([one_call, by_budget], args.repeats)
  short = int((budgets == args.short).sum())
  print(f"backend={jax.default_backend()} preset={args.preset}"
        f" rows={args.rows} ({short} of {args.short} tokens, the rest"
        f" {args.long})")
  print(f"one call   {seconds[0]:8.3f} s")
  print(f"by budget  {seconds[1]:8.3f} s")
  print(f"ratio (one call / by budget) {seconds[0] / seconds[1]:.2f}x")


if __name__ == "__main__":
  main()
