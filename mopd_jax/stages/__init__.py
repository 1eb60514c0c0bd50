"""The stages (one per method) and how a validated config runs as one.

``STAGES`` is the one table a new method enters: method -> module with
``run(config, workdir)`` (and optionally ``check(config)``, which checks the
runs it reads before anything is written).
"""

from __future__ import annotations

import importlib
import os

import jax

from mopd_jax import parallel
from mopd_jax.errors import UserError
from mopd_jax.runs import (check_resumable, locked, resolve_model,
                           save_run_config)

STAGES = {"pretrain": "mopd_jax.stages.pretrain", "grpo": "mopd_jax.stages.rl",
          "mix_rl": "mopd_jax.stages.rl", "mopd": "mopd_jax.stages.mopd",
          "merge": "mopd_jax.stages.merge", "study": "mopd_jax.stages.study"}


def prepare_workdir(workdir: str) -> str:
  """Create ``workdir`` if needed and check that it can be written."""
  if not workdir.strip():
    raise UserError("workdir: empty; name the run directory")
  path = os.path.abspath(os.path.expanduser(workdir))
  try:
    os.makedirs(path, exist_ok=True)
    # Per process: the hosts of a multi-host run may share the workdir.
    probe = os.path.join(path, f".write_test.{jax.process_index()}")
    with open(probe, "w", encoding="utf-8"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"workdir {path}: not writable ({e.strerror})") from None
  return path


def run(config, workdir: str):
  """Run the validated ``config`` into ``workdir``: its stage's checks of
  the runs it reads, then, holding the workdir's lock, the resume checks,
  ``config.json`` and the stage itself (a study runs its steps through
  here, in process)."""
  resolve_model(config)
  stage = importlib.import_module(STAGES[config.method])
  if hasattr(stage, "check"):  # the runs it reads, before any writing
    stage.check(config)
  workdir = prepare_workdir(workdir)
  with locked(workdir):  # one writer at a time
    check_resumable(config, workdir)
    save_run_config(config, workdir)
    with parallel.use_rules(config.mesh.rules):
      return stage.run(config, workdir)
