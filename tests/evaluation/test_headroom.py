"""Headroom recovery from eval.json files, against hand-computed values."""

import json

import pytest

from mopd_jax.errors import CheckpointError
from mopd_jax.evaluation import headroom


def _run(tmp_path, name, greedy):
  run = tmp_path / name
  run.mkdir()
  scalars = {"step": 10}
  for d, acc in greedy.items():
    scalars[f"eval/greedy/{d}/accuracy"] = acc
    scalars[f"eval/greedy/{d}/reward"] = 0.123
    scalars[f"eval/sampled/{d}/accuracy"] = acc / 2
  (run / "eval.json").write_text(json.dumps(scalars))
  return str(run)


def test_headroom_recovery_from_runs(tmp_path):
  base = _run(tmp_path, "base", {"add": 0.5, "sort": 0.6, "reverse": 1.0})
  student = _run(tmp_path, "student", {"add": 0.6, "sort": 0.9,
                                       "reverse": 0.9})
  experts = {"add": _run(tmp_path, "e_add", {"add": 0.9, "sort": 0.1}),
             "sort": _run(tmp_path, "e_sort", {"add": 0.2, "sort": 0.8})}
  oracle = headroom.oracle_accuracies(experts)
  assert oracle == {"add": 0.9, "sort": 0.8}
  r = headroom.headroom_recovery(headroom.run_accuracies(student),
                                 headroom.run_accuracies(base), oracle)
  assert r["add"] == pytest.approx(0.25)
  assert r["sort"] == pytest.approx(1.5)
  assert r["mean"] == pytest.approx(0.875)
  assert headroom.run_accuracies(student, "sampled")["sort"] == 0.45
  # A domain without headroom is left out rather than divided by zero.
  r = headroom.headroom_recovery({"add": 0.7}, {"add": 0.9}, {"add": 0.9})
  assert r == {"mean": 0.0}


def test_missing_evaluation_names_the_file(tmp_path):
  with pytest.raises(CheckpointError, match="eval.json"):
    headroom.run_accuracies(str(tmp_path))


def test_report_for_both_decoding_modes(tmp_path):
  base = _run(tmp_path, "base", {"add": 0.5})
  experts = {"add": _run(tmp_path, "e_add", {"add": 0.9})}
  student = headroom.final_scalars(_run(tmp_path, "s", {"add": 0.7}))
  r = headroom.report(student, base, experts)
  assert r["greedy"]["add"] == pytest.approx(0.5)
  assert r["sampled"]["add"] == pytest.approx((0.35 - 0.25) / (0.45 - 0.25))


@pytest.mark.parametrize("missing", ["student", "base", "expert"])
def test_report_names_the_evaluation_without_a_domain(tmp_path, missing):
  full, partial = {"add": 0.5, "sort": 0.5}, {"add": 0.5}

  def pick(who):
    return partial if who == missing else full

  base = _run(tmp_path, "base", pick("base"))
  experts = {"add": _run(tmp_path, "e_add", {"add": 0.9}),
             "sort": _run(tmp_path, "e_sort", pick("expert"))}
  student = headroom.final_scalars(_run(tmp_path, "s", pick("student")))
  where = {"student": "final evaluation", "base": "base/eval.json",
           "expert": "e_sort/eval.json"}[missing]
  with pytest.raises(CheckpointError, match=f"{where}.*'sort'"):
    headroom.report(student, base, experts)
