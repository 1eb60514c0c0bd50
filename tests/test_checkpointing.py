"""Checkpoints: loading an earlier run's parameters (exact values, clear
errors); a corrupt latest step falls back to the previous one with one
warning line; half-written or failed saves never replace or remove a good
checkpoint; a state of another shape is an error, not a fallback."""

import os

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


def _state(value: float, size: int = 3):
  return dict(params=dict(w=jnp.full((size,), value)), step=jnp.int32(value))


def _files(directory):
  return [os.path.join(d, f) for d, _, names in os.walk(directory)
          for f in names]


def _garble(path):
  with open(path, "wb") as f:
    f.write(b"\x00garbage\xff")


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage", [_garble, _truncate])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous(
    tmp_path, capfd, damage):
  ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, _state(float(step)), loop={"at": step})
  ckpt.close()
  for path in _files(tmp_path / "ckpt" / "3"):
    damage(path)
  capfd.readouterr()

  # Another run's parameters (init, teacher, evaluation): no silent
  # fallback to an earlier step; one error naming the run, nothing moved.
  with pytest.raises(CheckpointError, match=r"its final checkpoint \(step 3\)"
                     r" is unreadable .*; re-run that run to repair it"):
    load_params(str(tmp_path), _state(0.0)["params"])
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2", "3"]

  ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
  step, state, loop = ckpt.restore_latest(_state(0.0))
  assert (step, loop) == (2, {"at": 2})
  np.testing.assert_array_equal(state["params"]["w"], 2.0)
  (line,) = capfd.readouterr().err.strip().splitlines()
  assert line.startswith("warning: checkpoint of step 3") and "unreadable" in (
      line)
  # Set aside for inspection, so that step 3 can be written again.
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]
  assert len(os.listdir(tmp_path / "ckpt_corrupt")) == 1
  ckpt.save(3, _state(3.0), force=True)
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2", "3"]


def _flip_middle_byte(path):
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("damage", [_flip_middle_byte, _truncate, os.remove])
def test_damaged_array_data_alone_is_caught(tmp_path, capfd, damage):
  """Only the array files of the newest step damaged (its metadata
  intact): a read error, or for a flipped bit possibly parameters that
  decode but differ, which the recorded checksum catches."""
  def state(step):
    w = np.random.default_rng(step).normal(size=4096).astype(np.float32)
    return dict(params=dict(w=jnp.asarray(w)), step=jnp.int32(step))

  ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
  for step in (1, 2):
    ckpt.save(step, state(step), loop={"at": step})
  ckpt.close()
  data = [f for f in _files(tmp_path / "ckpt" / "2" / "default")
          if os.sep + "d" + os.sep in f]
  assert data
  for path in data:
    damage(path)
  capfd.readouterr()
  with pytest.raises(CheckpointError, match="final checkpoint"):
    load_params(str(tmp_path), state(0)["params"])
  ckpt = Checkpointer(str(tmp_path), every=1, keep=3)
  step, restored, _ = ckpt.restore_latest(state(0))
  ckpt.close()
  assert step == 1
  np.testing.assert_array_equal(restored["params"]["w"],
                                state(1)["params"]["w"])
  assert "warning: checkpoint of step 2" in capfd.readouterr().err


def test_half_written_checkpoints_are_never_restored(tmp_path):
  ckpt = Checkpointer(str(tmp_path), every=1, keep=2)
  ckpt.save(2, _state(2.0))
  ckpt.close()
  # What a save killed before its rename leaves behind.
  partial = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp-1234" / "default"
  partial.mkdir(parents=True)
  (partial / "manifest.ocdbt").write_bytes(b"\x00")
  ckpt = Checkpointer(str(tmp_path), every=1, keep=2)
  step, state, _ = ckpt.restore_latest(_state(0.0))
  assert step == 2 and float(state["step"]) == 2
  ckpt.save(4, _state(4.0))  # after Orbax's clean-up of the leftovers
  ckpt.close()
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]


def test_resuming_with_another_state_shape_is_an_error(tmp_path):
  ckpt = Checkpointer(str(tmp_path), every=1, keep=2)
  ckpt.save(2, _state(2.0))
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path), every=1, keep=2)
  with pytest.raises(CheckpointError, match=r"params/w is shape \(3,\) in the"
                     r" checkpoint of step 2, expected shape \(4,\)"):
    ckpt.restore_latest(_state(0.0, size=4))
  with pytest.raises(CheckpointError, match="step is in the checkpoint of"
                     " step 2 but not in this run's state"):
    ckpt.restore_latest(dict(params=_state(0.0)["params"]))
  ckpt.close()
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing set aside


def test_a_failed_save_never_costs_the_last_good_checkpoint(tmp_path):
  ckpt = Checkpointer(str(tmp_path), every=1, keep=1)
  ckpt.save(2, _state(2.0))
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path), every=1, keep=1)
  # keep=1 would delete step 2 once step 4 is complete; the save of step 4
  # fails in the background (a set is not JSON), so it never is.
  ckpt.save(4, _state(4.0), loop={"bad": {1, 2}})
  with pytest.raises(CheckpointError, match=(
      "a checkpoint save failed .TypeError.*; the checkpoint of step 2 is"
      " intact")):
    ckpt.close()
  ckpt = Checkpointer(str(tmp_path), every=1, keep=1)
  step, state, _ = ckpt.restore_latest(_state(0.0))
  assert step == 2 and float(state["step"]) == 2
  assert ckpt.all_steps() == [2]  # the temporary directory does not count
  ckpt.close()


def test_a_run_with_nan_parameters_is_refused_wherever_it_is_read(tmp_path,
                                                                 capsys):
  """A poisoned run (valid checkpoint, NaN in one leaf) is one error naming
  the parameter: as an init, a teacher or export (``load_params``) and as
  a merge's expert (``LeafLoader``), which warns of an unfinished one."""
  from mopd_jax import parallel, runs
  cfg = ModelConfig(vocab_size=16, embed_dim=8, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=4, mlp_dim=16)
  params = decoder.init_params(cfg, jax.random.key(0))
  params["final_norm"] = params["final_norm"] * float("nan")
  ckpt = Checkpointer(str(tmp_path), every=1, keep=1)
  ckpt.save(0, {"params": params}, force=True)
  ckpt.close()
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1,
                            devices=jax.devices()[:1])
  with pytest.raises(CheckpointError, match="parameter final_norm holds NaN"):
    runs.load_params(str(tmp_path), cfg, mesh)
  with pytest.raises(CheckpointError, match="final_norm holds NaN"):
    with runs.LeafLoader([str(tmp_path)], cfg, mesh) as load:
      load("final_norm")
  capsys.readouterr()
  with runs.LeafLoader([str(tmp_path)], cfg, mesh) as load:
    assert load("embed")[0].shape == (16, 8)
  # an unfinished expert (no summary.json) read by a merge is said once
  assert capsys.readouterr().err.count("has not finished") == 1
