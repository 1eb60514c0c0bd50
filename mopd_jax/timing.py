"""Wall-clock timing for the benchmarks under ``experiments/``."""

from __future__ import annotations

import time

import numpy as np


def timed_calls(fn, repeats: int) -> list[float]:
  """Seconds of each of ``repeats`` calls of ``fn()`` (which must block),
  after one call that compiles and warms up."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def timed(fn, repeats: int) -> float:
  """Median seconds of ``timed_calls``."""
  return float(np.median(timed_calls(fn, repeats)))


def interleaved(fns, repeats: int) -> list[float]:
  """Median seconds of each of ``fns`` (which must block), their calls
  alternating ``repeats`` times after one warm-up call each, so that a
  slow spell of a shared machine falls on all of them alike."""
  for fn in fns:
    fn()
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, out in zip(fns, times):
      start = time.perf_counter()
      fn()
      out.append(time.perf_counter() - start)
  return [float(np.median(t)) for t in times]
