"""One domain expert: GRPO from the base model on one domain's prompts.

    python -m mopd_jax.train --config=configs/grpo.py --config.domain=add \
        --config.init=runs/base --workdir=runs/expert_add

The expert stops by measurement: at the first evaluation (every 25 steps)
where its domain's greedy validation accuracy has gained ``stop.gain`` =
20 points over the base, within ``train.steps`` = 300 (``stop.gain=0``: a
fixed step count); it stops only where a second draw of validation
prompts confirms the gain. Every field and its default lives in
``mopd_jax/stages/grpo.py`` (the shared sections in ``mopd_jax/config.py``).
Variants: ``:smoke`` (seconds, for tests),
``:hf`` (a Hugging Face checkpoint on accelerators: ``mopd_jax.config.for_real_models``).
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("grpo", variant)
