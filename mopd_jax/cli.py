"""What every command-line entry point (``train``, ``evaluate``, the
geometry report) shares: a bad flag, a problem with the user's input or an
interrupt is one ``error:`` line and exit code 2, and library chatter
(absl warnings such as TFDS's notes on dataset configurations) stays off
stderr unless ``--verbosity`` asks for it."""

from __future__ import annotations

import os
import re
import runpy
import signal
import sys
from typing import Callable

from absl import app, flags, logging

from mopd_jax.errors import UserError, fail, reason, unknown_field


def config_value(holder, flag: str):
  """The config of a ``config_flags`` flag, or a ``UserError`` naming
  ``--flag`` when its file could not be loaded (which ml_collections
  reports only on first access); None when the flag is not given."""
  try:
    config = holder.value
    _ = config is None or "method" in config  # the first access loads it
    return config
  except OSError as e:
    last = [l.strip() for l in str(e).splitlines() if l.strip()][-1]
    raise UserError(f"--{flag}: cannot load the config file: {last}"
                    ) from None


def flag_error(error: Exception, argv) -> str:
  """One line for an exception raised while parsing flags and config
  overrides. The config file and the overrides are checked here, in the
  order the library applies them (``config_problem``), so the line names
  the field or file at fault without reading the library's message; any
  other error (a value that does not parse) is its message on one line."""
  return config_problem(argv) or " ".join(str(error).split()) or type(
      error).__name__


def config_problem(argv) -> str | None:
  """What is wrong with ``--config=FILE[:variant]`` and its
  ``--config.<path>=`` overrides, or None: the file does not load or
  defines no ``get_config``, its ``get_config`` raised, or an override
  names a field the config does not have (the first missing part of its
  path, with the closest existing name). Only on a failed parse, so the
  file runs a second time then: a config file is declarations."""
  spec = None
  for i, arg in enumerate(argv):  # --config=FILE or --config FILE
    if arg.startswith("--config="):
      spec = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(argv):
      spec = argv[i + 1]
  if spec is None:
    return None
  path, _, variant = spec.partition(":")
  try:
    module = runpy.run_path(os.path.expanduser(path))
  except Exception as e:  # pylint: disable=broad-except
    return f"--config: cannot load the config file {path}: {reason(e)}"
  if "get_config" not in module:
    return ("--config: the config file defines no get_config(variant)"
            " function")
  try:
    config = (module["get_config"](variant) if variant
              else module["get_config"]())
  except Exception as e:  # pylint: disable=broad-except
    return f"flag --config={spec}: {type(e).__name__}: {e}"
  for arg in argv:
    if arg.startswith("--config."):
      field = arg[len("--config."):].split("=", 1)[0]
      if "[" in field:  # an index into a value: the library's message
        continue
      missing = _missing_part(config, field)
      if missing:
        return missing
  return None


def _missing_part(config, dotted: str) -> str | None:
  """``"<path>: unknown field (did you mean ...?)"`` for the first part of
  ``dotted`` that ``config`` lacks (or the value ``dotted`` looks
  inside), else None."""
  node, walked = config, []
  for part in dotted.split("."):
    if not hasattr(node, "keys"):
      return f"{'.'.join(walked)}: a value, not a section (in {dotted})"
    if part not in node:
      return unknown_field(walked, part, node.keys())
    node, walked = node[part], walked + [part]
  return None


def _split_dotted_paths() -> None:
  """ml_collections reads an override's path (``merge.lambda``) as a
  Python expression, so a field named like a keyword (``lambda``,
  mergekit's name for the task-vector factor) could not be set from the
  command line; a plain dotted path is split on its dots instead (the
  same parts the expression would give for any other name)."""
  from ml_collections.config_flags import config_path
  if getattr(config_path.split, "dotted", False):
    return
  expression = config_path.split

  def split(path: str):
    if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", path):
      return tuple(path.split("."))
    return expression(path)

  split.dotted = True
  config_path.split = split


def parse_flags(argv):
  # Everything raised here comes from the command line or a config file
  # (unknown flag or override, bad value, broken config file).
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    fail(flag_error(e, argv))


# Compiled programs kept across runs, as JAX's persistent cache keeps them:
# a study's seeds and steps, a re-run and a resumed run compile the same
# programs (the smoke study took 33 s with the cache warm, 45 s without).
# JAX's own variables choose another folder (empty: no cache) or a bound
# on its size (JAX_COMPILATION_CACHE_MAX_SIZE; unbounded by default, as
# JAX's).
XLA_CACHE = os.path.join("~", ".cache", "mopd_jax", "xla")


def use_compilation_cache() -> None:
  """``XLA_CACHE`` as JAX's compilation cache, unless
  ``JAX_COMPILATION_CACHE_DIR`` says otherwise (empty: none); set in the
  environment too, so that the processes a run starts (a study's seeds)
  share it."""
  import jax  # pylint: disable=import-outside-toplevel
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                        os.path.expanduser(XLA_CACHE))
  folder = os.environ["JAX_COMPILATION_CACHE_DIR"]
  if not folder:  # off, in the processes it starts too
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  jax.config.update("jax_enable_compilation_cache", bool(folder))
  jax.config.update("jax_compilation_cache_dir", folder or None)


def run(main: Callable[..., None], commands: tuple[str, ...] = ()) -> None:
  """``absl.app.run`` of ``main()`` with the contract above; with
  ``commands``, the one positional argument must be one of them and is
  passed on (``main(command)``)."""

  def wrapped(argv) -> None:
    args = argv[1:]
    if commands:
      if len(args) != 1 or args[0] not in commands:
        fail(f"expected one command, {' or '.join(commands)}; got"
             f" {' '.join(args) or 'none'}")
    elif args:
      fail(f"unexpected arguments: {' '.join(args)}")
    if not flags.FLAGS["verbosity"].present:
      # Library logs, errors included (Orbax logs a failed background save
      # with its traceback), would bury the one line that says what to do.
      logging.set_verbosity(logging.FATAL)
    use_compilation_cache()
    guarded(main, *args)

  _split_dotted_paths()
  app.run(wrapped, flags_parser=parse_flags)


def guarded(main: Callable[..., None], *args) -> None:
  """``main(*args)`` under the contract: a ``UserError`` or an interrupt
  is one line and exit code 2. SIGTERM outside a training loop (a merge,
  an evaluation, the report) ends like a Ctrl-C; the loop installs its
  own, which checkpoints the step first."""
  signal.signal(signal.SIGTERM, _terminated)
  try:
    main(*args)
  except UserError as e:
    _exit(str(e))
  except KeyboardInterrupt:
    _exit("interrupted; the same command resumes from the last checkpoint")


def _terminated(signum, frame):
  raise KeyboardInterrupt


def _exit(message: str) -> None:
  """The error line and exit code 2, now: after a failed save Orbax's
  signalling threads wait forever for a commit that never comes, and a
  normal exit would join them (our own files are closed by then)."""
  print(f"error: {message}", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(2)  # pylint: disable=protected-access
