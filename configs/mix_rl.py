"""Mix RL: one GRPO run over the pooled prompts of every training domain.

    python -m mopd_jax.train --config=configs/mix_rl.py --config.init=runs/base \
        --workdir=runs/mix_rl [--config.data.weights='(2,1,1,1)'] \
        [--config.mixture.adaptive=True]

Batches are drawn by ``data.weights`` (uniform by default); with
``mixture.adaptive`` the proportions follow an upper-confidence bound on each
domain's mean |advantage|, floored at ``mixture.floor``. Variants: ``:smoke``,
``:hf`` (a Hugging Face checkpoint on accelerators: ``mopd_jax.config.for_real_models``).
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("mix_rl", variant)
