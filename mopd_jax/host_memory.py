"""Host memory that XLA:CPU frees stays with the process, for its next step.

XLA:CPU allocates each execution's scratch buffer with ``posix_memalign``
and frees it when the execution ends. glibc hands blocks over 32 MiB, and
any large block of a thread's own arena, to ``mmap`` and returns them with
``munmap``, so every step of a program with a large scratch buffer (the
built-in pretraining step's is 670 MiB) faulted its pages in afresh:
176,000 page faults a second, a fifth of the CPU time in the kernel,
and the two cores' threads waiting on each other's faults.
``keep_freed_memory`` has every thread allocate from the main heap
(``M_ARENA_MAX`` 1), never by ``mmap`` (``M_MMAP_MAX`` 0), and never gives
freed memory back to the system (``M_TRIM_THRESHOLD`` -1; a limit of 2 GiB,
the most a C int holds, still returned SmolLM2's 4.8 GB train-step scratch
at every step: 1.2 million faults a step): the next step reuses the same
pages. The process keeps its peak heap in exchange (docs/performance.md
has the figures).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER = -1  # M_TRIM_THRESHOLD's value for no trimming at all (man mallopt)


def cpu_backend_expected() -> bool:
  """Whether JAX's default backend will be the CPU: ``JAX_PLATFORMS``
  names it first, or no accelerator plugin (CUDA, ROCm, TPU) is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  plugins = importlib.metadata.entry_points(group="jax_plugins")
  return not plugins and not any(
      importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))


def keep_freed_memory() -> bool:
  """Set glibc's allocator as the module docstring says; returns whether it
  was set. Not where the user set their own (``GLIBC_TUNABLES``), outside
  glibc (macOS), or where an accelerator will be the backend (its host
  would keep the peak of a checkpoint's loading for nothing). Must run
  before XLA's threads start (at ``mopd_jax``'s import): a thread that
  already allocated keeps its own arena."""
  if (not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ
      or not cpu_backend_expected()):
    return False
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):  # musl and others: no mallopt
    return False
  return all(mallopt(option, value) == 1
             for option, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0),
                                   (M_TRIM_THRESHOLD, NEVER)))
