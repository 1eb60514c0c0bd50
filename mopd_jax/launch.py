"""Training runs launched as child processes by the experiment scripts."""

from __future__ import annotations

import subprocess
import sys

from mopd_jax.errors import UserError


def train(args: list[str], log_path: str | None = None) -> None:
  """Runs ``python -m mopd_jax.train *args`` to the end, printing to the
  caller's output or appending to ``log_path``. A failed run raises a
  ``UserError`` naming its workdir; the run's own one-line error is
  printed before it (or is the last line of the log)."""
  cmd = [sys.executable, "-m", "mopd_jax.train", *args]
  if log_path is None:
    code = subprocess.run(cmd).returncode
  else:
    with open(log_path, "a", encoding="utf-8") as log:
      code = subprocess.run(cmd, stdout=log,
                            stderr=subprocess.STDOUT).returncode
  if code:
    workdir = next((a.split("=", 1)[1] for a in args
                    if a.startswith("--workdir=")), "?")
    raise UserError(f"{workdir}: training failed (exit {code}"
                    + (f", see {log_path})" if log_path else ", error above)"))
