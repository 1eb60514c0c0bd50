"""Mix RL: GRPO on the pooled ``data.domains``, one run over every domain,
drawn by ``data.weights`` or by the adaptive ``mixture`` (each domain's
share follows its mean |advantage|, ``data/mixture.py``)."""

from __future__ import annotations

import ml_collections

from mopd_jax import config as config_lib
from mopd_jax.config import non_negative
from mopd_jax.data.domains import TRAIN_DOMAINS
from mopd_jax.errors import ConfigError
from mopd_jax.stages import grpo, on_policy


def defaults() -> ml_collections.ConfigDict:
  """GRPO on the pooled ``data.domains``. 800 steps: where every built-in
  expert of the earlier fixed recipe had gained over 20 greedy points
  (docs/history.md)."""
  c = on_policy.defaults("mix_rl", steps=800)
  c.data.domains = TRAIN_DOMAINS
  c.data.weights = ()  # empty: uniform over domains
  c.mixture = ml_collections.ConfigDict(dict(
      adaptive=False, exploration=0.5, floor=0.05, momentum=0.9))
  return c


CHECKS = (
    *on_policy.CHECKS,
    ("mixture.exploration", non_negative, ">= 0"),
    ("mixture.floor", non_negative, ">= 0"),
    ("mixture.momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
)


def validate(full) -> None:
  on_policy.validate(full)
  if full.mixture.floor * len(full.data.domains) >= 1:
    raise ConfigError(f"mixture.floor: {full.mixture.floor} times"
                      f" {len(full.data.domains)} domains must be < 1")


VARIANTS = ("smoke", "hf")


def recipe(config, variant: str) -> None:
  if variant == "smoke":
    config_lib.shrink_for_smoke(config)
    config.rl.update(prompts_per_step=8, group_size=4, minibatches=2)
    config.mixture.adaptive = True


make_method = grpo.method_maker(lambda c: grpo.GRPO(
    c, tuple(c.data.domains), c.data.weights,
    c.mixture if c.mixture.adaptive else None))


def run(config, workdir: str):
  """Train the Mix RL model; returns the final state."""
  return on_policy.run(config, workdir, tuple(config.data.domains),
                       make_method, "mix_rl")
