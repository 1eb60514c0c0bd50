"""The ablation script end to end on smoke runs: it trains the variants it
is given and writes the headroom-recovery report."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def test_ablation_writes_the_report(smoke_run, tmp_path, data_dir):
  base = smoke_run[0]
  teachers = ",".join(f"{d}={base}" for d in ("add", "chain", "instruct",
                                                "sort"))
  out = tmp_path / "ablation"
  result = subprocess.run(
      [sys.executable, f"{ROOT}/experiments/open_mopd_ablation.py",
       f"--base={base}", f"--teachers={teachers}", f"--out={out}",
       "--steps=2", "--variants=plain,all", "--jobs=2", "--config_variant=:smoke", "--",
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
  assert "| all |" in (out / "ablation.md").read_text()
