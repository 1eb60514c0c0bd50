"""An expert stops by measurement: at the first validation evaluation where
its domain gained ``stop.gain`` over the start; never reached, it ends at
``train.steps`` as the expert, without an error."""

import json

import pytest

from conftest import load_config
from mopd_jax import stages
from mopd_jax.errors import ConfigError
from mopd_jax.stages import expert_stop


def test_gain_record_needs_the_gain_over_the_start():
  stop = load_config("grpo").stop
  stop.gain = 0.2
  assert expert_stop.gain_record(50, 0.59, 0.4, stop) is None
  record = expert_stop.gain_record(75, 0.6, 0.4, stop)
  assert record["step"] == 75 and record["gain"] == 0.2
  assert (record["validation_greedy"], record["validation_greedy_start"]) == (
      0.6, 0.4)
  assert "+0.200 >= 0.2" in record["reason"]


def test_validation_accuracy_reads_the_domains_greedy_accuracy():
  scalars = {"validation/greedy/add/accuracy": 0.5,
             "validation/greedy/add/length": 3.0,
             "eval/greedy/add/accuracy": 0.1}
  assert expert_stop.validation_accuracy(scalars, "add") == 0.5


def _expert(data_dir, smoke_run, steps):
  config = load_config("grpo", "smoke")
  config.update(init=str(smoke_run[0]))
  config.data.data_dir = data_dir
  config.train.steps = steps
  config.stop.update(gain=0.25, num_prompts=8)
  return stages.validate(config)


def test_expert_stops_at_the_first_evaluation_gaining_the_target(
    tmp_path, data_dir, smoke_run, monkeypatch, capsys):
  """The real stage on the smoke base, validation accuracy scripted: the
  start (step 0) at 0.1, then 0.3 at step 2 and 0.4 (+0.3) at step 4 of 6.
  (Never reached, the run ends at its last step: test_rl's CLI test.)"""
  evaluations = []  # each evaluation's scalars, read more than once

  def scripted(scalars, domain):
    assert domain == "add" and "validation/greedy/add/accuracy" in scalars
    if not any(s is scalars for s in evaluations):
      evaluations.append(scalars)
    i = next(i for i, s in enumerate(evaluations) if s is scalars)
    return {0: 0.1, 1: 0.3}.get(i, 0.4)

  monkeypatch.setattr(expert_stop, "validation_accuracy", scripted)
  stages.run(_expert(data_dir, smoke_run, 6), str(tmp_path))
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["step"] == 4 and summary["stopped"]["step"] == 4
  assert summary["stopped"]["validation_greedy_start"] == 0.1
  assert "expert add stopped at step 4" in capsys.readouterr().out
  assert json.loads((tmp_path / "eval.json").read_text())["step"] == 4
  assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir())[-1] == 4


def test_stop_needs_evaluations():
  config = load_config("grpo")
  config.init = "runs/base"
  config.stop.gain = 0.2
  config.train.eval_every = 0
  with pytest.raises(ConfigError, match="train.eval_every: stop.gain"):
    stages.validate(config)
