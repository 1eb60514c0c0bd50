"""The real entry point on the smoke config: trains, checkpoints, evaluates,
writes metrics and a summary, and a re-run of the same command resumes
instead of restarting. The notebook in colabs/ runs on what it wrote. A
resume of another model, an init run with other token ids and a diverging
run stop with one line and exit code 2, damaging nothing."""

import dataclasses
import json
import os
import shutil
import subprocess

import pytest

from conftest import (ROOT, load_config, pretrain_smoke_args,
                      run_notebook, train_cli)
from mopd_jax import stages
from mopd_jax import runs
from mopd_jax.errors import CheckpointError
from mopd_jax.models.config import ModelConfig


def test_pretrain_smoke_writes_everything(smoke_run):
  run, _, first = smoke_run
  assert "evaluation at step 4" in first.stdout
  assert "evaluation at step 2" in first.stdout  # train.eval_every=2
  for domain in ("add", "chain", "instruct", "sort", "reverse"):
    assert domain in first.stdout
  assert sorted(os.listdir(run / "ckpt")) == ["2", "4"]
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 2 and all(l > 0 for l in losses)
  assert sum("eval/greedy/add/accuracy" in r for r in records) == 2
  assert os.listdir(run / "tb")
  result = json.load(open(run / "eval.json"))
  assert 0.0 <= result["eval/sampled/reverse/accuracy"] <= 1.0


def _copy_of(smoke_run, tmp_path, data_dir):
  """A copy of the shared smoke run (which tests only read) and its
  command's flags with the copy as workdir."""
  run = tmp_path / "run"
  shutil.copytree(smoke_run[0], run)
  return run, pretrain_smoke_args(run, data_dir)


def test_rerun_resumes_from_latest_checkpoint(smoke_run, tmp_path, data_dir):
  run, args = _copy_of(smoke_run, tmp_path, data_dir)
  second = train_cli(*args)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resuming from step 4" in second.stdout
  assert sorted(os.listdir(run / "ckpt")) == ["2", "4"]


def test_colab_notebook_runs_on_the_workdir(smoke_run, monkeypatch):
  monkeypatch.setattr("matplotlib.pyplot.show", lambda: None)
  scope = run_notebook("inspect_run.ipynb", smoke_run[0])
  assert len(scope["train"]) == 2 and len(scope["evals"]) == 2
  assert ("greedy", "add") in scope["series"]


def _one_line_error(result) -> str:
  assert result.returncode == 2, result.stderr[-3000:]
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, result.stderr
  return lines[0]


def _snapshot(directory) -> dict:
  return {os.path.relpath(os.path.join(d, f), directory):
          open(os.path.join(d, f), "rb").read()
          for d, _, names in os.walk(directory) for f in names}


def test_resuming_with_another_model_is_refused(smoke_run, tmp_path,
                                                data_dir, cached_env):
  run, args = _copy_of(smoke_run, tmp_path, data_dir)
  before = _snapshot(run)
  result = train_cli(*args, "--config.model.embed_dim=64", env=cached_env)
  line = _one_line_error(result)
  assert line.startswith("error: model.embed_dim:") and "32" in line, line
  assert _snapshot(run) == before  # config.json and checkpoints untouched


def test_resuming_with_other_hyperparameters_is_refused(smoke_run, tmp_path,
                                                        data_dir, cached_env):
  """Only how long, how often and where may change on resume; other
  settings would leave a config.json describing a run that never ran."""
  run, args = _copy_of(smoke_run, tmp_path, data_dir)
  before = _snapshot(run)
  result = train_cli(*args, "--config.optim.weight_decay=0.5",
                     "--config.seed=3", env=cached_env)
  line = _one_line_error(result)
  assert line == (f"error: {run} holds a run configured"
                  " otherwise: optim.weight_decay (0.01 -> 0.5), seed (0 ->"
                  " 3); resume with the same settings or use a new workdir")
  assert _snapshot(run) == before
  # How long a run trains, and its cadence, may change.
  config = load_config("pretrain", "smoke")
  config.data.data_dir = json.load(open(run / "config.json"))["data"][
      "data_dir"]
  config.train.update(steps=6, log_every=3)
  config.checkpoint.every = 3
  runs.check_resumable(stages.validate(config), str(run))
  # A config.json written before a model field existed reads it at its
  # default, as ModelConfig.of does: it resumes.
  saved = json.load(open(run / "config.json"))
  del saved["model"]["max_positions"]
  (run / "config.json").write_text(json.dumps(saved))
  runs.check_resumable(stages.validate(config), str(run))
  saved["model"]["max_positions"] = 64
  (run / "config.json").write_text(json.dumps(saved))
  with pytest.raises(CheckpointError, match="model.max_positions"):
    runs.check_resumable(stages.validate(config), str(run))


def test_checkpoints_without_config_json_are_refused_untouched(
    smoke_run, tmp_path, data_dir, cached_env):
  """A GRPO command on checkpoints that lost their config.json: refused
  before it writes a config.json of its own (which would then lock the
  original command out)."""
  run, _ = _copy_of(smoke_run, tmp_path, data_dir)
  os.remove(run / "config.json")
  before = _snapshot(run)
  result = train_cli(f"--config={ROOT}/configs/grpo.py:smoke",
                     f"--workdir={run}", f"--config.init={smoke_run[0]}",
                     env=cached_env)
  line = _one_line_error(result)
  assert line == (f"error: {run} holds checkpoints but no config.json, so"
                  " they cannot be checked against this run; use a new"
                  " workdir")
  assert _snapshot(run) == before


@pytest.mark.parametrize("change, needle", [
    ({"model": {"vocab_size": 100}}, "init: {init} has a vocabulary of 100"),
    ({"tokenizer": "char:0123456789abcdef"}, "init: {init} was trained with"
     " another tokenizer"),
    ({"model": {"n_experts": 4}}, "{init}/config.json: model.n_experts:"
     " unknown field"),
    ({"tokenizer": ""}, "init: {init} records no tokenizer")])
def test_init_run_with_other_token_ids_is_refused(smoke_run, tmp_path,
                                                  cached_env, change, needle):
  init = tmp_path / "init"
  shutil.copytree(smoke_run[0], init)
  saved = json.load(open(init / "config.json"))
  for key, value in change.items():
    saved[key] = dict(saved[key], **value) if isinstance(value, dict) else (
        value)
  (init / "config.json").write_text(json.dumps(saved))
  result = train_cli(f"--config={ROOT}/configs/grpo.py:smoke",
                     f"--workdir={tmp_path / 'w'}", f"--config.init={init}",
                     env=cached_env)
  line = _one_line_error(result)
  assert line.startswith("error: " + needle.format(init=init)), line


def test_diverging_run_stops_with_exit_2(tmp_path, data_dir, cached_env):
  """A learning rate of 1e30: after one real update the next update itself
  is not finite and is skipped (the parameters never hold it), and two in
  a row stop the run."""
  run = tmp_path / "run"
  result = train_cli(*pretrain_smoke_args(run, data_dir),
                     "--config.optim.learning_rate=1e30",
                     "--config.train.max_consecutive_skips=2",
                     "--config.train.log_every=1",
                     "--config.train.eval_every=0", env=cached_env)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  line = result.stderr.strip().splitlines()[-1]  # after the progress bar
  assert line.startswith("error: step 3: the update was skipped 2 steps in a"
                         " row") and "checkpoint of step 2 is intact" in line
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert [r["skipped_updates"] for r in records] == [0.0, 1.0, 1.0]
  assert sorted(os.listdir(run / "ckpt")) == ["1", "2"]
  assert not os.path.exists(run / "summary.json")


@pytest.mark.parametrize("field, value, kind", [
    ("embed_dim", "32", "int"), ("rope_theta", "1e4", "float"),
    ("num_layers", True, "int"), ("qk_norm", 1, "bool"),
    ("dtype", 16, "str")])
def test_init_config_with_a_wrongly_typed_model_field_is_one_line(
    tmp_path, field, value, kind):
  saved = {"model": dict(dataclasses.asdict(ModelConfig()), **{field: value})}
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(CheckpointError) as error:
    runs.load_run_config(str(tmp_path))
  assert str(error.value) == (f"{tmp_path}/config.json: model.{field}:"
                              f" expected {kind}, got {value!r}")


def test_every_default_model_field_has_its_type(tmp_path):
  model = dict(dataclasses.asdict(ModelConfig()), rope_theta=10000)
  (tmp_path / "config.json").write_text(json.dumps({"model": model}))
  # an int where a float is due is still a number
  assert runs.load_run_config(str(tmp_path)).model.to_dict() == model


def test_a_failed_save_is_one_line_and_exits_promptly(tmp_path, data_dir,
                                                       cached_env):
  """A checkpoint folder nothing can be written into (immutable): the run
  ends with one line and exit code 2 instead of hanging on Orbax's threads,
  and leaves the folder empty."""
  run = tmp_path / "run"
  (run / "ckpt").mkdir(parents=True)
  if subprocess.run(["chattr", "+i", str(run / "ckpt")],
                    capture_output=True).returncode:
    pytest.skip("chattr +i is not available here")
  try:
    result = train_cli(*pretrain_smoke_args(run, data_dir), env=cached_env,
                       timeout=120)
  finally:
    subprocess.run(["chattr", "-i", str(run / "ckpt")], check=True)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith(f"error: {run}/ckpt: a checkpoint save failed by"
                         " step ") and line.endswith(
                             "no checkpoint was written; free space or fix"
                             " the permissions, then run the same command")
  assert os.listdir(run / "ckpt") == []
