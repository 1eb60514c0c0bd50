"""Base model: supervised training on every built-in domain's demonstrations,
stopped when every training domain reaches a validation target.

Every field and its default lives in ``mopd_jax/stages/pretrain.py`` (the
shared sections in ``mopd_jax/config.py``), with the recipe of the base.
Variants: ``:smoke`` (seconds, for tests).
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("pretrain", variant)
