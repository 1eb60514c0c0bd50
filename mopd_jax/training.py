"""What every training stage shares: the optimiser, the guarded update, the
train-state pytree and the step loop (progress bar, metrics, checkpoints,
exact resume, periodic eval, run summary)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from mopd_jax.atomic import write_json_atomic
from mopd_jax.checkpointing import Checkpointer
from mopd_jax.checksum import tree_checksum
from mopd_jax.errors import DivergenceError, Interrupted
from mopd_jax.metrics import (METRICS_FILE, MetricWriter, read_metrics,
                              truncate_after)
from mopd_jax.reductions import means

# The metric a step reports its guarded updates under: (skipped, updates).
SKIPPED = "skipped_updates"
SUMMARY_FILE = "summary.json"
# Logged metrics that measure the machine, not the run; left out of summaries.
_TIMINGS = ("steps_per_sec",)

# state -> step -> (new state, {name: (sum, count)})
StepFn = Callable[[Any, int], tuple[Any, Mapping[str, tuple]]]
# (state, step) -> {name: scalar}
EvalFn = Callable[[Any, int], Mapping[str, float]]
# (state, step, the evaluation's scalars) -> (state, why the run stops there
# or None): what a stage decides from an evaluation
OnEval = Callable[[Any, int, Mapping[str, float]], "tuple[Any, dict | None]"]


def learning_rate_schedule(optim, total_steps: int) -> optax.Schedule:
  """Linear warm-up, a constant stretch, then a cosine decay.

  With ``W = warmup_steps``, ``T = total_steps``, ``D = decay_steps`` and the
  decay starting at ``S = max(W, T - D)`` (``S = W`` when ``D = 0``)::

    lr(t) = lr * t / W                                   t < W
          = lr                                           W <= t < S
          = lr * (f + (1 - f) * (1 + cos(pi * (t - S) / (T - S))) / 2)
                                                         S <= t <= T

  with ``f = end_lr_fraction``. ``D = 0`` decays over the whole run after
  warm-up; ``D > 0`` (warmup-stable-decay) makes the run up to ``S`` the
  same for every ``T``, so a checkpoint of the stable stretch is the start
  of the decay of any run that is ``D`` steps longer.
  """
  warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
  start = (max(warmup, total_steps - optim.decay_steps) if optim.decay_steps
           else warmup)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, optim.learning_rate, max(warmup, 1)),
       optax.constant_schedule(optim.learning_rate),
       optax.cosine_decay_schedule(
           optim.learning_rate, max(total_steps - start, 1),
           alpha=optim.end_lr_fraction)],
      boundaries=[warmup, start])


def make_optimizer(optim, total_steps: int) -> optax.GradientTransformation:
  """AdamW on ``learning_rate_schedule``, after global-norm clip."""
  parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip else []
  parts.append(optax.adamw(learning_rate_schedule(optim, total_steps),
                           b1=optim.b1, b2=optim.b2,
                           weight_decay=optim.weight_decay))
  return optax.chain(*parts)


def init_state(params, optimizer: optax.GradientTransformation) -> dict:
  """The train state: everything that must survive a restart.

  The optimiser state is created with every parameter-shaped leaf (AdamW's
  moments) sharded exactly like its parameter; left to itself XLA would
  replicate these zeros on every device. Its other leaves (step counts)
  are left to the compiler.
  """
  shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding,
      jax.eval_shape(optimizer.init, params),
      jax.tree.map(lambda p: p.sharding, params),
      transform_non_params=lambda _: None)
  opt_state = jax.jit(optimizer.init, out_shardings=shardings)(params)
  return dict(params=params, opt_state=opt_state,
              step=jnp.zeros((), jnp.int32))


def guarded_update(optimizer: optax.GradientTransformation, loss, grads,
                   params, opt_state):
  """One optimiser step, taken only when the loss, the gradients and the
  update are finite.

  ``ok = isfinite(loss) & isfinite(||grads||_2) & isfinite(||update||_2)``
  (the last catches a finite gradient turned non-finite by the optimiser,
  e.g. an overflowing learning rate). Returns
  ``(params', opt_state', skipped)``: the usual update when ``ok``, the
  inputs unchanged otherwise (a NaN never reaches the weights or the
  optimiser's moments), and ``skipped = 1 - ok`` as float32, which the step
  reports as the pair ``(skipped, 1)`` under ``SKIPPED``. Jittable: the
  choice is a select per leaf, on the device.
  """
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  ok = (jnp.isfinite(loss) & jnp.isfinite(optax.global_norm(grads))
        & jnp.isfinite(optax.global_norm(updates)))
  new_params = jax.tree.map(jnp.add, params, updates)

  def keep(new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)

  return (keep(new_params, params), keep(new_opt_state, opt_state),
          1.0 - ok.astype(jnp.float32))


def gradient_step(optimizer: optax.GradientTransformation, loss_fn, params,
                  opt_state, *args):
  """``(loss, aux), grads = value_and_grad(loss_fn)(params, *args)`` (the
  loss first, its auxiliary output second), then ``guarded_update``;
  returns ``(aux, params', opt_state', skipped)``."""
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params,
                                                                 *args)
  return (aux, *guarded_update(optimizer, loss, grads, params, opt_state))


def accumulate(total: dict, pairs: Mapping[str, tuple]) -> dict:
  """Add ``{name: (sum, count)}`` pairs into ``total`` (in place)."""
  for k, (s, c) in pairs.items():
    s0, c0 = total.get(k, (0.0, 0.0))
    total[k] = (s0 + s, c0 + c)
  return total


def _to_json(value):
  """A metric sum or count as JSON that reads back with its exact value and
  type (a NumPy/JAX scalar keeps its dtype), so that sums continue bit-exactly
  after a resume."""
  if isinstance(value, (bool, int, float)):
    return value
  array = np.asarray(value)
  return {"dtype": array.dtype.name, "value": array.item()}


def _from_json(value):
  if isinstance(value, dict):
    return np.dtype(value["dtype"]).type(value["value"])
  return value


@dataclasses.dataclass
class LoopState:
  """What the step loop carries between steps besides the train state; saved
  as JSON with every checkpoint, so that a resumed run logs (and stops)
  exactly as an uninterrupted one.

  Attributes:
    pending: ``{name: (sum, count)}`` accumulated since the last log line.
    consecutive_skips: steps in a row, up to the last ``resolve``, with a
      skipped update.
    skipped_steps: steps with a skipped update since the run began.
    unresolved: each step's skip flag (on the device, or None) since the
      last ``resolve``; reading one waits for its step, so the loop reads
      them only where it stops anyway (log lines, evaluations, checkpoints).
    stopped: why the run stopped before its last step (``OnEval``), or None.
  """
  pending: dict = dataclasses.field(default_factory=dict)
  consecutive_skips: int = 0
  skipped_steps: int = 0
  unresolved: list = dataclasses.field(default_factory=list)
  stopped: dict | None = None

  def record(self, pairs: Mapping[str, tuple]) -> None:
    """Fold one step's metrics in (without waiting for the step)."""
    self.unresolved.append(pairs[SKIPPED][0] if SKIPPED in pairs else None)
    accumulate(self.pending, pairs)

  def resolve(self) -> int:
    """Count the recorded steps' skips (a step counts when any of its
    updates was skipped); returns the longest run of consecutive skips."""
    longest = self.consecutive_skips
    for flag in self.unresolved:
      skipped = flag is not None and float(flag) > 0
      self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
      self.skipped_steps += int(skipped)
      longest = max(longest, self.consecutive_skips)
    self.unresolved = []
    return longest

  def flush(self) -> dict[str, float]:
    """The means of the pending window (then emptied) and ``skipped_steps``."""
    scalars = means(self.pending)
    scalars["skipped_steps"] = float(self.skipped_steps)
    self.pending = {}
    return scalars

  def to_json(self) -> dict:
    """As JSON; call after ``resolve`` (unresolved flags are not saved)."""
    return dict(pending={k: [_to_json(s), _to_json(c)]
                         for k, (s, c) in self.pending.items()},
                consecutive_skips=self.consecutive_skips,
                skipped_steps=self.skipped_steps, stopped=self.stopped)

  @classmethod
  def from_json(cls, saved: Mapping) -> "LoopState":
    return cls(pending={k: (_from_json(s), _from_json(c))
                        for k, (s, c) in saved.get("pending", {}).items()},
               consecutive_skips=int(saved.get("consecutive_skips", 0)),
               skipped_steps=int(saved.get("skipped_steps", 0)),
               stopped=saved.get("stopped"))


@contextlib.contextmanager
def signals_noted():
  """While inside, SIGTERM (what a preemption sends) and a first Ctrl-C
  (SIGINT) are noted (the yielded list gets their numbers) instead of
  killing the process, so that the loop can end its step and checkpoint; a
  second Ctrl-C stops at once (``KeyboardInterrupt``). Outside the main
  thread, nothing changes."""
  received: list = []
  if threading.current_thread() is not threading.main_thread():
    yield received
    return

  def note(signum, _):
    if signum == signal.SIGINT:
      if signal.SIGINT in received:
        raise KeyboardInterrupt
      print("\nstopping after this step with a checkpoint (Ctrl-C again:"
            " stop now, back to the last checkpoint)", file=sys.stderr,
            flush=True)
    received.append(signum)

  previous = {s: signal.signal(s, note)
              for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    yield received
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def run_loop(workdir: str, state: Any, step_fn: StepFn, total_steps: int,
             checkpoint, train, eval_fn: EvalFn | None = None,
             desc: str = "train", on_eval: OnEval | None = None) -> Any:
  """Run ``step_fn`` from the newest readable checkpoint (or step 0) to
  ``total_steps``, or to the first evaluation at which ``on_eval`` gives a
  reason to stop; returns the final state.

  After step ``s`` (1-based): a line of the means of the accumulated
  ``(sum, count)`` metrics every ``train.log_every`` steps and at the end;
  ``eval_fn`` every ``train.eval_every`` steps (if > 0) and at the end; then
  a checkpoint every ``checkpoint.every`` steps and at the end. A checkpoint
  therefore follows everything its step logs, and resuming from it drops the
  log records past it: as long as ``step_fn``'s randomness is a function of
  the state and ``(seed, step)``, a run killed at any moment and re-run with
  the same command ends with the same parameters and metrics.jsonl as one
  never stopped (bit for bit on CPU).

  SIGTERM (a preemption) or a first Ctrl-C ends the run after the current
  step: its checkpoint is saved (what was logged past the previous
  checkpoint stays valid) and an ``Interrupted`` error says so; the same
  command resumes it exactly.

  A step whose metrics report a skipped update (``SKIPPED``, from
  ``guarded_update``) counts into ``skipped_steps``; once
  ``train.max_consecutive_skips`` such steps in a row are seen (the flags are
  read at log lines, evaluations and checkpoints, so that steps are
  dispatched without waiting) the run stops with a ``DivergenceError``,
  writing no further checkpoint.

  After each evaluation ``on_eval(state, step, scalars)`` returns the state
  to train on (a stage's decisions from the evaluation, saved with the
  checkpoints like the rest of the state) and, to end the run there, why:
  a checkpoint of that step (its loop state holding the reason, so that a
  re-run does not train on) and the reason in ``summary.json`` under
  ``stopped``.

  Ends by writing ``<workdir>/summary.json`` (``write_summary``), also on a
  re-run of a finished run.
  """
  loop, start = LoopState(), 0
  with contextlib.ExitStack() as cleanup:  # closed last-opened first
    ckpt = Checkpointer(workdir, checkpoint.every, checkpoint.keep)
    cleanup.callback(ckpt.close)  # waits for saves in flight
    restored = ckpt.restore_latest(state)
    if restored:
      start, state, saved = restored
      loop = LoopState.from_json(saved)
      print(f"resuming from step {start} of {total_steps}"
            f" ({ckpt.directory})")
    truncate_after(workdir, start)
    writer = MetricWriter(workdir, purge_step=start + 1)
    cleanup.callback(writer.close)
    bar = tqdm.tqdm(range(start, total_steps), initial=start,
                    total=total_steps, desc=desc, dynamic_ncols=True,
                    mininterval=1.0)
    cleanup.callback(bar.close)
    received = cleanup.enter_context(signals_noted())
    last_saved = start or None
    tick, tick_step = time.perf_counter(), start
    done = start
    for step in ([] if loop.stopped else bar):
      state, pairs = step_fn(state, step)
      loop.record(pairs)
      done = step + 1
      log = done % train.log_every == 0 or done == total_steps
      evaluate = eval_fn and (done == total_steps or (
          train.eval_every and done % train.eval_every == 0))
      # read once: a signal arriving later in this step is acted on after
      # the next step, so the step it names always has its checkpoint
      interrupted = bool(received)
      save = done == total_steps or ckpt.due(done) or interrupted
      if not (log or evaluate or save):
        continue
      longest = loop.resolve()
      diverged = longest >= train.max_consecutive_skips
      if log or diverged:
        scalars = loop.flush()
        now = time.perf_counter()
        scalars["steps_per_sec"] = (done - tick_step) / max(now - tick, 1e-9)
        tick, tick_step = now, done
        writer.write(done, scalars)
        bar.set_postfix(loss=f"{scalars.get('loss', float('nan')):.4f}")
      if diverged:
        kept = (f"the checkpoint of step {last_saved} is intact" if last_saved
                else "no checkpoint was written")
        raise DivergenceError(
            f"step {done}: the update was skipped {longest} steps in a row"
            " (non-finite loss, gradient or update); stopped, and"
            f" {kept} (lower optim.learning_rate or check the data)")
      if evaluate:
        scalars = eval_fn(state, done)
        writer.write(done, scalars)
        if on_eval:
          state, loop.stopped = on_eval(state, done, scalars)
      if loop.stopped and loop.pending:  # the last log line is this step's
        writer.write(done, loop.flush())
      if save or loop.stopped:
        ckpt.save(done, state, force=True, loop=loop.to_json())
        last_saved = done
      if loop.stopped:
        break
      if interrupted:
        name = signal.Signals(received[0]).name
        raise Interrupted(f"stopped by {name} after step {done}, its"
                          " checkpoint saved; run the same command to"
                          " resume")
  write_summary(workdir, done, state["params"], stopped=loop.stopped)
  return state


def write_summary(workdir: str, step: int, params: Any, **extra) -> dict:
  """Write and return ``<workdir>/summary.json``: the final ``step``, the
  ``params_sha256`` of the final parameters (``checksum.tree_checksum``),
  ``metrics``, the last logged value of every metric except timings, the
  number of ``devices`` it ran on, and the ``extra`` entries that are not
  None. Two runs with equal summaries ended with bit-identical parameters.
  Stages without a step loop (no metrics.jsonl) call it too."""
  final: dict = {}
  records = read_metrics(workdir) if os.path.exists(
      os.path.join(workdir, METRICS_FILE)) else []
  for record in records:
    final.update(record)
  for key in ("step", *_TIMINGS):
    final.pop(key, None)
  summary = dict(step=step, params_sha256=tree_checksum(params),
                 metrics=final, devices=jax.device_count(),
                 **{k: v for k, v in extra.items() if v is not None})
  write_json_atomic(os.path.join(workdir, SUMMARY_FILE), summary)
  return summary
