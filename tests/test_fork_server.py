"""The tests' forked commands behave as ``subprocess.run`` of the same
command line: arguments, working directory, ``sys.path``, both streams,
exit codes (a signal's death negative), timeouts."""

import os
import subprocess
import sys

import pytest

import fork_server

SCRIPT = """\
import os, signal, sys, time
print(sys.argv[1:], os.getcwd(), sys.path[0])
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
  time.sleep(60)
if sys.argv[1] == "kill":
  os.kill(os.getpid(), signal.SIGTERM)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
  """A folder with the probe as ``bin/probe.py`` and ``probe_module.py``
  (one folder: one server for the module's tests)."""
  root = tmp_path_factory.mktemp("probes")
  (root / "bin").mkdir()
  (root / "bin" / "probe.py").write_text(SCRIPT)
  (root / "probe_module.py").write_text(SCRIPT)
  return root


def _both(script, *args, cwd):
  theirs = subprocess.run([sys.executable, script, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
  ours = fork_server.run_script(script, args, cwd=cwd)
  return theirs, ours


@pytest.mark.parametrize("arg", ["0", "3", "kill", "a b"])
def test_a_script_runs_as_a_process_of_its_own(probes, tmp_path, arg):
  script = probes / "bin" / "probe.py"
  theirs, ours = _both(str(script), arg, cwd=tmp_path)
  assert ours.returncode == theirs.returncode
  assert (ours.stdout, ours.stderr) == (theirs.stdout, theirs.stderr)
  assert str(script.parent) in ours.stdout  # the script's folder first


def test_a_module_runs_as_python_m_does(probes):
  theirs = subprocess.run([sys.executable, "-m", "probe_module", "2"],
                          cwd=probes, capture_output=True, text=True)
  ours = fork_server.run_module("probe_module", ["2"], cwd=probes)
  assert (ours.returncode, ours.stdout, ours.stderr) == (
      2, theirs.stdout, theirs.stderr)
  assert f"{probes} {probes}" in ours.stdout  # cwd first on sys.path


def test_a_timeout_kills_the_command_and_the_server_goes_on(probes,
                                                           tmp_path):
  script = probes / "bin" / "probe.py"
  with pytest.raises(subprocess.TimeoutExpired):
    fork_server.run_script(str(script), ["sleep"], cwd=tmp_path, timeout=0.5)
  again = fork_server.run_script(str(script), ["0"], cwd=tmp_path,
                                 env=dict(os.environ))
  assert again.returncode == 0 and "to stderr" in again.stderr


def test_the_package_is_the_copy_a_fresh_process_imports(tmp_path):
  """A checkout other than the installed one: its own ``mopd_jax``."""
  (tmp_path / "mopd_jax").mkdir()
  (tmp_path / "mopd_jax" / "__init__.py").write_text("")
  (tmp_path / "mopd_jax" / "where.py").write_text(
      "import mopd_jax\nprint(mopd_jax.__file__)\n")
  theirs = subprocess.run([sys.executable, "-m", "mopd_jax.where"],
                          cwd=tmp_path, capture_output=True, text=True)
  ours = fork_server.run_module("mopd_jax.where", [], cwd=tmp_path)
  assert ours.stdout == theirs.stdout == (
      f"{tmp_path / 'mopd_jax' / '__init__.py'}\n")
