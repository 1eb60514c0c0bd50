"""Entry point: ``python -m mopd_jax.train --config=configs/<m>.py[:variant]``.

Overrides go as ``--config.train.steps=100``. Problems with the user's input
(config, data, checkpoints, workdir) print one line and exit with code 2.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from mopd_jax import cli, parallel, stages
from mopd_jax import config as config_lib
from mopd_jax.errors import UserError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/pretrain.py or"
    " configs/pretrain.py:smoke.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Run directory: checkpoints, metrics, reports.")
flags.mark_flags_as_required(["config", "workdir"])


def main() -> None:
  config = config_lib.validate(_load_config())
  # Once per process, before anything touches a device.
  parallel.init_distributed(config.distributed)
  stages.run(config, _WORKDIR.value)


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
  cli.run(main)
