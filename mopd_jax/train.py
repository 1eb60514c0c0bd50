"""Entry point: ``python -m mopd_jax.train --config=configs/<m>.py[:variant]``.

Overrides go as ``--config.train.steps=100``. Problems with the user's input
(config, data, checkpoints, workdir) print one line and exit with code 2.
"""

from __future__ import annotations

import re

from absl import app, flags, logging
from ml_collections import config_flags

from mopd_jax import config as config_lib
from mopd_jax import parallel, stages
from mopd_jax.errors import UserError, fail

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/pretrain.py or"
    " configs/pretrain.py:smoke.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Run directory: checkpoints, metrics, reports.")
flags.mark_flags_as_required(["config", "workdir"])

def main(argv) -> None:
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)  # keep library chatter off the bar
  try:
    config = config_lib.validate(_load_config())
    # Once per process, before anything touches a device.
    parallel.init_distributed(config.distributed)
    stages.run(config, _WORKDIR.value)
  except UserError as e:
    fail(str(e))
  except KeyboardInterrupt:
    fail("interrupted; the same command resumes from the last checkpoint")


def _flag_error(error: Exception, argv) -> str:
  """One line for an exception raised while parsing flags and overrides."""
  text = str(error)
  if "attribute 'get_config'" in text:
    return ("--config: the config file defines no get_config(variant)"
            " function")
  if isinstance(error, (AttributeError, KeyError)):  # unknown config field
    field = re.search(r"[A-Za-z_][A-Za-z0-9_]*", text)
    field = field.group() if field else "?"
    path = next((a.split("=", 1)[0][len("--config."):] for a in argv
                 if a.startswith("--config.") and a.split("=", 1)[0].endswith(
                     "." + field)), field)
    hint = re.search(r'Did you mean "([^"]+)"', text)
    return f"{path}: unknown field" + (
        f" (did you mean {hint.group(1)!r}?)" if hint else "")
  if "Traceback (most recent call last)" in text:
    # A config file's get_config raised: its message, without the trace.
    head = text.split(": Error whilst parsing config file", 1)[0]
    last = [l.strip() for l in text.splitlines() if l.strip()][-1]
    return f"{head}: {last}"
  return " ".join(text.split()) or type(error).__name__


def _parse_flags(argv):
  # Everything raised here comes from the command line or the config file
  # (unknown override, bad value, broken config file): one line, exit 2.
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    fail(_flag_error(e, argv))


def _load_config():
  """The config, or a UserError when its file could not be loaded (which
  ml_collections reports only on first access)."""
  try:
    config = _CONFIG.value
    _ = "method" in config  # the first access loads the file
    return config
  except OSError as e:
    last = [l.strip() for l in str(e).splitlines() if l.strip()][-1]
    raise UserError(f"--config: cannot load the config file: {last}") from None


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
