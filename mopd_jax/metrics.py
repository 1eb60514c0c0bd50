"""Metric writers: one JSON line per logging step plus TensorBoard scalars.

A run resumed from the checkpoint of step ``s`` first drops the records past
``s`` (``truncate_after``) and tells TensorBoard to discard its events past
``s``, so that the replayed steps are never logged twice.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

from mopd_jax.atomic import write_text_atomic
from mopd_jax.parallel import is_primary
from mopd_jax.tb_events import EventFileWriter

METRICS_FILE = "metrics.jsonl"


class MetricWriter:
  """Appends ``{"step": s, **scalars}`` to ``<workdir>/metrics.jsonl`` and
  writes the same scalars to TensorBoard under ``<workdir>/tb``; events of
  steps ``>= purge_step`` that an earlier, killed run wrote are discarded.
  In a multi-host run only process 0 writes; elsewhere it does nothing."""

  def __init__(self, workdir: str, purge_step: int | None = None):
    self.path = os.path.join(workdir, METRICS_FILE)
    self._active = is_primary()
    if self._active:
      self._jsonl = open(self.path, "a", encoding="utf-8")
      self._tb = EventFileWriter(os.path.join(workdir, "tb"), purge_step)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self._active:
      return
    clean = {k: float(v) for k, v in scalars.items()}
    # JSON has no NaN/inf; keep the line parseable and the fact visible.
    line = {k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}
    self._jsonl.write(json.dumps({"step": int(step), **line}) + "\n")
    self._jsonl.flush()
    self._tb.write(int(step), clean)

  def close(self) -> None:
    if not self._active:
      return
    self._jsonl.close()
    self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All records of ``<workdir>/metrics.jsonl`` (for notebooks and reports)."""
  with open(os.path.join(workdir, METRICS_FILE), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_after(workdir: str, step: int) -> None:
  """Keep only the records of ``<workdir>/metrics.jsonl`` up to ``step``
  (rewritten atomically); a line cut short by a kill is dropped too."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8", errors="replace") as f:
    lines = f.read().splitlines()
  kept = [line for line in lines
          if (at := _record_step(line)) is not None and at <= step]
  if kept != lines:
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def _record_step(line: str) -> int | None:
  """The step of a complete record, None for a broken line."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError:
    return None
  step = record.get("step") if isinstance(record, dict) else None
  return step if isinstance(step, int) else None
