"""Wall-clock timing for the benchmarks under ``experiments/``."""

from __future__ import annotations

import time

import numpy as np


def timed(fn, repeats: int) -> float:
  """Median seconds of ``fn()`` (which must block) over ``repeats`` calls,
  after one call that compiles and warms up."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return float(np.median(times))
