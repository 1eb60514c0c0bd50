"""Base model: supervised next-token training on the domains' demonstrations.

Batches mix domains by ``data.weights``; the batch of step ``s`` is a pure
function of ``(seed, s)``, so the data position is the step counter and a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import jax
import numpy as np

from mopd_jax import config as config_lib
from mopd_jax import parallel, training
from mopd_jax.data import batching, mixture
from mopd_jax.objectives.sft import make_train_step
from mopd_jax.stages import common


def batch_drawer(train_sets, weights: np.ndarray, seed: int, step: int):
  """Example stream of step ``step``: domain ``d ~ w``, then an example of
  ``d`` uniformly, all drawn from ``rng(seed, step)``."""
  rng = np.random.default_rng([seed, step])

  def draw():
    d = int(rng.choice(len(train_sets), p=weights))
    return train_sets[d][int(rng.integers(len(train_sets[d])))]

  return draw


def run(config, workdir: str):
  """Train the base model; returns the final train state."""
  tokenizer, model_cfg, mesh = common.setup(config)
  common.check_divisible(mesh, config.train.batch_size, "train.batch_size")
  train_sets = common.domain_splits(config, config.data.domains, "train")
  test_sets = common.eval_sets(config, config.data.domains)
  weights = mixture.base_weights(config.data.domains, config.data.weights)
  length = config.data.max_prompt_len + config.sampling.max_new_tokens
  ops = config_lib.op_options(config)

  optimizer = training.make_optimizer(config.optim, config.train.steps)
  with parallel.activate(mesh):
    state = training.init_state(
        common.init_params(model_cfg, mesh, config.seed), optimizer)

  train_step = jax.jit(make_train_step(model_cfg, optimizer, ops),
                       donate_argnums=0)

  sources = [train_sets[d] for d in config.data.domains]

  def step_fn(state, step):
    draw = batch_drawer(sources, weights, config.seed, step)
    arrays, _ = batching.pack_demonstrations(draw, tokenizer,
                                             config.train.batch_size, length)
    with parallel.activate(mesh):
      return train_step(state, parallel.shard_batch(mesh, arrays))

  eval_fn = common.make_eval_fn(config, model_cfg, tokenizer, test_sets, mesh,
                                common.write_eval(workdir, config.train.steps))
  return training.run_loop(workdir, state, step_fn, config.train.steps,
                           config.checkpoint, config.train, eval_fn,
                           desc="pretrain")
