"""The base stops by measurement: at the first validation evaluation where
every training domain reaches ``select.target``; a target never reached is
one line and exit code 2."""

import json

import numpy as np
import pytest

from conftest import load_config, train_cli
from mopd_jax import stages
from mopd_jax.errors import ConfigError
from mopd_jax.stages import pretrain


def test_selection_needs_every_domain_at_the_target():
  select = load_config("pretrain").select  # target 0.25, ceiling 0.6
  assert pretrain.selection(50, {"add": 0.24, "sort": 0.9}, select) is None
  record = pretrain.selection(75, {"add": 0.25, "sort": 0.7}, select)
  assert record["step"] == 75 and record["above_ceiling"] == ["sort"]
  assert record["validation_greedy"] == {"add": 0.25, "sort": 0.7}
  line = pretrain.target_missed(2000, {"add": 0.1, "sort": 0.7}, select)
  assert "add 0.100" in line and "sort" not in line.split("(")[1]


def test_held_weights_scale_the_held_domains_and_renormalise():
  w = pretrain.held_weights(np.array([0.4, 0.4, 0.2]), np.array([0, 1, 0]),
                            0.1)
  np.testing.assert_allclose(w, np.array([0.4, 0.04, 0.2]) / 0.64)


def test_validation_accuracy_reads_only_greedy_accuracy():
  scalars = {"validation/greedy/add/accuracy": 0.5,
             "validation/greedy/add/length": 3.0,
             "eval/greedy/sort/accuracy": 0.1}
  assert pretrain.validation_accuracy(scalars) == {"add": 0.5}


def test_stage_stops_at_the_first_evaluation_reaching_the_target(
    tmp_path, data_dir, monkeypatch, capsys):
  """The real stage on the smoke model, its validation accuracy scripted:
  short of the target at step 2 (sort above the ceiling, so held back),
  reached at step 4 of 8."""
  config = load_config("pretrain", "smoke")
  config.data.data_dir = data_dir
  config.train.update(steps=8, eval_every=2)
  config.select.update(target=0.5, ceiling=0.8)
  config = stages.validate(config)
  calls = []
  real = pretrain.validation_accuracy

  def scripted(scalars):
    found = real(scalars)
    assert set(found) == {"add", "chain", "instruct", "sort"}
    calls.append(found)
    if len(calls) > 2:
      return {d: 0.6 for d in found}
    return {d: 0.9 if d == "sort" else 0.4 for d in found}

  monkeypatch.setattr(pretrain, "validation_accuracy", scripted)
  pretrain.run(config, str(tmp_path))
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["step"] == 4 and summary["stopped"]["step"] == 4
  assert summary["stopped"]["validation_greedy"]["add"] == 0.6
  assert json.loads((tmp_path / "eval.json").read_text())["step"] == 4
  assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[-1] == "4"
  out = capsys.readouterr().out
  assert "step 2: above the ceiling, held at weight x0.1: sort" in out
  assert "base selected at step 4" in out


def test_target_never_reached_is_one_line_exit_2(tmp_path, data_dir):
  result = train_cli("--config=configs/pretrain.py:smoke",
                     f"--workdir={tmp_path}",
                     f"--config.data.data_dir={data_dir}",
                     "--config.select.target=0.5")
  assert result.returncode == 2
  assert "Traceback" not in result.stderr
  # library chatter (absl warnings of TFDS) stays off stderr
  assert "Using custom data configuration" not in result.stderr
  assert result.stderr.strip().splitlines()[-1:] == [
      "error: select.target: 0.5 not reached by step 4 (greedy validation"
      " accuracy add 0.000, chain 0.000, instruct 0.000, sort 0.000); raise"
      " train.steps to train on, or lower the target"]
  assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("override, field", [
    ("--config.optim.end_lr_fraction=0.1", "optim.end_lr_fraction"),
    ("--config.train.eval_every=0", "train.eval_every"),
    ("--config.select.ceiling=0.1", "select.ceiling"),
])
def test_selection_config_checks(override, field):
  config = load_config("pretrain")
  key, value = override[len("--config."):].split("=")
  section, name = key.split(".")
  config[section][name] = type(config[section][name])(value)
  with pytest.raises(ConfigError, match=field):
    stages.validate(config)
