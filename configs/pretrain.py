"""Base model: supervised training on every built-in domain's demonstrations,
stopped when every training domain reaches a validation target.

Every field and its default lives in ``mopd_jax/config.py``; this file sets
what the base run changes. Variants: ``:smoke`` (seconds, for tests).
"""

from mopd_jax.config import defaults, shrink_for_smoke


def get_config(variant: str = ""):
  config = defaults("pretrain")
  # The base must stay partially competent (room for RL), and skills appear
  # abruptly at a step that moves with the seed and with the machine's float
  # rounding. So the base is chosen by measurement: at a constant rate, the
  # first checkpoint (every 25 steps) where every training domain reaches
  # 25% greedy on its validation split; up to 3000 steps (runs so far
  # stopped between 775 and 1700, docs/base.md).
  config.data.weights = (1.0, 1.0, 0.5, 0.5, 1.5)
  config.train.update(steps=3000, eval_every=25)
  config.optim.end_lr_fraction = 1.0
  config.select.update(target=0.25, ceiling=0.6)
  config.checkpoint.every = 100
  if variant == "smoke":
    shrink_for_smoke(config)
    config.select.target = 0.0  # a 4-step model reaches nothing
    config.model.update(embed_dim=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64)
    config.train.batch_size = 8
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/pretrain.py")
  return config
