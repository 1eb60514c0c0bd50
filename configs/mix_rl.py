"""Mix RL: one GRPO run over the pooled prompts of every training domain.

    python -m mopd_jax.train --config=configs/mix_rl.py --config.init=runs/base \
        --workdir=runs/mix_rl [--config.data.weights='(2,1,1,1)'] \
        [--config.mixture.adaptive=True]

Batches are drawn by ``data.weights`` (uniform by default); with
``mixture.adaptive`` the proportions follow an upper-confidence bound on each
domain's mean |advantage|, floored at ``mixture.floor``. Variants: ``:smoke``,
``:hf`` (a Hugging Face checkpoint on accelerators: ``config.for_real_models``).
"""

from mopd_jax.config import defaults, for_real_models, shrink_for_smoke


def get_config(variant: str = ""):
  config = defaults("mix_rl")
  if variant == "smoke":
    shrink_for_smoke(config)
    config.rl.update(prompts_per_step=8, group_size=4, minibatches=2)
    config.mixture.adaptive = True
  elif variant == "hf":
    for_real_models(config)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/mix_rl.py")
  return config
