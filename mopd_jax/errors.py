"""User-facing errors: each one becomes a single line on stderr and exit code 2.

Anything raised as a ``UserError`` is a problem with what the user gave us
(config, data, checkpoint, workdir), never a bug in mopd_jax, so the entry point
prints it without a traceback.
"""

import difflib
import sys


def reason(error: Exception) -> str:
  """``Type: first line of the message`` (at most 200 characters): what a
  library raised, short enough for the one error line."""
  return (f"{type(error).__name__}: "
          + (str(error).strip().splitlines() or [""])[0][:200])


def unknown_field(parents: list[str], key: str, known) -> str:
  """``"<path>: unknown field (did you mean <path>?)"`` for ``key`` under
  the dotted ``parents``, with the closest of the ``known`` names there:
  the one line of a config's unknown field, from a file or a flag."""
  close = difflib.get_close_matches(key, list(known), n=1)
  hint = (f" (did you mean {'.'.join(parents + close)!r}?)" if close
          else "")
  return f"{'.'.join(parents + [key])}: unknown field{hint}"


def fail(message: str) -> None:
  """Print ``error: message`` on stderr and exit with code 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


class UserError(Exception):
  """A problem with the user's input; the message names the file/line/field."""


class ConfigError(UserError):
  """An unknown config field, a wrong type or an impossible value."""


class DataError(UserError):
  """A malformed data file, an unknown domain or an empty dataset."""


class CheckpointError(UserError):
  """A missing, corrupt or incompatible checkpoint."""


class DivergenceError(UserError):
  """Training stopped: too many steps in a row with a non-finite loss or
  gradient (the last good checkpoint is kept)."""


class Interrupted(UserError):
  """Training stopped by SIGTERM (a preemption) or a first Ctrl-C after its
  current step, with a checkpoint of that step: re-running resumes it."""
