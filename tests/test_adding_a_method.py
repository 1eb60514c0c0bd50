"""docs/architecture.md's worked example stays true: its method module,
loaded from the document and registered in ``stages.METHODS``, is a
method like the others (defaults, checks, variants, its config file's
shape)."""

from __future__ import annotations

import os
import re
import sys
import types

import pytest
from conftest import ROOT

from mopd_jax import stages
from mopd_jax.errors import ConfigError


def _blocks() -> dict[str, str]:
  """The document's python blocks, by the file named in their first
  line."""
  with open(os.path.join(ROOT, "docs", "architecture.md"),
            encoding="utf-8") as f:
    text = f.read()
  found = {}
  for body in re.findall(r"```python\n(.*?)```", text, re.S):
    first, _, rest = body.partition("\n")
    found[first.removeprefix("# ").strip()] = rest
  return found


@pytest.fixture
def registered(monkeypatch):
  module = types.ModuleType("mopd_jax.stages.mix_rl_kl")
  exec(_blocks()["mopd_jax/stages/mix_rl_kl.py"], module.__dict__)
  monkeypatch.setitem(sys.modules, module.__name__, module)
  monkeypatch.setitem(stages.METHODS, "mix_rl_kl", module.__name__)
  return module


def test_the_worked_example_is_a_method(registered):
  config = stages.recipe("mix_rl_kl", "smoke")
  config.init = "runs/base"
  full = stages.validate(config)
  assert full.method == "mix_rl_kl" and full.rl.beta == 0.04
  mix_rl = stages.validate(_with_init(stages.recipe("mix_rl", "smoke")))
  # only the method's name and its KL weight differ from Mix RL's
  differ = {k for k in full.keys() if full[k] != mix_rl[k]}
  assert differ == {"method", "rl"}
  assert {k for k in full.rl.keys() if full.rl[k] != mix_rl.rl[k]} == {"beta"}
  config.rl.beta = 0.0
  with pytest.raises(ConfigError, match="rl.beta: must be > 0"):
    stages.validate(config)
  get_config = {}
  exec(_blocks()["configs/mix_rl_kl.py"], get_config)
  assert get_config["get_config"]("smoke").rl.beta == 0.04


def _with_init(config):
  config.init = "runs/base"
  return config
