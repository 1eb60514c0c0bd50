"""The shared step loop: checkpoints every N, keeps K, resumes exactly; the
guarded update skips non-finite steps, and too many in a row stop the run."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from mopd_jax import training
from mopd_jax.checkpointing import Checkpointer
from mopd_jax.errors import DivergenceError
from mopd_jax.checksum import tree_checksum
from mopd_jax.metrics import read_metrics, truncate_after


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


def _without_timings(workdir):
  return [{k: v for k, v in r.items() if k != "steps_per_sec"}
          for r in read_metrics(str(workdir))]


def test_resume_continues_exactly(tmp_path):
  ckpt, train = _settings()
  train.log_every = 3  # a logging window that spans a checkpoint
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
  # The window of step 6 holds steps 4-6 as if never interrupted.
  assert _without_timings(tmp_path / "b") == _without_timings(tmp_path / "a")
  summary = json.load(open(tmp_path / "a" / training.SUMMARY_FILE))
  assert json.load(open(tmp_path / "b" / training.SUMMARY_FILE)) == summary
  assert summary["step"] == 7 and summary["params_sha256"] == (
      tree_checksum(straight["params"]))
  # A finished run re-run with the same command does no more steps.
  again = training.run_loop(str(tmp_path / "b"), init, _step, 7, ckpt, train)
  np.testing.assert_array_equal(again["params"]["x"], straight["params"]["x"])
  assert _without_timings(tmp_path / "b") == _without_timings(tmp_path / "a")


def test_resume_drops_records_past_the_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s, "loss": 1.0}) for s in (2, 4, 4, 6)]
  path.write_text("\n".join(lines) + '\n{"step": 8, "lo')  # cut by a kill
  truncate_after(str(tmp_path), 4)
  assert path.read_text().splitlines() == lines[:3]
  assert os.listdir(tmp_path) == ["metrics.jsonl"]


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


def test_guarded_update_skips_non_finite_loss_or_gradients():
  optimizer = optax.adam(0.1)
  params = {"w": jnp.ones(3)}
  opt_state = optimizer.init(params)
  update = jax.jit(functools.partial(training.guarded_update, optimizer))
  nan_grad = {"w": jnp.array([1.0, np.nan, 0.0])}
  for loss, grads in [(jnp.float32(1.0), nan_grad),
                      (jnp.float32(np.inf), {"w": jnp.ones(3)})]:
    new_params, new_opt_state, skipped = update(loss, grads, params,
                                                opt_state)
    assert float(skipped) == 1.0
    for new, old in zip(jax.tree.leaves((new_params, new_opt_state)),
                        jax.tree.leaves((params, opt_state))):
      np.testing.assert_array_equal(new, old)
  new_params, _, skipped = update(jnp.float32(1.0), {"w": jnp.ones(3)},
                                  params, opt_state)
  assert float(skipped) == 0.0
  np.testing.assert_allclose(new_params["w"], 0.9, rtol=1e-5)  # Adam eps


def test_guarded_update_skips_a_finite_gradient_turned_non_finite():
  """A learning rate that overflows the update (inf x 1): finite loss and
  gradient, non-finite update; skipped, nothing changed."""
  optimizer = optax.sgd(np.float32(np.inf))
  params = {"w": jnp.ones(3)}
  opt_state = optimizer.init(params)
  new_params, _, skipped = jax.jit(functools.partial(
      training.guarded_update, optimizer))(jnp.float32(1.0),
                                           {"w": jnp.ones(3)}, params,
                                           opt_state)
  assert float(skipped) == 1.0
  np.testing.assert_array_equal(new_params["w"], np.ones(3))


def _sgd_step(bad_steps):
  """SGD on ``x`` with gradient 1, and a NaN loss and gradient on
  ``bad_steps``, through the guarded update."""
  optimizer = optax.sgd(0.5)

  def step_fn(state, step):
    loss = jnp.float32(np.nan if step in bad_steps else 1.0)
    grads = {"x": jnp.ones(2) * loss}
    params, opt_state, skipped = training.guarded_update(
        optimizer, loss, grads, state["params"], state["opt_state"])
    return dict(params=params, opt_state=opt_state, step=state["step"] + 1), {
        "loss": (loss, 1.0), training.SKIPPED: (skipped, 1.0)}

  params = {"x": jnp.zeros(2)}
  return step_fn, dict(params=params, opt_state=optimizer.init(params),
                       step=jnp.zeros((), jnp.int32))


def test_a_transient_non_finite_step_is_skipped_and_counted(tmp_path):
  ckpt, train = _settings()
  step_fn, init = _sgd_step(bad_steps={1})
  final = training.run_loop(str(tmp_path), init, step_fn, 4, ckpt, train)
  np.testing.assert_array_equal(final["params"]["x"], -1.5)  # 3 updates
  records = read_metrics(str(tmp_path))
  assert [r["skipped_updates"] for r in records] == [0.0, 1.0, 0.0, 0.0]
  assert records[-1]["skipped_steps"] == 1.0
  summary = json.load(open(tmp_path / training.SUMMARY_FILE))
  assert summary["metrics"]["skipped_steps"] == 1.0


def test_consecutive_skips_stop_the_run_and_keep_the_last_checkpoint(
    tmp_path):
  ckpt, train = _settings()  # max_consecutive_skips=3, a checkpoint every 2
  step_fn, init = _sgd_step(bad_steps=set(range(3, 100)))
  with pytest.raises(DivergenceError, match=r"^step 6: the update was skipped"
                     r" 3 steps in a row .* checkpoint of step 4 is intact"):
    training.run_loop(str(tmp_path), init, step_fn, 10, ckpt, train)
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]
  assert read_metrics(str(tmp_path))[-1]["step"] == 6
  restored = Checkpointer(str(tmp_path), 2, 2)
  step, state, _ = restored.restore_latest(init)
  restored.close()
  assert step == 4
  np.testing.assert_array_equal(state["params"]["x"], -1.5)  # 3 good steps


def test_a_summary_without_a_step_loop(tmp_path):
  summary = training.write_summary(str(tmp_path), 0, {"w": jnp.ones(2)})
  assert summary["metrics"] == {} and summary == json.load(
      open(tmp_path / training.SUMMARY_FILE))


def test_stop_fn_ends_the_run_at_its_evaluation_and_a_rerun_stays(tmp_path):
  ckpt, train = _settings(every=10)
  train.eval_every = 2
  init = dict(params=dict(x=jnp.arange(2.0)), step=jnp.zeros((), jnp.int32))
  seen = []

  def eval_fn(state, step):
    seen.append(step)
    return {"x0": float(state["params"]["x"][0])}

  def on_eval(state, step, scalars):  # x0 after k steps: 0, 0, 1, 3.5, ..
    return state, ({"step": step} if scalars["x0"] > 5 else None)

  final = training.run_loop(str(tmp_path), init, _step, 100, ckpt, train,
                            eval_fn, on_eval=on_eval)
  assert seen == [2, 4]  # x0 = 1 at step 2, 8.25 at step 4
  assert int(final["step"]) == 4
  assert max(int(s) for s in os.listdir(tmp_path / "ckpt")) == 4  # every=10
  summary = json.load(open(tmp_path / training.SUMMARY_FILE))
  assert summary["step"] == 4 and summary["stopped"] == {"step": 4}
  assert summary["params_sha256"] == tree_checksum(final["params"])
  # A re-run restores the stopped step and trains no further.
  again = training.run_loop(str(tmp_path), init, _step, 100, ckpt, train,
                            eval_fn, on_eval=on_eval)
  assert seen == [2, 4] and int(again["step"]) == 4
  assert json.load(open(tmp_path / training.SUMMARY_FILE)) == summary
