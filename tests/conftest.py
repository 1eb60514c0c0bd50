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
