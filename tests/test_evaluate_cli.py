"""``python -m mopd_jax.evaluate`` on a finished smoke run: with the run's
own evaluation size it reproduces the run's final ``eval.json`` exactly (the
same prompts, keys and parameters) plus pass@k that never falls with k, it
adds a file without touching the rest of the run, and a missing run is one
line with exit code 2."""

import json
import shutil
import subprocess
import sys

from conftest import ROOT


def _evaluate(*args, env):
  return subprocess.run([sys.executable, "-m", "mopd_jax.evaluate", *args],
                        capture_output=True, text=True, timeout=300, env=env,
                        cwd=ROOT)


def test_evaluate_reproduces_the_runs_final_evaluation(smoke_run, tmp_path,
                                                        cached_env):
  run = tmp_path / "run"
  shutil.copytree(smoke_run[0], run)
  before = sorted(p.relative_to(run) for p in run.rglob("*"))
  result = _evaluate(f"--run={run}", "--num_prompts=8", "--samples=4",
                     env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  ours = json.load(open(run / "eval_8.json"))
  theirs = json.load(open(run / "eval.json"))
  coverage = {k: ours.pop(k) for k in list(ours) if "/pass@" in k}
  assert ours.keys() == theirs.keys() and len(ours) == 1 + 5 * 2 * 3
  for key, value in theirs.items():
    assert abs(ours[key] - value) < 1e-9, key
  assert len(coverage) == 5 * 3  # k = 1, 2, 4 on every domain
  for domain in ("add", "chain", "instruct", "sort", "reverse"):
    by_k = [coverage[f"eval/pass@{k}/{domain}"] for k in (1, 2, 4)]
    assert 0 <= by_k[0] <= by_k[1] <= by_k[2] <= 1, (domain, by_k)
  after = sorted(p.relative_to(run) for p in run.rglob("*"))
  assert [str(p) for p in set(after) - set(before)] == ["eval_8.json"]


def test_evaluate_a_missing_run_is_one_line(tmp_path, cached_env):
  result = _evaluate(f"--run={tmp_path / 'nothing'}", env=cached_env)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and "not a mopd_jax run directory" in lines[0], lines
