"""What every entry point shares (``mopd_jax/cli.py``): SIGTERM outside a
training loop and a write the disk refuses are one line and exit 2."""

import errno
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT
from mopd_jax import atomic
from mopd_jax.errors import UserError


def test_sigterm_outside_training_is_one_line():
  """A merge, an evaluation or the report: no training loop's handler."""
  child = subprocess.Popen(
      [sys.executable, "-c",
       "import time\n"
       "from mopd_jax import cli\n"
       "def main():\n"
       "  print('ready', flush=True)\n"
       "  time.sleep(600)\n"
       "cli.run(main)\n"],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  assert child.stdout.readline().strip() == "ready"
  child.send_signal(signal.SIGTERM)
  _, err = child.communicate(timeout=60)
  assert child.returncode == 2
  assert err.strip().splitlines() == [
      "error: interrupted; the same command resumes from the last checkpoint"]


def test_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch):
  def full(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(os, "replace", full)
  path = str(tmp_path / "config.json")
  with pytest.raises(UserError, match=f"{path}: cannot write .No space"):
    atomic.write_json_atomic(path, {"a": 1})
  assert os.listdir(tmp_path) == []  # the temporary file removed


@pytest.mark.parametrize("environment, want", [
    ({}, "HOME/.cache/mopd_jax/xla"), ({"JAX_COMPILATION_CACHE_DIR": "/c"},
                                       "/c"),
    ({"JAX_COMPILATION_CACHE_DIR": ""}, None)])
def test_compiled_programs_are_kept_where_jax_is_told(tmp_path, monkeypatch,
                                                      environment, want):
  """Every command keeps compiled programs in ~/.cache/mopd_jax/xla
  (exported, so a study's seed processes share them), or where JAX's own
  variable says, or nowhere when it is empty."""
  import jax
  from mopd_jax import cli
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  for key, value in environment.items():
    monkeypatch.setenv(key, value)
  monkeypatch.delenv("JAX_ENABLE_COMPILATION_CACHE", raising=False)
  before = {key: jax.config.values[key] for key in (
      "jax_compilation_cache_dir", "jax_enable_compilation_cache")}
  try:
    cli.use_compilation_cache()
    got = jax.config.values["jax_compilation_cache_dir"]
    assert got == (want.replace("HOME", str(tmp_path)) if want else None)
    assert jax.config.values["jax_enable_compilation_cache"] == bool(want)
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == (got or "")
    # the processes it starts read the same from the environment
    assert os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "true") == (
        "true" if want else "false")
  finally:
    for key, value in before.items():
      jax.config.update(key, value)
