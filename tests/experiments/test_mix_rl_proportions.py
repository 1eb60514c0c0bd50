"""The Mix RL proportions sweep on smoke runs, and its mixtures by hand."""

import json

import pytest

from conftest import load_experiment, run_experiment


def test_mixtures_boost_one_domain_at_a_time():
  module = load_experiment("mix_rl_proportions")
  found = module.mixtures(3.0)
  assert found["uniform"] == (1.0, 1.0, 1.0, 1.0)
  assert found["boost_chain"] == (1.0, 3.0, 1.0, 1.0)
  assert list(module.mixtures(2.0, ("sort",))) == ["uniform", "boost_sort"]
  assert module.shares(found["boost_chain"])["chain"] == pytest.approx(0.5)


def test_sweep_writes_the_report(smoke_run, tmp_path, data_dir, cached_env):
  out = tmp_path / "proportions"
  result = run_experiment(
      "mix_rl_proportions.py", f"--base={smoke_run[0]}", f"--out={out}",
      "--variant=smoke",
      "--domains=",  # uniform only here: the boosts are mixtures() above
      "--eval_prompts=4", "--", f"data.data_dir={data_dir}", "train.steps=2",
      env=cached_env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  found = json.loads((out / "proportions.json").read_text())
  assert set(found) == {"uniform"}
  assert found["uniform"]["shares"]["sort"] == pytest.approx(0.25)
  assert set(found["uniform"]["accuracy"]["greedy"]) == {
      "add", "chain", "instruct", "sort", "reverse"}
  assert (out / "proportions.png").read_bytes()[:4] == b"\x89PNG"
  assert "| uniform |" in (out / "proportions.md").read_text()
  bad = run_experiment("mix_rl_proportions.py", f"--base={tmp_path / 'none'}",
                       f"--out={out}2")
  assert bad.returncode == 2 and "Traceback" not in bad.stderr
