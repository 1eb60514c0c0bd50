"""``python -m mopd_jax.evaluate`` on a finished smoke run: with the run's
own evaluation size it reproduces the run's final ``eval.json`` exactly (the
same prompts, keys and parameters) plus pass@k that never falls with k, it
adds a file without touching the rest of the run; an unfinished run is
evaluated at its newest checkpoint, named; bad input is one line with exit
code 2 before any work."""

import json
import os
import shutil

import pytest

from conftest import python_m
from mopd_jax import stages
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation.run_eval import evaluate_run

SETTINGS = stages.defaults("mix_rl")


def _evaluate(*args, env):
  return python_m("mopd_jax.evaluate", *args, env=env)


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
  # each prompt's outcome and correct-sample count, for a study's intervals
  outcomes, counts = ours.pop("outcomes"), ours.pop("coverage")
  assert set(outcomes) == {f"{m}/{d}" for m in ("greedy", "sampled")
                           for d in ("add", "chain", "instruct", "sort",
                                     "reverse")}
  assert all(len(v) == 8 and set(v) <= {0, 1} for v in outcomes.values())
  assert sum(outcomes["greedy/add"]) / 8 == ours[
      "eval/greedy/add/accuracy"]
  assert counts["samples"] == 4 and len(counts["counts"]["sort"]) == 8
  assert ours.keys() == theirs.keys() and len(ours) == 1 + 5 * 2 * 3
  for key, value in theirs.items():
    assert abs(ours[key] - value) < 1e-9, key
  assert len(coverage) == 5 * 3  # k = 1, 2, 4 on every domain
  for domain in ("add", "chain", "instruct", "sort", "reverse"):
    by_k = [coverage[f"eval/pass@{k}/{domain}"] for k in (1, 2, 4)]
    assert 0 <= by_k[0] <= by_k[1] <= by_k[2] <= 1, (domain, by_k)
  after = sorted(p.relative_to(run) for p in run.rglob("*"))
  assert [str(p) for p in set(after) - set(before)] == ["eval_8.json"]


@pytest.mark.parametrize("args, needle", [
    (("--run={nothing}",), "not a mopd_jax run directory"),
    (("--run={run}", "--num_promps=8"), "Unknown command line flag"
     " 'num_promps'")])
def test_evaluate_bad_input_is_one_line(smoke_run, tmp_path, cached_env,
                                        args, needle):
  names = dict(nothing=tmp_path / "nothing", run=smoke_run[0])
  result = _evaluate(*(a.format(**names) for a in args), env=cached_env)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and needle.format(**names) in lines[0], lines


def test_evaluate_output_is_checked_before_any_work(smoke_run, tmp_path):
  run, nothing = smoke_run[0], tmp_path / "nothing"
  with pytest.raises(ConfigError, match=(
      f"--output: cannot write {nothing}/out.json: {nothing} is not a"
      " directory")):
    evaluate_run(str(run), 8, ["add"], SETTINGS,
                 output=f"{nothing}/out.json")
  with pytest.raises(ConfigError, match=f"--output: cannot write {run}: it"
                     " is a directory"):
    evaluate_run(str(run), 8, ["add"], SETTINGS, output=str(run))


def test_evaluate_an_unfinished_run_names_the_step_it_used(
    smoke_run, tmp_path, cached_env):
  """A run stopped after its step-2 checkpoint: its newest checkpoint,
  labelled with its own step, and a warning line saying so."""
  run = tmp_path / "run"
  shutil.copytree(smoke_run[0], run)
  os.remove(run / "summary.json")
  shutil.rmtree(run / "ckpt" / "4")
  result = _evaluate(f"--run={run}", "--num_prompts=2", "--domains=add",
                     env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert (f"warning: {run} has not finished (no summary.json); using its"
          " newest checkpoint, step 2") in result.stderr
  assert json.load(open(run / "eval_2.json"))["step"] == 2
