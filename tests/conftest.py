"""Test-wide setup: 8 fake CPU devices (before jax is imported anywhere) so
sharding tests exercise a real mesh layout, and one small TFDS data dir."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
  """A TFDS directory shared by the tests that build the built-in domains."""
  return str(tmp_path_factory.mktemp("tfds"))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pretrain_smoke_command(workdir, data_dir):
  import sys
  return [sys.executable, "-m", "mopd_jax.train",
          f"--config={ROOT}/configs/pretrain.py:smoke", f"--workdir={workdir}",
          f"--config.data.data_dir={data_dir}"]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, data_dir):
  """One real ``python -m mopd_jax.train`` smoke pretraining run, shared."""
  import subprocess
  workdir = tmp_path_factory.mktemp("smoke") / "run"
  cmd = pretrain_smoke_command(workdir, data_dir)
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, cmd, result
