"""The ablation script end to end on smoke runs: it trains the variants it
is given with every seed, evaluates every run on ``--eval_prompts`` test
prompts and writes the headroom-recovery report (table, JSON and plot)
from those evaluations;
and its average over seeds against numpy."""

import json
import os
import shutil

import numpy as np

from conftest import ROOT, load_experiment, run_experiment


def test_over_seeds_averages_each_cell():
  rng = np.random.default_rng(0)
  reports = [{mode: {"add": float(rng.normal()), "sort": float(rng.normal()),
                     "mean": float(rng.normal())}
              for mode in ("greedy", "sampled")} for _ in range(3)]
  got = load_experiment("open_mopd_ablation").over_seeds(reports)
  for mode in ("greedy", "sampled"):
    for key in ("add", "sort", "mean"):
      np.testing.assert_allclose(
          got[mode][key], np.mean([r[mode][key] for r in reports]))
    np.testing.assert_allclose(
        got[mode]["mean_std"], np.std([r[mode]["mean"] for r in reports]))


def test_ablation_writes_the_report(smoke_run, tmp_path, data_dir, cached_env):
  base = tmp_path / "base"  # a copy: the evaluation adds a file to it
  shutil.copytree(smoke_run[0], base)
  teachers = ",".join(f"{d}={base}" for d in ("add", "chain", "instruct",
                                                "sort"))
  out = tmp_path / "ablation"
  result = run_experiment(
      "open_mopd_ablation.py", f"--base={base}", f"--teachers={teachers}",
      f"--out={out}", "--steps=2", "--variants=all", "--seeds=0,3", "--jobs=2",
      "--config_variant=:smoke", "--eval_prompts=8", "--",
      f"--config.data.data_dir={data_dir}",
      # A script's own directory comes first on sys.path: point Python at
      # this checkout's package, not at whichever one is installed.
      env=dict(cached_env, PYTHONPATH=ROOT))
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.load(open(out / "ablation.json"))
  assert set(results) == {"all"}
  assert set(results["all"]) == {"greedy", "sampled", "per_seed"}
  assert set(results["all"]["per_seed"]) == {"0", "3"}
  assert "evaluation at step 2" in (out / "all.log").read_text()
  saved = json.load(open(out / "all" / "config.json"))
  assert saved["open_mopd"]["token_share"] and saved["open_mopd"][
      "gap_budget"] and saved["open_mopd"]["reward_refresh"]
  assert saved["seed"] == 0
  assert json.load(open(out / "all_seed3" / "config.json"))["seed"] == 3
  report = (out / "ablation.md").read_text()
  assert "| all |" in report and "eval_8.json" in report
  assert "sd of the mean over 2 seeds" in report
  assert (out / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  for run in (base, out / "all", out / "all_seed3"):
    assert (run / "eval_8.json").exists(), run


def _ablation(tmp_path, *args):
  return run_experiment("open_mopd_ablation.py", f"--base={tmp_path}/base",
                        f"--out={tmp_path}/out", *args, timeout=120,
                        env=dict(os.environ, PYTHONPATH=ROOT))


def test_bad_teachers_and_failed_runs_stop_with_exit_2(tmp_path):
  result = _ablation(tmp_path, "--teachers=runs/expert")
  assert result.returncode == 2
  assert result.stderr.count("\n") == 1 and "teachers" in result.stderr
  # Two runs one at a time: the first fails (its own one-line error, then
  # the ablation's), and the second is never started.
  result = _ablation(tmp_path, f"--teachers={tmp_path}/{{domain}}",
                     "--variants=plain,all", "--", "--config.no_such_field=1")
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert result.stderr.splitlines() == [
      "error: no_such_field: unknown field",
      f"error: {tmp_path}/out/plain: training failed (exit 2, error above)"]
  assert "== all" not in result.stdout
  # Two at a time: each run's output goes to its log, and the first failure
  # is the ablation's one line.
  result = _ablation(tmp_path, f"--teachers={tmp_path}/{{domain}}",
                     "--variants=plain,all", "--jobs=2", "--",
                     "--config.no_such_field=1")
  assert result.returncode == 2
  line, = result.stderr.splitlines()
  assert line.startswith(f"error: {tmp_path}/out/") and line.endswith(
      ".log)"), line
  assert "no_such_field: unknown field" in (
      tmp_path / "out" / "plain.log").read_text()
