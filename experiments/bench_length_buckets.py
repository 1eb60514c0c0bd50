"""Benchmark: a batch's optimiser steps with and without ``rl.length_buckets``.

    python experiments/bench_length_buckets.py [--preset=tiny] [--rows=128]
        [--prompt_len=24] [--width=160] [--short_share=0.5] [--short=3]
        [--long=113] [--minibatches=4] [--epochs=2] [--buckets=2,4]
        [--repeats=5]

The updates of one MOPD step of ``configs/study.py:imbalanced``'s shape:
``rows`` rollouts, a ``short_share`` of them ``short`` tokens long (the
concise domain) and the rest about ``long`` (normal, sd a fifth of it, at
most ``width``: the long derivations), one routed teacher of the same
shape, the full-vocabulary KL loss (``opd.loss=kl``), ``epochs`` passes of
``minibatches`` shuffled minibatches (``on_policy.optimise``, the stage's
own loop). Timed: the whole loop with one part per minibatch (padded to
the batch's longest completion) and with each ``--buckets`` count of
length parts, the calls interleaved, every width compiled before timing.
Prints seconds, completion tokens padded per loop, and the ratio one
part / k parts.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import parallel, stages
from mopd_jax.distill import teachers as teacher_lib
from mopd_jax.models import decoder
from mopd_jax.models.config import PRESETS
from mopd_jax.objectives import opd
from mopd_jax.ops import vocab
from mopd_jax.rollout import sampler
from mopd_jax.stages import mopd as mopd_stage
from mopd_jax.stages import on_policy
from mopd_jax.timing import interleaved
from mopd_jax.training import init_state, make_optimizer


def rollout_batch(cfg, params, args, rng: np.random.Generator) -> dict:
  """A scored batch of the shape above (random tokens; the cost of a
  forward and backward pass does not depend on them)."""
  rows, width = args.rows, args.width
  short = rng.random(rows) < args.short_share
  lengths = np.where(short, args.short, np.clip(
      rng.normal(args.long, args.long / 5, rows), 1, width)).astype(int)
  mask = (np.arange(width) < lengths[:, None]).astype(np.int32)
  data = dict(
      prompt=rng.integers(3, cfg.vocab_size, (rows, args.prompt_len),
                          dtype=np.int32),
      prompt_mask=np.ones((rows, args.prompt_len), np.int32),
      completion=rng.integers(3, cfg.vocab_size, (rows, width),
                              dtype=np.int32),
      mask=mask, old_logp=np.full((rows, width), -3.0, np.float32) * mask,
      advantages=np.zeros(rows, np.float32), keep=np.ones(rows, np.float32),
      weight=np.ones(rows, np.float32))
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1,
                            devices=jax.devices()[:1])
  scorer = teacher_lib.make_scorer((cfg,), (1.0,), True, True)
  data.update(teacher_lib.score([scorer], [(params,)],
                                np.zeros(rows, np.int32), data, mesh,
                                cfg.embed_dim))
  data["teacher_id"] = np.zeros((rows, width), np.int32)
  return data


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--prompt_len", type=int, default=24)
  parser.add_argument("--width", type=int, default=160)
  parser.add_argument("--short_share", type=float, default=0.5)
  parser.add_argument("--short", type=int, default=3)
  parser.add_argument("--long", type=int, default=113)
  parser.add_argument("--minibatches", type=int, default=4)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--buckets", default="2,4")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)
  counts = [1] + [int(k) for k in args.buckets.split(",")]

  cfg = PRESETS[args.preset]
  config = stages.defaults("mopd")
  config.rl.update(minibatches=args.minibatches, epochs=args.epochs)
  sampling = sampler.SamplingConfig(max_new_tokens=args.width, stop_ids=())
  params = decoder.init_params(cfg, jax.random.key(0))
  data = rollout_batch(cfg, params, args, np.random.default_rng(0))
  teacher_w = mopd_stage.stacked_unembeddings([(params,)], [(cfg,)])
  optimizer = make_optimizer(config.optim, 1000)
  update = on_policy.make_update(
      opd.make_loss(cfg, sampling, config.rl, config.opd, False,
                    vocab.DEFAULT_OPS), optimizer)
  state = init_state(params, optimizer)
  padded = {}

  def loop(k):
    rl = config.rl.copy_and_resolve_references()
    rl.length_buckets = k
    train = jax.tree.map(jnp.copy, dict(params=state["params"],
                                        opt_state=state["opt_state"]))
    # the same shuffles every call: the same widths, compiled by the first
    train, _ = on_policy.optimise(train, data, update, rl,
                                  np.random.default_rng(1), None,
                                  (teacher_w,))
    jax.block_until_ready(train)

  for k in counts:
    size = args.rows // args.minibatches
    order = np.random.default_rng(1)
    padded[k] = 0
    for _ in range(args.epochs):
      perm = order.permutation(args.rows)
      for m in range(args.minibatches):
        idx = perm[m * size:(m + 1) * size]
        parts = on_policy.length_parts({"mask": data["mask"][idx]}, k)
        padded[k] += sum(p["mask"].size for p in parts)
  seconds = interleaved([lambda k=k: loop(k) for k in counts], args.repeats)
  real = int(data["mask"].sum()) * args.epochs
  print(f"backend={jax.default_backend()} preset={args.preset}"
        f" rows={args.rows} minibatches={args.minibatches}"
        f" epochs={args.epochs} completion tokens={real}")
  for k, s in zip(counts, seconds):
    print(f"length_buckets={k}  {s:8.3f} s  {padded[k]:7d} completion"
          f" columns padded  ({real / padded[k]:.0%} real)")
  for k, s in zip(counts[1:], seconds[1:]):
    print(f"ratio (1 part / {k} parts) {seconds[0] / s:.2f}x")


if __name__ == "__main__":
  main()
