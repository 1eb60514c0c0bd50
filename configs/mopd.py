"""MOPD: distil one expert per domain into the student on its own rollouts.

    python -m mopd_jax.train --config=configs/mopd.py --config.init=runs/base \
        --config.teachers='runs/expert_{domain}' --workdir=runs/mopd

``teachers`` is a template with ``{domain}`` or ``domain=dir`` pairs
separated by commas. The loss is ``opd.loss`` (pg | topk | kl); the
Open-MOPD mechanisms are switched on in ``open_mopd`` (``token_share``,
``gap_budget``, ``reward_refresh``). Variants: ``:open`` (all three on,
with the tempered balancing and per-sequence gap that measured better
together than the exact ones: see README, Open-MOPD ablation), ``:smoke``
(seconds, for tests), ``:hf`` (a Hugging Face checkpoint on accelerators:
``config.for_real_models``).
"""

from mopd_jax.config import defaults, for_real_models, shrink_for_smoke


def get_config(variant: str = ""):
  config = defaults("mopd")
  if variant == "open":
    config.open_mopd.update(token_share=True, gap_budget=True,
                            reward_refresh=True, token_share_power=0.5,
                            gap_statistic="sequence_kl")
  elif variant == "smoke":
    shrink_for_smoke(config)
    config.rl.update(prompts_per_step=8, group_size=2, minibatches=2)
  elif variant == "hf":
    for_real_models(config)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/mopd.py")
  return config
