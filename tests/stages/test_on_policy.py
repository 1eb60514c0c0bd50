"""The shared on-policy step, called directly as the stages call it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import load_config
from mopd_jax import config as config_lib
from mopd_jax.errors import ConfigError
from mopd_jax import parallel, runs, training
from mopd_jax.stages import mopd as mopd_stage
from mopd_jax.stages import on_policy
from mopd_jax.stages import rl as rl_stage


def _context(config, make_method):
  tokenizer, model_cfg, mesh = runs.setup(config)
  sampling = config_lib.sampling_config(config.sampling, tokenizer)
  method, loss, needs_ref = make_method(config, tokenizer, model_cfg, mesh,
                                        sampling)
  params = runs.load_params(config.init, model_cfg, mesh)
  optimizer = training.make_optimizer(config.optim, config.train.steps)
  with parallel.activate(mesh):
    state = training.init_state(params, optimizer)
  state.update(method.init_state())
  rollouts = on_policy.Rollouts(config, tokenizer, model_cfg, mesh,
                                method.names, sampling)
  ref = jax.tree.map(jnp.copy, params) if needs_ref else None
  return (on_policy.Context(config, mesh, rollouts,
                            on_policy.make_update(loss, optimizer), ref),
          method, state)


def _config(name, base, data_dir, **fields):
  config = load_config(name, "smoke")
  config.update(init=str(base), **fields)
  config.data.data_dir = data_dir
  config = config_lib.validate(config)
  runs.resolve_model(config)
  return config


@pytest.mark.parametrize("name", ["mix_rl", "mopd"])
def test_step_advances_the_state_and_reports_every_domain(
    smoke_run, data_dir, name):
  base = smoke_run[0]
  fields = {}
  if name == "mopd":
    fields = {"teachers": ",".join(f"{d}={base}" for d in
                                   ("add", "chain", "instruct", "sort"))}
  make = mopd_stage.make_method if name == "mopd" else rl_stage.make_method
  ctx, method, state = _context(_config(name, base, data_dir, **fields),
                                make)
  # The update donates the state's buffers: keep a copy to step again from.
  kept = jax.tree.map(jnp.copy, state)
  first, pairs = on_policy.step(ctx, method, state, 0)
  first_params = jax.tree.map(jnp.copy, first["params"])
  second, _ = on_policy.step(ctx, method, first, 1)
  assert int(second["step"]) == 2
  for d in method.names:
    assert f"share/tokens/{d}" in pairs and f"reward/{d}" in pairs
  assert np.isfinite(float(pairs["loss"][0]))
  if name == "mix_rl":  # the adaptive mixture saw both steps' prompts
    assert second["mixture"]["count"].sum() == 2 * (
        ctx.config.rl.prompts_per_step)
    assert "advantage_abs" in pairs
  else:  # teachers equal to the student: no signal, every loss weight 1
    assert abs(pairs["signal/add"][0]) < 1e-3 * max(pairs["signal/add"][1],
                                                    1)
    assert second["gap"]["count"].sum() > first["gap"]["count"].sum()
  # The same step from the same state is the same step (no hidden state).
  again, _ = on_policy.step(ctx, method, kept, 0)
  jax.tree.map(np.testing.assert_array_equal, again["params"],
               first_params)


def test_a_run_from_init_keeps_its_own_execution_fields(smoke_run, data_dir):
  """The architecture comes from ``init``; bfloat16, remat and blocked
  attention asked for on this run's command line are not overwritten, and
  an architecture field is not this run's to set."""
  config = load_config("mix_rl", "smoke")
  config.update(init=str(smoke_run[0]))
  config.model.update(dtype="bfloat16", remat=True, attention_chunk=16)
  config.data.data_dir = data_dir
  config = config_lib.validate(config)
  runs.resolve_model(config)
  base = runs.load_run_config(str(smoke_run[0])).model
  assert config.model.embed_dim == base.embed_dim
  assert config.model.num_layers == base.num_layers
  assert (config.model.dtype, config.model.remat,
          config.model.attention_chunk) == ("bfloat16", True, 16)
  other = load_config("mix_rl", "smoke")
  other.update(init=str(smoke_run[0]))
  other.model.embed_dim = 64
  with pytest.raises(ConfigError, match="model.embed_dim: unknown field"):
    config_lib.validate(other)
