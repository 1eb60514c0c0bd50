"""One domain expert: GRPO from the base model on one domain's prompts.

    python -m mopd_jax.train --config=configs/grpo.py --config.domain=add \
        --config.init=runs/base --workdir=runs/expert_add

Every field and its default lives in ``mopd_jax/config.py``. Variants:
``:smoke`` (seconds, for tests).
"""

from mopd_jax.config import defaults, shrink_for_smoke


def get_config(variant: str = ""):
  config = defaults("grpo")
  if variant == "smoke":
    shrink_for_smoke(config)
    config.rl.update(prompts_per_step=4, group_size=4, minibatches=2)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/grpo.py")
  return config
