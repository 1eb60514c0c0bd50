"""``python -m <module> ARGS`` for the tests, forked from a process that has
already imported the libraries every command imports.

A command's start is mostly imports (``python -c "import mopd_jax.train"``:
2.3-2.7 s on the 2-core CPU, 1 s of it ``ml_dtypes`` registering its NumPy
ufunc loops), and the suite starts about 140 commands. A server process per
environment imports jax, flax, optax, orbax and the package's library
modules once, never touching a device (so no XLA thread exists to be
forked), and forks a child per command: the child sets ``sys.argv``, its
working directory and its standard streams, and runs the module as
``__main__`` as ``python -m`` does, exiting as a process does (``atexit``
handlers, exit code; a signal's death is ``-signal``, as ``subprocess``
reports it). What a command computes is the same as in a fresh process: the
server has the command's whole environment (one server per distinct
environment, as jax reads its settings from it at import) and imports no
entry module (``mopd_jax.train``, ``evaluate``, ...), whose flags the child
defines. Commands that are killed by signals or are experiment scripts
still start as processes of their own.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile

# Imported once by each server: what every command imports before its own
# entry module (``python -X importtime -m mopd_jax.train``), none of which
# defines a command-line flag.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.linen", "optax",
           "orbax.checkpoint", "ml_collections.config_flags", "absl.app",
           "mopd_jax.stages", "mopd_jax.cli")

_SERVER = r"""
import json, os, runpy, sys
for name in json.loads(sys.argv[1]):
  __import__(name)
control_in, control_out = sys.stdin.buffer, sys.stdout.buffer
control_out.write(b"ready\n"); control_out.flush()
while True:
  line = control_in.readline()
  if not line:
    os._exit(0)
  request = json.loads(line)
  pid = os.fork()
  if pid == 0:
    break
  control_out.write(b"%d\n" % pid); control_out.flush()
  _, status = os.waitpid(pid, 0)
  control_out.write(b"%d\n" % os.waitstatus_to_exitcode(status))
  control_out.flush()
# The child: the command's streams and directory, then python -m.
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
  os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
script = request["script"]
# As python -m puts the working directory first on sys.path, and python
# FILE the file's directory (the server itself runs with -P: none).
sys.path.insert(0, os.path.dirname(script) if script else request["cwd"])
sys.argv = [script or request["module"]] + request["args"]
del json, control_in, control_out, line, pid, null, fd, path
if script:
  runpy.run_path(script, run_name="__main__")
else:
  runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
"""

_servers: dict[tuple, subprocess.Popen] = {}


# Set by pytest for each test: not a setting any import reads, so one server
# serves every test (the child gets the caller's value).
_VOLATILE = ("PYTEST_CURRENT_TEST",)


def _server(env: dict[str, str]) -> subprocess.Popen:
  key = tuple(sorted(i for i in env.items() if i[0] not in _VOLATILE))
  server = _servers.get(key)
  if server is None or server.poll() is not None:
    server = subprocess.Popen(
        [sys.executable, "-P", "-c", _SERVER, json.dumps(PRELOAD)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
        cwd=tempfile.gettempdir())
    if server.stdout.readline() != b"ready\n":
      raise RuntimeError("the fork server did not start")
    _servers[key] = server
  return server


@atexit.register
def _close():
  for server in _servers.values():
    server.stdin.close()
    server.wait()


def run_module(module: str, args, *, cwd: str, env=None,
               timeout: float = 300) -> subprocess.CompletedProcess:
  """``subprocess.run([sys.executable, "-m", module, *args], cwd=cwd,
  env=env, capture_output=True, text=True, timeout=timeout)``, forked from
  a server of ``env`` (``os.environ`` when None)."""
  return _run(["-m", module], dict(module=module, script=None), args, cwd,
              env, timeout)


def run_script(path: str, args, *, cwd: str, env=None,
               timeout: float = 300) -> subprocess.CompletedProcess:
  """``run_module`` for ``python PATH *args``."""
  return _run([path], dict(module=None, script=path), args, cwd, env,
              timeout)


def _run(command, what, args, cwd, env, timeout):
  args = [str(a) for a in args]
  env = dict(os.environ if env is None else env)
  server = _server(env)
  with tempfile.TemporaryDirectory() as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    server.stdin.write(json.dumps(dict(
        what, args=args, cwd=str(cwd), stdout=out, stderr=err,
        env=env)).encode() + b"\n")
    server.stdin.flush()
    pid = int(server.stdout.readline())
    ready, _, _ = select.select([server.stdout], [], [], timeout)
    if not ready:
      os.kill(pid, 9)
      server.stdout.readline()
      raise subprocess.TimeoutExpired([*command, *args], timeout)
    code = int(server.stdout.readline())
    return subprocess.CompletedProcess(
        [sys.executable, *command, *args], code,
        _text(out), _text(err))


def _text(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()
