"""The ablation script end to end on smoke runs: it trains the variants it
is given, evaluates every run on ``--eval_prompts`` test prompts and writes
the headroom-recovery report from those evaluations."""

import json
import os
import shutil
import subprocess
import sys

from conftest import ROOT


def test_ablation_writes_the_report(smoke_run, tmp_path, data_dir):
  base = tmp_path / "base"  # a copy: the evaluation adds a file to it
  shutil.copytree(smoke_run[0], base)
  teachers = ",".join(f"{d}={base}" for d in ("add", "chain", "instruct",
                                                "sort"))
  out = tmp_path / "ablation"
  result = subprocess.run(
      [sys.executable, f"{ROOT}/experiments/open_mopd_ablation.py",
       f"--base={base}", f"--teachers={teachers}", f"--out={out}",
       "--steps=2", "--variants=plain,all", "--jobs=2",
       "--config_variant=:smoke", "--eval_prompts=8", "--",
       f"--config.data.data_dir={data_dir}"],
      capture_output=True, text=True, timeout=300,
      # A script's own directory comes first on sys.path: point Python at
      # this checkout's package, not at whichever one is installed.
      env=dict(os.environ, PYTHONPATH=ROOT))
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.load(open(out / "ablation.json"))
  assert set(results) == {"plain", "all"}
  assert set(results["all"]) == {"greedy", "sampled"}
  assert "evaluation at step 2" in (out / "plain.log").read_text()
  saved = json.load(open(out / "all" / "config.json"))
  saved_plain = json.load(open(out / "plain" / "config.json"))
  assert saved["open_mopd"]["token_share"] and saved["open_mopd"][
      "gap_budget"] and saved["open_mopd"]["reward_refresh"]
  assert not saved_plain["open_mopd"]["token_share"]
  report = (out / "ablation.md").read_text()
  assert "| all |" in report and "eval_8.json" in report
  for run in (base, out / "plain", out / "all"):
    assert (run / "eval_8.json").exists(), run
