"""Headroom recovery: how much of the gap between the base and the
domain-routed oracle ensemble a fused model closes, per domain and on
average, from the ``eval.json`` files the stages write (or the larger
``eval_<N>.json`` of ``python -m mopd_jax.evaluate``: ``eval_file``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from mopd_jax.errors import CheckpointError


EVAL_FILE = "eval.json"


def final_scalars(run_dir: str, eval_file: str = EVAL_FILE
                  ) -> dict[str, float]:
  """The scalars of the final evaluation of the run in ``run_dir``."""
  path = os.path.join(os.path.expanduser(run_dir), eval_file)
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path}: no final evaluation ({e})") from None


def run_accuracies(run_dir: str, mode: str = "greedy",
                   eval_file: str = EVAL_FILE) -> dict[str, float]:
  """``{domain: accuracy}`` of the final evaluation of the run in
  ``run_dir`` (``mode``: greedy or sampled)."""
  return accuracies(final_scalars(run_dir, eval_file), mode)


def accuracies(scalars: Mapping[str, float], mode: str = "greedy",
               split: str = "eval") -> dict[str, float]:
  """``{domain: accuracy}`` from evaluation scalars
  (``<split>/<mode>/<domain>/accuracy``; ``split``: eval for the test
  split, validation)."""
  prefix = f"{split}/{mode}/"
  return {k[len(prefix):-len("/accuracy")]: v for k, v in scalars.items()
          if k.startswith(prefix) and k.endswith("/accuracy")}


def oracle_accuracies(teacher_dirs: Mapping[str, str], mode: str = "greedy",
                      eval_file: str = EVAL_FILE) -> dict[str, float]:
  """The oracle ensemble: each domain answered by its own expert."""
  return {d: _domain(run_accuracies(path, mode, eval_file), d,
                     os.path.join(path, eval_file), mode)
          for d, path in teacher_dirs.items()}


def _domain(acc: Mapping[str, float], domain: str, where: str,
            mode: str) -> float:
  if domain not in acc:
    raise CheckpointError(f"{where}: no {mode} accuracy for domain {domain!r}")
  return acc[domain]


def headroom_recovery(student: Mapping[str, float], base: Mapping[str, float],
                      oracle: Mapping[str, float]) -> dict[str, float]:
  """``(acc_student_d - acc_base_d) / (acc_oracle_d - acc_base_d)`` for each
  domain of ``oracle`` with positive headroom, and their ``mean``."""
  out = {d: (student[d] - base[d]) / (oracle[d] - base[d])
         for d in oracle if oracle[d] > base[d]}
  out["mean"] = sum(out.values()) / max(len(out), 1)
  return out


def report(scalars: Mapping[str, float], base_dir: str,
           teacher_dirs: Mapping[str, str], eval_file: str = EVAL_FILE,
           student_where: str = "the final evaluation") -> dict:
  """Headroom recovery of the evaluation ``scalars`` (from
  ``student_where``) against the base run and the oracle ensemble of
  ``teacher_dirs`` (their ``eval_file``), for each decoding mode the
  scalars hold (greedy, sampled): ``{mode: {domain: recovery, "mean":
  ...}}``. Raises ``CheckpointError`` naming the evaluation that lacks a
  domain."""
  out = {}
  for mode in ("greedy", "sampled"):
    student = accuracies(scalars, mode)
    if not student:
      continue
    oracle = oracle_accuracies(teacher_dirs, mode, eval_file)
    base = run_accuracies(base_dir, mode, eval_file)
    base_file = os.path.join(base_dir, eval_file)
    out[mode] = headroom_recovery(
        {d: _domain(student, d, student_where, mode) for d in oracle},
        {d: _domain(base, d, base_file, mode) for d in oracle}, oracle)
  return out
