"""The shared on-policy step, called directly as the stages call it."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import load_config
from mopd_jax import stages
from mopd_jax.errors import ConfigError
from mopd_jax.rollout.sampler import SamplingConfig
from mopd_jax import parallel, runs, training
from mopd_jax.stages import mopd as mopd_stage
from mopd_jax.stages import on_policy
from mopd_jax.stages import mix_rl as mix_rl_stage


def _context(config, make_method, meshes=None):
  tokenizer, model_cfg, mesh = runs.setup(config)
  mesh, sample_mesh = meshes or (mesh, mesh)
  sampling = SamplingConfig.of(config.sampling, tokenizer)
  method, loss, needs_ref = make_method(config, tokenizer, model_cfg, mesh,
                                        sampling)
  params = runs.load_params(config.init, model_cfg, mesh)
  optimizer = training.make_optimizer(config.optim, config.train.steps)
  with parallel.activate(mesh):
    state = training.init_state(params, optimizer)
  state.update(method.init_state())
  if config.rl.max_policy_lag:
    state["pending"] = on_policy.init_pending(
        config, sampling.max_new_tokens, len(method.names))
  rollouts = on_policy.Rollouts(config, tokenizer, model_cfg, mesh,
                                method.names, sampling, sample_mesh)
  ref = jax.tree.map(jnp.copy, params) if needs_ref else None
  return (on_policy.Context(config, mesh, rollouts,
                            on_policy.make_update(loss, optimizer), ref),
          method, state)


def _config(name, base, data_dir, **fields):
  config = load_config(name, "smoke")
  config.update(init=str(base), **fields)
  config.data.data_dir = data_dir
  config = stages.validate(config)
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
  make = (mopd_stage.make_method if name == "mopd"
          else mix_rl_stage.make_method)
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
  """The architecture comes from ``init``; bfloat16, remat, blocked
  attention and unscanned layers asked for on this run's command line are
  not overwritten, and
  an architecture field is not this run's to set."""
  config = load_config("mix_rl", "smoke")
  config.update(init=str(smoke_run[0]))
  config.model.update(dtype="bfloat16", remat=True, attention_chunk=16,
                      scan_layers=False)
  config.data.data_dir = data_dir
  config = stages.validate(config)
  runs.resolve_model(config)
  base = runs.load_run_config(str(smoke_run[0])).model
  assert config.model.embed_dim == base.embed_dim
  assert config.model.num_layers == base.num_layers
  assert (config.model.dtype, config.model.remat,
          config.model.attention_chunk, config.model.scan_layers) == (
              "bfloat16", True, 16, False)
  other = load_config("mix_rl", "smoke")
  other.update(init=str(smoke_run[0]))
  other.model.embed_dim = 64
  with pytest.raises(ConfigError, match="model.embed_dim: unknown field"):
    stages.validate(other)


def test_one_step_async_trains_on_the_previous_steps_rollouts(smoke_run,
                                                               data_dir):
  """``rl.max_policy_lag=1``: step 0 samples its own rollouts and leaves
  step 1's in the state, sampled on the sampler's device with step 0's
  parameters (the very rollout that a synchronous sampling of step 1 with
  them gives); step 1 trains on them (lagged) and leaves step 2's; a
  one-device mesh is refused in one line."""
  config = _config("mix_rl", smoke_run[0], data_dir,
                   rl=dict(load_config("mix_rl", "smoke").rl,
                           max_policy_lag=1, tis_cap=2.0))
  meshes = on_policy.split_for_sampling(
      parallel.make_mesh(devices=jax.devices()[:2]), config)
  assert [m.devices.size for m in meshes] == [1, 1]
  ctx, method, state = _context(config, mix_rl_stage.make_method, meshes)
  params_0 = jax.tree.map(jnp.copy, state["params"])
  first, pairs = on_policy.step(ctx, method, state, 0)
  assert pairs["policy_lag"] == (0.0, 1.0)
  pending = first["pending"]
  assert (int(pending["step"]), int(pending["params_step"])) == (1, 0)
  want = ctx.rollouts(params_0, pending["weights"], 1)[4]
  np.testing.assert_array_equal(pending["completion"], want.completion)
  np.testing.assert_allclose(pending["logprobs"], want.logprobs, atol=1e-6)
  second, pairs = on_policy.step(ctx, method, first, 1)
  assert pairs["policy_lag"] == (1.0, 1.0)
  assert int(second["pending"]["params_step"]) == 1
  with pytest.raises(ConfigError, match="a device of their own"):
    on_policy.split_for_sampling(parallel.make_mesh(
        devices=jax.devices()[:1]), config)


@pytest.mark.parametrize("minibatches,buckets,field", [
    (2, 1, None), (2, 2, None), (8, 1, "rl.minibatches"),
    (2, 4, "rl.length_buckets")])
def test_check_mesh_names_the_field_that_breaks_the_data_split(
    minibatches, buckets, field):
  """8 prompts x 4 samples over 8 data-parallel devices: minibatches of 16
  split, parts of 4 do not (and what GRPO's and CoPD's runs check)."""
  rl = ml_collections.ConfigDict(dict(
      prompts_per_step=8, group_size=4, minibatches=minibatches,
      length_buckets=buckets))
  mesh = parallel.make_mesh(4, 2, 1)
  if field is None:
    on_policy.check_mesh(mesh, rl)
  else:
    with pytest.raises(ConfigError, match=field):
      on_policy.check_mesh(mesh, rl)
