"""Metric writers: one JSON line per logging step plus TensorBoard scalars."""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

from tensorboardX import SummaryWriter


class MetricWriter:
  """Appends ``{"step": s, **scalars}`` to ``<workdir>/metrics.jsonl`` and
  writes the same scalars to TensorBoard under ``<workdir>/tb``."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._jsonl = open(self.path, "a", encoding="utf-8")
    self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    clean = {k: float(v) for k, v in scalars.items()}
    # JSON has no NaN/inf; keep the line parseable and the fact visible.
    line = {k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}
    self._jsonl.write(json.dumps({"step": int(step), **line}) + "\n")
    self._jsonl.flush()
    for k, v in clean.items():
      self._tb.add_scalar(k, v, int(step))

  def close(self) -> None:
    self._jsonl.close()
    self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  """All records of ``<workdir>/metrics.jsonl`` (for notebooks and reports)."""
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
