"""The fusion study: base, experts, Merge, Mix RL, MOPD and Open-MOPD on
shared artefacts, every model evaluated, one report.

    python -m mopd_jax.train --config=configs/study.py --workdir=runs/study \
        [--config.steps='("merge","evaluate","report")'] \
        [--config.base=runs/base --config.experts='runs/expert_{domain}']
    # on your own data, from a base run (an imported checkpoint):
    python -m mopd_jax.train --config=configs/study.py --workdir=runs/mine \
        --config.base=runs/qwen3 \
        --config.domains="('math:gsm8k.jsonl','choice:mmlu.parquet')"

Each step is an ordinary run under the workdir (``base``,
``expert_<domain>``, ``merge_<method>``, ``mix_rl``, ``mopd``,
``open_mopd``); a re-run skips finished steps and resumes an interrupted
one. Writes ``results.json`` and ``report.md`` with figures. On file
domains every model is evaluated on those domains alone and the experts
live in ``expert_<kind>_<file stem>``. Variants:
``:smoke`` (every step's smoke config; under 2 minutes, for tests), ``:hf``
(every step's ``:hf`` config, from ``--config.base``: real checkpoints on
accelerators), ``:seeds`` (seeds 0, 1, 2: the base shared, everything else
once per seed in ``seed_<s>/``, the report with 95% intervals over seeds
and paired differences between paradigms), ``:smoke_seeds`` (two seeds at
smoke size), ``:beyond`` (the default study plus the MOPD variants:
the delta teacher, the three label-free token routers, MOPD from the
best merge; each reported against plain MOPD), ``:smoke_beyond`` (the
same at smoke size), ``:variants`` (the default study plus the
objectives of prefix source x KL direction, KL mixing, the entropy-gated
length curriculum and the TRB warm-up), ``:smoke_variants``,
``:imbalanced`` (Open-MOPD's misallocation: a long-derivation domain
beside a concise one, plain MOPD against each mechanism alone and all
three),
``:smoke_imbalanced``. Any seeds:
``--config.seeds='(0,1,2,3)'``.
"""

from mopd_jax.stages import recipe


def get_config(variant: str = ""):
  return recipe("study", variant)
