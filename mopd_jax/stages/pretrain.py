"""Base model: supervised next-token training on the domains' demonstrations.

Batches mix domains by ``data.weights``; the batch of step ``s`` is a pure
function of ``(seed, s)``, so the data position is the step counter and a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

from mopd_jax import config as config_lib
from mopd_jax import parallel, training
from mopd_jax.data import batching, tfds_builder
from mopd_jax.data.domains import get_domain
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation import accuracy
from mopd_jax.models import decoder
from mopd_jax.models.tokenizer import CharTokenizer
from mopd_jax.objectives.sft import sft_loss


def mixture_weights(domains, weights) -> np.ndarray:
  """Normalised sampling proportions ``w_d`` (uniform when none are given)."""
  w = np.ones(len(domains)) if not weights else np.asarray(weights, float)
  return w / w.sum()


def batch_drawer(train_sets, weights: np.ndarray, seed: int, step: int):
  """Example stream of step ``step``: domain ``d ~ w``, then an example of
  ``d`` uniformly, all drawn from ``rng(seed, step)``."""
  rng = np.random.default_rng([seed, step])

  def draw():
    d = int(rng.choice(len(train_sets), p=weights))
    return train_sets[d][int(rng.integers(len(train_sets[d])))]

  return draw


def load_domains(config):
  """``(train, test)``: per-domain example sequences from the TFDS datasets."""
  data_dir = os.path.expanduser(config.data.data_dir)
  for name in config.data.domains:
    get_domain(name)  # unknown names fail here, with the list of known ones
  def split(name, which):
    return tfds_builder.load_split(name, which, data_dir,
                                   num_train=config.data.train_examples,
                                   num_test=config.data.test_examples)

  train = {d: split(d, "train") for d in config.data.domains}
  test = {d: split(d, "test") for d in config.data.domains}
  return train, test


def make_eval_fn(config, model_cfg, tokenizer, test, mesh):
  """Sampled (``eval.temperature``) and greedy accuracy on every domain."""
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  subsets = {d: list(exs)[:config.eval.num_prompts] for d, exs in test.items()}
  modes = {"sampled": config.eval.temperature}
  if config.eval.greedy:
    modes["greedy"] = 0.0

  def eval_fn(state, step):
    results = {}
    with parallel.activate(mesh):
      for mode, temperature in modes.items():
        sampling = config_lib.sampling_config(config.sampling, tokenizer,
                                              temperature=temperature)
        results[mode] = accuracy.evaluate(
            state["params"], model_cfg, tokenizer, subsets, sampling,
            jax.random.fold_in(key, step), config.eval.batch_size,
            config.data.max_prompt_len)
    print(f"\nevaluation at step {step}:\n" + accuracy.format_table(results))
    return {f"eval/{mode}/{d}/{metric}": value
            for mode, r in results.items() for d, m in r.items()
            for metric, value in m.items()}

  return eval_fn, modes


def run(config, workdir: str):
  """Train the base model; returns the final train state."""
  tokenizer = CharTokenizer()
  model_cfg = config_lib.model_config(config)
  if model_cfg.vocab_size != tokenizer.vocab_size:
    raise ConfigError(f"model.vocab_size: {model_cfg.vocab_size} differs from"
                      f" the tokenizer's {tokenizer.vocab_size}")
  mesh = parallel.make_mesh(**config.mesh)
  data_parallel = mesh.shape["data"] * mesh.shape["fsdp"]
  if config.train.batch_size % data_parallel:
    raise ConfigError(f"train.batch_size: {config.train.batch_size} is not a"
                      f" multiple of the {data_parallel} data-parallel devices")
  train_sets, test_sets = load_domains(config)
  weights = mixture_weights(config.data.domains, config.data.weights)
  length = config.data.max_prompt_len + config.sampling.max_new_tokens

  optimizer = training.make_optimizer(config.optim, config.train.steps)
  shardings = parallel.logical_sharding(mesh, decoder.logical_axes(model_cfg))
  init = jax.jit(decoder.init_params, static_argnums=0,
                 out_shardings=shardings)
  with parallel.activate(mesh):
    state = training.init_state(init(model_cfg, jax.random.key(config.seed)),
                                optimizer)

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(state, batch):
    def loss_fn(params):
      total, count = sft_loss(params, model_cfg, batch)
      return total / count, (total, count)

    grads, (total, count) = jax.grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"],
                                          state["params"])
    params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
    new_state = dict(params=params, opt_state=opt_state,
                     step=state["step"] + 1)
    return new_state, {"loss": (total, count)}

  batch_sharding = parallel.batch_sharding(mesh)

  def step_fn(state, step):
    draw = batch_drawer([train_sets[d] for d in config.data.domains], weights,
                        config.seed, step)
    arrays, _ = batching.pack_demonstrations(draw, tokenizer,
                                             config.train.batch_size, length)
    with parallel.activate(mesh):
      return train_step(state, jax.device_put(arrays, batch_sharding))

  eval_fn, modes = make_eval_fn(config, model_cfg, tokenizer, test_sets, mesh)
  final_scalars = {}

  def eval_and_keep(state, step):
    scalars = eval_fn(state, step)
    final_scalars.update(scalars)
    return scalars

  state = training.run_loop(workdir, state, step_fn, config.train.steps,
                            config.checkpoint, config.train, eval_and_keep,
                            desc="pretrain")
  training.write_json_atomic(os.path.join(workdir, "eval.json"),
                             {"step": config.train.steps,
                              "modes": list(modes), **final_scalars})
  return state
