"""What every training stage shares: the optimiser, the train-state pytree and
the step loop (progress bar, metrics, checkpoints, resume, periodic eval)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
import tqdm

from mopd_jax.checkpointing import Checkpointer
from mopd_jax.metrics import MetricWriter
from mopd_jax.reductions import means

# state -> step -> (new state, {name: (sum, count)})
StepFn = Callable[[Any, int], tuple[Any, Mapping[str, tuple]]]
# (state, step) -> {name: scalar}
EvalFn = Callable[[Any, int], Mapping[str, float]]


def make_optimizer(optim, total_steps: int) -> optax.GradientTransformation:
  """AdamW on a linear-warmup, cosine-decay schedule, after global-norm clip.

  ``lr(t) = lr * t / warmup`` for ``t < warmup``, then cosine from ``lr`` down
  to ``lr * end_lr_fraction`` at ``total_steps``.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim.learning_rate,
      warmup_steps=min(optim.warmup_steps, max(total_steps - 1, 0)),
      decay_steps=max(total_steps, 1),
      end_value=optim.learning_rate * optim.end_lr_fraction)
  parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip else []
  parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2,
                           weight_decay=optim.weight_decay))
  return optax.chain(*parts)


def init_state(params, optimizer: optax.GradientTransformation) -> dict:
  """The train state: everything that must survive a restart."""
  return dict(params=params, opt_state=jax.jit(optimizer.init)(params),
              step=jnp.zeros((), jnp.int32))


def write_json_atomic(path: str, payload: Any) -> None:
  """Write JSON to a temporary name, then rename, so readers never see half."""
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def accumulate(total: dict, pairs: Mapping[str, tuple]) -> dict:
  """Add ``{name: (sum, count)}`` pairs into ``total`` (in place)."""
  for k, (s, c) in pairs.items():
    s0, c0 = total.get(k, (0.0, 0.0))
    total[k] = (s0 + s, c0 + c)
  return total


def run_loop(workdir: str, state: Any, step_fn: StepFn, total_steps: int,
             checkpoint, train, eval_fn: EvalFn | None = None,
             desc: str = "train") -> Any:
  """Run ``step_fn`` from the latest checkpoint (or step 0) to ``total_steps``.

  Logs the means of the accumulated ``(sum, count)`` metrics every
  ``train.log_every`` steps, checkpoints every ``checkpoint.every`` steps and
  at the end, and calls ``eval_fn`` every ``train.eval_every`` steps (if > 0)
  and once at the end (again on a re-run of a finished run, without logging).
  """
  ckpt = Checkpointer(workdir, checkpoint.every, checkpoint.keep)
  start = ckpt.latest_step() or 0
  if start:
    state = ckpt.restore(state)
    print(f"resuming from step {start} of {total_steps} ({ckpt.directory})")
  writer = MetricWriter(workdir)
  pending: dict = {}
  tick, tick_step = time.perf_counter(), start
  bar = tqdm.tqdm(range(start, total_steps), initial=start, total=total_steps,
                  desc=desc, dynamic_ncols=True, mininterval=1.0)
  try:
    for step in bar:
      state, pairs = step_fn(state, step)
      pending = accumulate(pending, pairs)
      done = step + 1
      if done % train.log_every == 0 or done == total_steps:
        scalars = means(pending)
        now = time.perf_counter()
        scalars["steps_per_sec"] = (done - tick_step) / max(now - tick, 1e-9)
        tick, tick_step, pending = now, done, {}
        writer.write(done, scalars)
        bar.set_postfix(loss=f"{scalars.get('loss', float('nan')):.4f}")
      ckpt.save(done, state, force=done == total_steps)
      if eval_fn and train.eval_every and done % train.eval_every == 0 and (
          done != total_steps):
        writer.write(done, eval_fn(state, done))
    if eval_fn:
      scalars = eval_fn(state, total_steps)
      if start < total_steps:  # a finished run re-run logs nothing twice
        writer.write(total_steps, scalars)
  finally:
    bar.close()
    writer.close()
    ckpt.close()
  return state
