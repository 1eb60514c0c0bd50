"""One writer per workdir: a second is refused in one line naming the
holder's PID, and a killed holder's lock is released by the OS."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from mopd_jax import runs
from mopd_jax.errors import CheckpointError


def test_a_second_writer_is_refused_and_the_lock_comes_back(tmp_path):
  with runs.locked(str(tmp_path)):
    with pytest.raises(CheckpointError, match=f"process {os.getpid()}"):
      with runs.locked(str(tmp_path)):
        pass
  with runs.locked(str(tmp_path)):  # released at the end of the body
    pass


def test_a_killed_holder_releases_the_lock(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c",
       "import sys, time\n"
       "from mopd_jax import runs\n"
       f"with runs.locked({str(tmp_path)!r}):\n"
       "  print('held', flush=True)\n"
       "  time.sleep(600)\n"],
      stdout=subprocess.PIPE, text=True, cwd=ROOT)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(CheckpointError, match=f"process {holder.pid}"):
      with runs.locked(str(tmp_path)):
        pass
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
  deadline = time.monotonic() + 30
  while True:
    try:
      with runs.locked(str(tmp_path)):
        break
    except CheckpointError:
      assert time.monotonic() < deadline
      time.sleep(0.1)


def test_a_full_disk_does_not_break_the_lock(tmp_path, monkeypatch):
  """The PID is written best effort: on a full disk the lock still holds
  and the first real write reports the disk (one line, tests/test_cli.py)."""
  import errno

  def full(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  monkeypatch.setattr(os, "pwrite", full)
  monkeypatch.setattr(os, "ftruncate", full)
  with runs.locked(str(tmp_path)):
    with pytest.raises(CheckpointError, match=r"process \(unknown\)"):
      with runs.locked(str(tmp_path)):
        pass
