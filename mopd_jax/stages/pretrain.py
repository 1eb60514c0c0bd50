"""Base model: supervised next-token training on the domains' demonstrations.

Batches mix domains by ``data.weights``; the batch of step ``s`` is a pure
function of ``(seed, s)``, so the data position is the step counter and a
resumed run sees exactly the batches an uninterrupted one would.

With ``select.target > 0`` the run stops by measurement, not at a step
count: skills appear abruptly, at a step that moves with the seed and with
the machine's float rounding, so the base is the first checkpoint (every
``train.eval_every`` steps, at a constant rate) where every training
domain's greedy accuracy on its validation split reaches the target. A
domain above ``select.ceiling`` at an evaluation is drawn at
``select.hold_weight`` times its weight until the next one, so that the
fast skills wait for the slow ones inside the band.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from mopd_jax import config as config_lib
from mopd_jax import parallel, runs, training
from mopd_jax.config import positive
from mopd_jax.data import batching, mixture, splits
from mopd_jax.data.domains import DOMAINS, HELD_OUT_DOMAINS
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation import evaluator, headroom
from mopd_jax.objectives.sft import make_train_step
from mopd_jax.ops import vocab


def defaults() -> ml_collections.ConfigDict:
  """Supervised next-token training of a ``model`` built from scratch on
  every domain's demonstrations."""
  c = config_lib.common("pretrain", init=False)
  c.data.domains = tuple(DOMAINS)
  c.data.weights = ()  # empty: uniform over domains
  config_lib.training(c, steps=1500, rl=False)
  c.train.batch_size = 32  # packed rows of max_prompt_len+max_new_tokens
  # Stop by measurement: at the first evaluation (every train.eval_every
  # steps) where every training domain's greedy accuracy on its validation
  # split reaches ``target``; train.steps is then the limit (not reached:
  # one line, exit 2). 0: off, train.steps steps. ``ceiling`` is the top
  # of the band the base should land in: a domain above it at an
  # evaluation is drawn at ``hold_weight`` x its weight until the next.
  c.select = ml_collections.ConfigDict(dict(
      target=0.0, ceiling=1.0, hold_weight=0.1, num_prompts=256))
  return c


CHECKS = (
    *config_lib.COMMON_CHECKS, *config_lib.TRAINING_CHECKS,
    ("train.batch_size", positive, "> 0"),
    ("select.target", config_lib.is_fraction, "in [0, 1] (0: off)"),
    ("select.ceiling", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("select.num_prompts", positive, "> 0"),
    ("select.hold_weight", lambda v: 0 < v <= 1, "in (0, 1]"),
)


def validate(full) -> None:
  config_lib.check_common(full)
  if full.select.target <= 0:
    return
  if not [d for d in full.data.domains if d not in HELD_OUT_DOMAINS]:
    raise ConfigError("select.target: data.domains has no training domain to"
                      " select on")
  if full.train.eval_every <= 0:
    raise ConfigError("train.eval_every: select.target needs a validation"
                      " evaluation every N > 0 steps")
  if full.optim.end_lr_fraction != 1.0:
    # A decay tied to train.steps (the limit) would make the chosen base
    # depend on the limit.
    raise ConfigError("optim.end_lr_fraction: select.target needs a constant"
                      f" rate after warm-up (1.0), got"
                      f" {full.optim.end_lr_fraction}")
  if full.select.ceiling < full.select.target:
    raise ConfigError("select.ceiling: must be >= select.target")


VARIANTS = ("smoke",)


def recipe(config, variant: str) -> None:
  """The study's base: it must stay partially competent (room for RL), and
  skills appear abruptly at a step that moves with the seed and with the
  machine's float rounding. So it is chosen by measurement: at a constant
  rate, the first checkpoint (every 25 steps) where every training domain
  reaches 25% greedy on its validation split; up to 3000 steps (runs so far
  stopped between 775 and 1700, docs/base.md)."""
  config.data.weights = (1.0, 1.0, 0.5, 0.5, 1.5)
  config.train.update(steps=3000, eval_every=25)
  config.optim.end_lr_fraction = 1.0
  config.select.update(target=0.25, ceiling=0.6)
  config.checkpoint.every = 100
  if variant == "smoke":
    config_lib.shrink_for_smoke(config)
    config.select.target = 0.0  # a 4-step model reaches nothing
    config.model.update(embed_dim=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64)
    config.train.batch_size = 8


def batch_drawer(train_sets, weights: np.ndarray, seed: int, step: int):
  """Example stream of step ``step``: domain ``d ~ w``, then an example of
  ``d`` uniformly, all drawn from ``rng(seed, step)``."""
  rng = np.random.default_rng([seed, step])

  def draw():
    d = int(rng.choice(len(train_sets), p=weights))
    return train_sets[d][int(rng.integers(len(train_sets[d])))]

  return draw


def held_weights(base: np.ndarray, held: np.ndarray, hold_weight: float
                 ) -> np.ndarray:
  """``w_d = b_d h_d / sum_e b_e h_e`` with ``h_d = hold_weight`` for a
  domain held back (above the ceiling at the last evaluation), else 1."""
  w = np.asarray(base) * np.where(np.asarray(held) > 0, hold_weight, 1.0)
  return w / w.sum()


def validation_accuracy(scalars) -> dict[str, float]:
  """``{domain: greedy accuracy}`` from a validation evaluation's scalars."""
  return headroom.accuracies(scalars, "greedy", splits.VALIDATION)


def selection(step: int, accuracy: dict[str, float], select) -> dict | None:
  """Whether the base stops at ``step``: a record of why when every
  domain's greedy validation ``accuracy`` is at least ``select.target``
  (``min_d acc_d >= target``), naming the domains above
  ``select.ceiling``; None before that."""
  if min(accuracy.values()) < select.target:
    return None
  return dict(step=step, reason="every training domain's greedy validation"
              f" accuracy >= {select.target}", target=select.target,
              ceiling=select.ceiling,
              validation_greedy=dict(sorted(accuracy.items())),
              above_ceiling=sorted(d for d, a in accuracy.items()
                                   if a > select.ceiling))


def target_missed(step: int, accuracy: dict[str, float], select) -> str:
  """The one line for a run that reached its last step short of the target
  (its checkpoints stay, so a longer ``train.steps`` resumes)."""
  return (f"select.target: {select.target} not reached by step {step}"
          " (greedy validation accuracy " + ", ".join(
              f"{d} {a:.3f}" for d, a in sorted(accuracy.items())
              if a < select.target) +
          "); raise train.steps to train on, or lower the target")


def run(config, workdir: str):
  """Train the base model; returns the final train state."""
  tokenizer, model_cfg, mesh = runs.setup(config)
  runs.check_divisible(mesh, config.train.batch_size, "train.batch_size")
  train_sets = splits.domain_splits(config, config.data.domains, "train")
  test_sets = splits.eval_sets(config, config.data.domains)
  weights = mixture.base_weights(config.data.domains, config.data.weights)
  length = config.data.max_prompt_len + config.sampling.max_new_tokens
  ops = vocab.VocabOps.of(config.ops)

  optimizer = training.make_optimizer(config.optim, config.train.steps)
  with parallel.activate(mesh):
    state = training.init_state(
        runs.init_params(model_cfg, mesh, config.seed), optimizer)

  train_step = jax.jit(make_train_step(model_cfg, optimizer, ops),
                       donate_argnums=0)

  sources = [train_sets[d] for d in config.data.domains]

  def step_fn(state, step):
    mix = (weights if "held" not in state else held_weights(
        weights, state["held"], config.select.hold_weight))
    draw = batch_drawer(sources, mix, config.seed, step)
    arrays, _ = batching.pack_demonstrations(draw, tokenizer,
                                             config.train.batch_size, length)
    trained = {k: state[k] for k in ("params", "opt_state", "step")}
    with parallel.activate(mesh):
      new, pairs = train_step(trained, parallel.shard_batch(mesh, arrays))
    return dict(state, **new), pairs

  test_eval = evaluator.make_eval_fn(
      config, model_cfg, tokenizer, test_sets, mesh,
      runs.write_eval(workdir, config.train.steps))
  if not config.select.target:
    return training.run_loop(workdir, state, step_fn, config.train.steps,
                             config.checkpoint, config.train, test_eval,
                             desc="pretrain")

  selected = [d for d in config.data.domains if d not in HELD_OUT_DOMAINS]
  val_eval = evaluator.make_eval_fn(
      config, model_cfg, tokenizer,
      splits.domain_splits(config, selected, splits.VALIDATION), mesh,
      greedy_only=True, prefix=splits.VALIDATION,
      num_prompts=config.select.num_prompts)

  def select_eval_fn(state, step):
    """Validation every time; the test evaluation (eval.json) only at the
    step the base stops at."""
    scalars = dict(val_eval(state, step))
    if selection(step, validation_accuracy(scalars), config.select):
      final = test_eval(state, step)
      runs.write_eval(workdir, step)(final)
      scalars.update(final)
    return scalars

  def on_eval(state, step, scalars):
    """Stop at the target; otherwise hold back the domains above the
    ceiling until the next evaluation."""
    accuracy = validation_accuracy(scalars)
    record = selection(step, accuracy, config.select)
    if not record and step >= config.train.steps:
      raise ConfigError(target_missed(step, accuracy, config.select))
    if record:
      print(f"base selected at step {step}: {record['reason']}"
            + (f"; above the ceiling {config.select.ceiling}: "
               + ", ".join(record["above_ceiling"])
               if record["above_ceiling"] else ""))
    held = np.array([accuracy.get(d, 0.0) > config.select.ceiling
                     for d in config.data.domains], np.float32)
    if held.any():
      print(f"step {step}: above the ceiling, held at weight x"
            f"{config.select.hold_weight}: " + ", ".join(
                d for d, h in zip(config.data.domains, held) if h))
    return dict(state, held=held), record

  state["held"] = np.zeros(len(config.data.domains), np.float32)
  return training.run_loop(workdir, state, step_fn, config.train.steps,
                           config.checkpoint, config.train, select_eval_fn,
                           desc=f"pretrain (to {config.select.target:.0%}"
                           " validation)", on_eval=on_eval)
