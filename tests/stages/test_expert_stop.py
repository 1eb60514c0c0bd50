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


def _expert(data_dir, smoke_run, steps, confirm=0):
  config = load_config("grpo", "smoke")
  config.update(init=str(smoke_run[0]))
  config.data.data_dir = data_dir
  config.train.update(steps=steps, eval_every=2)
  config.stop.update(gain=0.25, num_prompts=8, confirm_prompts=confirm)
  return stages.validate(config)


def _scripted(by_draw):
  """``validation_accuracy`` reading ``by_draw[prefix][k]`` at the k-th
  evaluation of that draw (the last value from then on)."""
  seen = {prefix: [] for prefix in by_draw}

  def scripted(scalars, domain, prefix="validation"):
    assert domain == "add" and f"{prefix}/greedy/add/accuracy" in scalars
    evaluations = seen[prefix]
    if not any(s is scalars for s in evaluations):
      evaluations.append(scalars)
    i = next(i for i, s in enumerate(evaluations) if s is scalars)
    return by_draw[prefix][min(i, len(by_draw[prefix]) - 1)]

  return scripted


def test_expert_stops_at_the_first_evaluation_gaining_the_target(
    tmp_path, data_dir, smoke_run, monkeypatch, capsys):
  """The real stage on the smoke base, validation accuracy scripted: the
  start (step 0) at 0.1, then 0.3 at step 2 and 0.4 (+0.3) at step 4 of 6.
  (Never reached, the run ends at its last step: test_rl's CLI test.)"""
  monkeypatch.setattr(expert_stop, "validation_accuracy",
                      _scripted({"validation": [0.1, 0.3, 0.4]}))
  stages.run(_expert(data_dir, smoke_run, 6), str(tmp_path))
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["step"] == 4 and summary["stopped"]["step"] == 4
  assert summary["stopped"]["validation_greedy_start"] == 0.1
  assert "expert add stopped at step 4" in capsys.readouterr().out
  assert json.loads((tmp_path / "eval.json").read_text())["step"] == 4
  assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir())[-1] == 4


def test_a_gain_the_second_draw_does_not_confirm_trains_on(
    tmp_path, data_dir, smoke_run, monkeypatch, capsys):
  """The winner's curse guarded: the first draw gains +0.3 at step 2, the
  second (its own 8 prompts, looked at only then) only +0.1, so training
  goes on; at step 4 both have gained, and the run stops there."""
  monkeypatch.setattr(expert_stop, "validation_accuracy", _scripted({
      "validation": [0.1, 0.4, 0.45],
      expert_stop.CONFIRM: [0.2, 0.3, 0.5]}))
  stages.run(_expert(data_dir, smoke_run, 6, confirm=8), str(tmp_path))
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["step"] == 4 and summary["stopped"]["step"] == 4
  assert (summary["stopped"]["validation_confirm_greedy"],
          summary["stopped"]["validation_confirm_greedy_start"]) == (0.5, 0.2)
  assert "confirmed on 8 other validation prompts (+0.300)" in (
      capsys.readouterr().out)


def test_the_two_draws_must_fit_the_validation_split():
  config = load_config("grpo")
  config.init = "runs/base"
  config.stop.update(num_prompts=200, confirm_prompts=100)
  with pytest.raises(ConfigError, match="stop.confirm_prompts: the two"):
    stages.validate(config)
  config.stop.confirm_prompts = 0
  stages.validate(config)


def test_stop_needs_evaluations():
  config = load_config("grpo")
  config.init = "runs/base"
  config.stop.gain = 0.2
  config.train.eval_every = 0
  with pytest.raises(ConfigError, match="train.eval_every: stop.gain"):
    stages.validate(config)
