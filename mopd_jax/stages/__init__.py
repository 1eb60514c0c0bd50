"""The methods, one module each, and how a config becomes a run.

``METHODS`` is the one table a new method enters: method -> its module,
which owns everything about it:

* ``defaults()``: its complete default config (the shared sections from
  ``mopd_jax.config``, its own beside them);
* ``CHECKS``: its check table (the shared sections' tables and its own
  fields'), and optionally ``validate(full)``: its cross-field checks;
* ``VARIANTS`` and ``recipe(config, variant)``: what ``configs/<method>.py``
  and each ``:variant`` change (``""``: the recipe itself);
* ``run(config, workdir)``, and optionally ``check(config)``: the runs it
  reads, checked before anything is written.

``defaults``, ``validate`` and ``recipe`` read the table; ``run`` runs a
validated config (a study runs its steps through it, in process).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import jax
import ml_collections

from mopd_jax import config as config_lib
from mopd_jax import parallel
from mopd_jax.errors import ConfigError, UserError
from mopd_jax.runs import (check_resumable, locked, resolve_model,
                           save_run_config)

METHODS = {"pretrain": "mopd_jax.stages.pretrain",
           "grpo": "mopd_jax.stages.grpo",
           "mix_rl": "mopd_jax.stages.mix_rl",
           "mopd": "mopd_jax.stages.mopd",
           "copd": "mopd_jax.stages.copd",
           "merge": "mopd_jax.stages.merge",
           "study": "mopd_jax.stages.study"}


def method(name: str) -> ModuleType:
  """The module of method ``name``."""
  if name not in METHODS:
    raise ConfigError(f"method: unknown method {name!r}; known: "
                      + ", ".join(METHODS))
  return importlib.import_module(METHODS[name])


def defaults(name: str) -> ml_collections.ConfigDict:
  """The complete default config of method ``name`` (its module's
  ``defaults()``: ``pretrain`` builds a ``model``; every other method
  starts from the run in ``init`` and takes its architecture from
  there)."""
  return method(name).defaults()


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` checked against its method's defaults, check table and
  cross-field checks; returns the complete config (the defaults of any
  field it left out)."""
  if "method" not in config:
    raise ConfigError("method: missing; known: " + ", ".join(METHODS))
  module = method(config.method)
  cross = (module.validate,) if hasattr(module, "validate") else ()
  return config_lib.check(module.defaults(), config, module.CHECKS, cross)


def recipe(name: str, variant: str = "") -> ml_collections.ConfigDict:
  """``configs/<name>.py:<variant>``: the method's defaults with its
  recipe and the variant's changes; ``hf`` (a Hugging Face checkpoint on
  accelerators) adds ``config.for_real_models`` to every run method's."""
  module = method(name)
  if variant and variant not in module.VARIANTS:
    raise ValueError(f"unknown variant {variant!r} of configs/{name}.py"
                     f" (known: {', '.join(module.VARIANTS)})")
  config = module.defaults()
  module.recipe(config, variant)
  if variant == "hf" and name != "study":
    config_lib.for_real_models(config)
  return config


def prepare_workdir(workdir: str) -> str:
  """Create ``workdir`` if needed and check that it can be written."""
  if not workdir.strip():
    raise UserError("workdir: empty; name the run directory")
  path = os.path.abspath(os.path.expanduser(workdir))
  try:
    os.makedirs(path, exist_ok=True)
    # Per process: the hosts of a multi-host run may share the workdir.
    probe = os.path.join(path, f".write_test.{jax.process_index()}")
    with open(probe, "w", encoding="utf-8"):
      pass
    os.remove(probe)
  except OSError as e:
    raise UserError(f"workdir {path}: not writable ({e.strerror})") from None
  return path


def run(config, workdir: str):
  """Run the validated ``config`` into ``workdir``: its method's checks of
  the runs it reads, then, holding the workdir's lock, the resume checks,
  ``config.json`` and the method itself."""
  resolve_model(config)
  module = method(config.method)
  if hasattr(module, "check"):  # the runs it reads, before any writing
    module.check(config)
  workdir = prepare_workdir(workdir)
  with locked(workdir):  # one writer at a time
    check_resumable(config, workdir)
    save_run_config(config, workdir)
    with parallel.use_rules(config.mesh.rules):
      return module.run(config, workdir)
