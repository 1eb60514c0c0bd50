"""The real entry point on the smoke config: trains, checkpoints, evaluates,
writes metrics, and a re-run of the same command resumes instead of restarting."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pretrain_smoke_runs_and_resumes(tmp_path, data_dir):
  cmd = [sys.executable, "-m", "mopd_jax.train",
         f"--config={ROOT}/configs/pretrain.py:smoke",
         f"--workdir={tmp_path / 'run'}", f"--config.data.data_dir={data_dir}"]
  first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-2000:]
  assert "evaluation at step 6" in first.stdout
  for domain in ("add", "chain", "instruct", "sort", "reverse"):
    assert domain in first.stdout
  run = tmp_path / "run"
  assert sorted(os.listdir(run / "ckpt")) == ["3", "6"]
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 3 and all(l > 0 for l in losses)
  assert any("eval/greedy/add/accuracy" in r for r in records)
  assert os.listdir(run / "tb")
  result = json.load(open(run / "eval.json"))
  assert 0.0 <= result["eval/sampled/reverse/accuracy"] <= 1.0

  second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resuming from step 6" in second.stdout
  assert sorted(os.listdir(run / "ckpt")) == ["3", "6"]
