"""Entry point: ``python -m mopd_jax.train --config=configs/<m>.py[:variant]``.

Overrides go as ``--config.train.steps=100``. Problems with the user's input
(config, data, checkpoints, workdir) print one line and exit with code 2.
"""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags

from mopd_jax import cli, parallel, stages

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file, e.g. configs/pretrain.py or"
    " configs/pretrain.py:smoke.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Run directory: checkpoints, metrics, reports.")
flags.mark_flags_as_required(["config", "workdir"])


def main() -> None:
  config = stages.validate(cli.config_value(_CONFIG, "config"))
  # Once per process, before anything touches a device.
  parallel.use_cpu_devices(config.mesh.cpu_devices)
  parallel.init_distributed(config.distributed)
  stages.run(config, _WORKDIR.value)


if __name__ == "__main__":
  cli.run(main)
