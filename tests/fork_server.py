"""``python -m <module> ARGS`` and ``python FILE ARGS`` for the tests,
forked from a process that has already imported the libraries every
command imports.

A command's start is mostly imports (``python -c "import mopd_jax.train"``:
2.3-2.7 s on the 2-core CPU, 1 s of it ``ml_dtypes`` registering its NumPy
ufunc loops), and the suite starts about 140 commands. A server process
imports jax, flax, optax and orbax once, never touching a device (so no
XLA thread exists to be forked), and forks a child per command: the child
sets ``sys.argv``, its working directory and its standard streams and
runs the module or file as ``__main__``, exiting as a process does
(``atexit`` handlers, exit code; a signal's death is ``-signal``, as
``subprocess`` reports it). What a command computes is what
a fresh process computes: a server is made for one environment (jax reads
its settings from it at import) and imports none of this package, which
the child imports after putting first on ``sys.path`` what ``python -m``
(the working directory) or ``python FILE`` (the file's folder) would: the
same copy of it as a fresh process, and its entry modules' flags defined
once.
The server enforces the timeout (it is the child's parent). Unlike fresh
processes, the children of one server share its ``hash()`` seed (NumPy's
and ``random``'s global generators are reseeded in each), and the output
of a grandchild still running when the child exits is not waited for.
Commands that tests kill with signals stay processes of their own.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import subprocess
import sys
import tempfile

# Imported once by each server: the libraries every command imports
# (``python -X importtime -m mopd_jax.train``: 2.1 of its 2.3 s), none of
# which defines a command-line flag.
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.linen", "optax",
           "orbax.checkpoint", "ml_collections.config_flags", "absl.app")
# Servers kept per pytest worker (about 210 MB each), least recently used
# closed first.
MAX_SERVERS = 4
# Set by pytest for each test: not a setting any import reads, so one server
# serves every test (the child gets the caller's value).
_VOLATILE = ("PYTEST_CURRENT_TEST",)

_SERVER = r"""
import json, os, random, runpy, signal, sys, time
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
  deadline = time.monotonic() + request["timeout"]
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      answer = b"%d" % os.waitstatus_to_exitcode(status)
      break
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      answer = b"timeout"
      break
    time.sleep(0.01)
  control_out.write(answer + b"\n"); control_out.flush()
# The child: the command's environment, streams and directory, then run.
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
  os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
random.seed()
sys.modules["numpy"].random.seed()
script = request["script"]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)) if script
                else request["cwd"])
sys.argv = [script or request["module"]] + request["args"]
del json, control_in, control_out, line, pid, null, fd, path
if script:
  runpy.run_path(script, run_name="__main__")
else:
  runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
"""

_servers: collections.OrderedDict = collections.OrderedDict()


def _close_server(key) -> None:
  server = _servers.pop(key)
  server.stdin.close()
  server.kill()
  server.wait()


def _server(key, env: dict[str, str]) -> subprocess.Popen:
  """The server of ``key`` (``env`` without ``_VOLATILE``), started if
  need be."""
  if key in _servers and _servers[key].poll() is not None:
    _close_server(key)
  if key not in _servers:
    while len(_servers) >= MAX_SERVERS:
      _close_server(next(iter(_servers)))
    # -P: nothing of the server's own directory on sys.path.
    server = subprocess.Popen(
        [sys.executable, "-P", "-c", _SERVER, json.dumps(PRELOAD)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
    if server.stdout.readline() != b"ready\n":
      server.kill()
      raise RuntimeError("the fork server did not start")
    _servers[key] = server
  _servers.move_to_end(key)
  return _servers[key]


@atexit.register
def _close():
  for key in list(_servers):
    _close_server(key)


def run_module(module: str, args, *, cwd: str, env=None,
               timeout: float = 300) -> subprocess.CompletedProcess:
  """``subprocess.run([sys.executable, "-m", module, *args], cwd=cwd,
  env=env, capture_output=True, text=True, timeout=timeout)``, forked from
  a server of ``env`` (``os.environ`` when None)."""
  return _run(["-m", module], dict(module=module, script=None), args,
              str(cwd), env, timeout)


def run_script(path: str, args, *, cwd: str, env=None,
               timeout: float = 300) -> subprocess.CompletedProcess:
  """``run_module`` for ``python PATH *args``."""
  return _run([path], dict(module=None, script=str(path)), args, str(cwd),
              env, timeout)


def _run(command, what, args, cwd, env, timeout):
  args = [str(a) for a in args]
  if not os.path.isdir(cwd):  # as subprocess raises it
    raise FileNotFoundError(2, "No such file or directory", cwd)
  env = dict(os.environ if env is None else env)
  key = tuple(sorted(i for i in env.items() if i[0] not in _VOLATILE))
  server = _server(key, env)
  with tempfile.TemporaryDirectory() as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    try:
      request = memoryview(json.dumps(dict(
          what, args=args, cwd=cwd, stdout=out, stderr=err, env=env,
          timeout=timeout)).encode() + b"\n")
      while request:
        request = request[server.stdin.write(request):]
      answer = server.stdout.readline().strip()
      if not answer:
        raise RuntimeError("the fork server died")
    except BaseException:  # an interrupted exchange: the server is lost
      _close_server(key)
      raise
    if answer == b"timeout":
      raise subprocess.TimeoutExpired([*command, *args], timeout)
    return subprocess.CompletedProcess(
        [sys.executable, *command, *args], int(answer), _text(out),
        _text(err))


def _text(path: str) -> str:
  with open(path) as f:  # strict, in the locale's encoding, as text=True
    return f.read()
