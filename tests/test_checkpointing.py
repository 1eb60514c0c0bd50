"""Loading the parameters of an earlier run: exact values, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.checkpointing import Checkpointer, load_params
from mopd_jax.errors import CheckpointError
from mopd_jax.models import decoder
from mopd_jax.models.config import PRESETS, ModelConfig


def _save(workdir, params, step=3):
  ckpt = Checkpointer(str(workdir), every=1, keep=1)
  ckpt.save(step, dict(params=params, step=jnp.int32(step)), force=True)
  ckpt.close()


def test_load_params_round_trip(tmp_path):
  cfg = PRESETS["micro"]
  params = decoder.init_params(cfg, jax.random.key(1))
  _save(tmp_path, params)
  like = decoder.init_params(cfg, jax.random.key(2))
  loaded = load_params(str(tmp_path), like)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_incompatible_or_missing_checkpoints_are_named(tmp_path):
  cfg = PRESETS["micro"]
  _save(tmp_path, decoder.init_params(cfg, jax.random.key(1)))
  wider = ModelConfig(**{**cfg.__dict__, "mlp_dim": 2 * cfg.mlp_dim})
  with pytest.raises(CheckpointError, match=r"layers/down is shape"):
    load_params(str(tmp_path), decoder.init_params(wider, jax.random.key(0)))
  with pytest.raises(CheckpointError, match="no checkpoints"):
    load_params(str(tmp_path / "elsewhere"), {})
