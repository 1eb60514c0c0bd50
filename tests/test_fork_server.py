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


def _both(script, *args, cwd):
  theirs = subprocess.run([sys.executable, script, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)
  ours = fork_server.run_script(script, args, cwd=cwd)
  return theirs, ours


@pytest.mark.parametrize("arg", ["0", "3", "kill", "a b"])
def test_a_script_runs_as_a_process_of_its_own(tmp_path, arg):
  script = tmp_path / "bin" / "probe.py"
  script.parent.mkdir()
  script.write_text(SCRIPT)
  theirs, ours = _both(str(script), arg, cwd=tmp_path)
  assert ours.returncode == theirs.returncode
  assert (ours.stdout, ours.stderr) == (theirs.stdout, theirs.stderr)
  assert str(script.parent) in ours.stdout  # the script's folder first


def test_a_module_runs_as_python_m_does(tmp_path):
  (tmp_path / "probe_module.py").write_text(SCRIPT)
  theirs = subprocess.run([sys.executable, "-m", "probe_module", "2"],
                          cwd=tmp_path, capture_output=True, text=True)
  ours = fork_server.run_module("probe_module", ["2"], cwd=tmp_path)
  assert (ours.returncode, ours.stdout, ours.stderr) == (
      2, theirs.stdout, theirs.stderr)
  assert f"{tmp_path} {tmp_path}" in ours.stdout  # cwd first on sys.path


def test_a_timeout_kills_the_command_and_the_server_goes_on(tmp_path):
  script = tmp_path / "probe.py"
  script.write_text(SCRIPT)
  with pytest.raises(subprocess.TimeoutExpired):
    fork_server.run_script(str(script), ["sleep"], cwd=tmp_path, timeout=0.5)
  again = fork_server.run_script(str(script), ["0"], cwd=tmp_path,
                                 env=dict(os.environ))
  assert again.returncode == 0 and "to stderr" in again.stderr
