"""Base model: supervised training on every built-in domain's demonstrations.

Every field and its default lives in ``mopd_jax/config.py``; this file sets
what the base run changes. Variants: ``:smoke`` (seconds, for tests).
"""

from mopd_jax.config import defaults, shrink_for_smoke


def get_config(variant: str = ""):
  config = defaults("pretrain")
  # The base must stay partially competent (room for RL). Arithmetic appears
  # abruptly at a seed-dependent step, so the learning rate stays constant
  # until a cool-down of the last 150 steps: the cool-down's start, read off
  # one constant-rate run, sets how far each skill has come (README, base).
  config.seed = 1
  config.data.weights = (1.0, 1.0, 0.5, 0.5, 1.5)
  config.train.steps = 450
  config.optim.decay_steps = 150
  if variant == "smoke":
    shrink_for_smoke(config)
    config.model.update(embed_dim=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64)
    config.train.batch_size = 8
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/pretrain.py")
  return config
