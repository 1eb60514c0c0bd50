"""Merge: the experts' task vectors combined into one model, no training.

    python -m mopd_jax.train --config=configs/merge.py --config.init=runs/base \
        --config.experts='runs/expert_{domain}' --config.merge.method=ties \
        --workdir=runs/merge_ties [--config.merge.sweep=True]

``experts`` is a template with ``{domain}`` or ``domain=dir`` pairs (one
run per domain of ``data.domains``). Methods: ``merge.method`` (linear,
task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs,
breadcrumbs_ties, model_stock, slerp, karcher, sparse_union), with
mergekit's parameters (``lambda``, ``density``, ``gamma``, ``t``,
``weights``, ``normalize``); ``merge.overrides`` sets them per parameter
by name pattern. ``merge.sweep`` chooses ``lambda`` (and ``density``) on
the validation split. Variants: ``:smoke`` (seconds, for tests),
``:hf`` (a Hugging Face checkpoint on accelerators: ``mopd_jax.config.for_real_models``).
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("merge", variant)
