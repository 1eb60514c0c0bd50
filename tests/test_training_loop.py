"""The shared step loop: checkpoints every N, keeps K, resumes exactly."""

import json
import os

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mopd_jax import training
from mopd_jax.metrics import read_metrics


def _settings(every=2, keep=2):
  return (ml_collections.ConfigDict(dict(every=every, keep=keep)),
          ml_collections.ConfigDict(dict(log_every=1, eval_every=0,
                                         max_consecutive_skips=3)))


def _step(state, step):
  """A deterministic 'training step' that depends on the step number."""
  x = state["params"]["x"] * 1.5 + step
  return dict(params=dict(x=x), step=state["step"] + 1), {
      "loss": (jnp.sum(x), 2.0)}


class Crash(Exception):
  pass


def test_resume_continues_exactly(tmp_path):
  ckpt, train = _settings()
  init = dict(params=dict(x=jnp.arange(2.0)),
              step=jnp.zeros((), jnp.int32))
  straight = training.run_loop(str(tmp_path / "a"), init, _step, 7, ckpt,
                               train)

  def crashing(state, step):
    if step == 5:
      raise Crash()
    return _step(state, step)

  with pytest.raises(Crash):
    training.run_loop(str(tmp_path / "b"), init, crashing, 7, ckpt, train)
  assert sorted(os.listdir(tmp_path / "b" / "ckpt")) == ["2", "4"]  # keep=2
  resumed = training.run_loop(str(tmp_path / "b"), init, _step, 7, ckpt, train)
  np.testing.assert_array_equal(resumed["params"]["x"], straight["params"]["x"])
  assert int(resumed["step"]) == 7
  steps = [r["step"] for r in read_metrics(str(tmp_path / "b"))]
  assert steps[-3:] == [5, 6, 7]
  # A finished run re-run with the same command does no more steps.
  again = training.run_loop(str(tmp_path / "b"), init, _step, 7, ckpt, train)
  np.testing.assert_array_equal(again["params"]["x"], straight["params"]["x"])


def test_logged_loss_is_sum_over_count(tmp_path):
  ckpt, train = _settings(every=10)
  init = dict(params=dict(x=jnp.array([1.0, 3.0])),
              step=jnp.zeros((), jnp.int32))
  training.run_loop(str(tmp_path), init, _step, 1, ckpt, train)
  (record,) = read_metrics(str(tmp_path))
  assert record["loss"] == pytest.approx((1.5 + 4.5) / 2.0)


def test_write_json_atomic_leaves_no_temp(tmp_path):
  path = str(tmp_path / "r.json")
  training.write_json_atomic(path, {"a": 1})
  assert json.load(open(path)) == {"a": 1}
  assert os.listdir(tmp_path) == ["r.json"]
