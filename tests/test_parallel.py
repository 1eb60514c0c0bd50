"""Sharded forward and train step on 8 fake CPU devices equal one device."""

import jax
import numpy as np
import optax
import pytest

from mopd_jax import parallel
from mopd_jax.errors import ConfigError
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.objectives.sft import sft_loss

CFG = ModelConfig(vocab_size=40, embed_dim=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mlp_dim=64)


def test_make_mesh_shapes_and_errors():
  assert len(jax.devices()) == 8
  assert dict(parallel.make_mesh(2, 2, 2).shape) == dict(
      data=2, fsdp=2, tensor=2)
  assert dict(parallel.make_mesh(-1, 1, 4).shape)["data"] == 2
  with pytest.raises(ConfigError, match="mesh"):
    parallel.make_mesh(3, 1, 1)
  with pytest.raises(ConfigError, match="mesh"):
    parallel.make_mesh(-1, -1, 1)


def test_sharded_train_step_matches_single_device():
  mesh = parallel.make_mesh(2, 2, 2)
  params = decoder.init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = dict(tokens=rng.integers(3, 40, (8, 12)).astype(np.int32),
               segment_ids=np.ones((8, 12), np.int32),
               loss_mask=np.ones((8, 12), np.int32))
  opt = optax.adam(1e-2)

  def step(params, batch):
    def loss(p):
      s, c = sft_loss(p, CFG, batch)
      return s / c
    value, grads = jax.value_and_grad(loss)(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates), value

  ref_params, ref_loss = jax.jit(step)(params, batch)
  shardings = parallel.logical_sharding(mesh, decoder.logical_axes(CFG))
  with parallel.activate(mesh):
    sharded = jax.device_put(params, shardings)
    b = jax.device_put(batch, parallel.batch_sharding(mesh))
    new_params, loss = jax.jit(step)(sharded, b)
  assert new_params["layers"]["q"].sharding.is_equivalent_to(
      shardings["layers"]["q"], 4)
  assert len(new_params["layers"]["q"].sharding.device_set) == 8
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  for a, r in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5)
