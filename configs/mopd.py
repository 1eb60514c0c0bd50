"""MOPD: distil one expert per domain into the student on its own rollouts.

    python -m mopd_jax.train --config=configs/mopd.py --config.init=runs/base \
        --config.teachers='runs/expert_{domain}' --workdir=runs/mopd

``teachers`` is a template with ``{domain}`` or ``domain=dir`` pairs
separated by commas. The loss is ``opd.loss`` (pg | topk | kl); the
Open-MOPD mechanisms are switched on in ``open_mopd`` (``token_share``,
``gap_budget``, ``reward_refresh``). Variants: ``:open`` (all three on,
with the tempered balancing and per-sequence gap that measured better
together than the exact ones: see docs/history.md, Open-MOPD ablation), ``:smoke``
(seconds, for tests), ``:hf`` (a Hugging Face checkpoint on accelerators:
``mopd_jax.config.for_real_models``).
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("mopd", variant)
