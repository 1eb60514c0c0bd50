"""CoPD: one expert per domain, co-evolved from the base, each one's RLVR
with a reverse KL toward the others (``rl.beta``), round-robin.

    python -m mopd_jax.train --config=configs/copd.py --config.init=runs/base \
        --workdir=runs/copd

Writes ``<workdir>/expert_<domain>`` runs, the experts of a merge or the
teachers of MOPD. Variants: ``:smoke`` (seconds, for tests), ``:hf``.
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("copd", variant)
