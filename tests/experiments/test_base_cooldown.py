"""The cool-down sweep end to end on smoke runs: each cooled base is exactly
the run its config trains from scratch, the report covers every start, and
a start without a checkpoint is one line."""

import json
import os
import subprocess
import sys

from conftest import ROOT, pretrain_smoke_command

# A warm-up shorter than the first start, so that both schedules share it.
_SHARED = ["--config.optim.warmup_steps=1"]


def test_cooled_base_equals_the_run_its_config_trains(tmp_path, data_dir,
                                                      cached_env):
  out = tmp_path / "sweep"
  env = dict(cached_env, PYTHONPATH=ROOT)

  def sweep(starts):
    return [sys.executable, f"{ROOT}/experiments/base_cooldown.py",
            f"--out={out}", f"--config={ROOT}/configs/pretrain.py:smoke",
            "--stable_steps=6", "--every=2", "--decay=2", f"--starts={starts}",
            "--", f"--config.data.data_dir={data_dir}", *_SHARED]

  result = subprocess.run(sweep("4,2"), capture_output=True,
                          text=True, timeout=300, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.load(open(out / "cooldown.json"))
  assert list(results) == ["2", "4"]
  assert set(results["4"]) == {"greedy", "sampled"}
  assert (out / "cooldown.png").stat().st_size > 0

  fresh = tmp_path / "fresh"
  result = subprocess.run(
      pretrain_smoke_command(fresh, data_dir)
      + _SHARED + ["--config.train.steps=6", "--config.optim.decay_steps=2"],
      capture_output=True, text=True, timeout=300, env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  cooled = json.load(open(out / "start_4" / "summary.json"))
  stable = json.load(open(out / "stable" / "summary.json"))
  want = json.load(open(fresh / "summary.json"))["params_sha256"]
  assert cooled["params_sha256"] == want
  # The stable run went on at the peak rate: a different model.
  assert stable["params_sha256"] != want


  # A start between checkpoints: one line, nothing cooled.
  result = subprocess.run(sweep("3"), capture_output=True,
                          text=True, timeout=300, env=env)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: --starts: {out}/stable has no checkpoint at step 3"
      " (one every --every=2 steps)")
  assert not os.path.exists(out / "start_3")
