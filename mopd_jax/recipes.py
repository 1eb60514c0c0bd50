"""Every method's variants, in the package: ``recipe(method, variant)``.

``configs/<method>.py`` are thin ``get_config(variant)`` files over this
(the command line loads a config file, ``--config=configs/grpo.py:smoke``),
and the study builds its steps from here, so an installed package (a
wheel, a non-editable install) runs every method and the study without
the repository's ``configs/`` folder. The variants:

* ``""``: the method's recipe on the built-in domains;
* ``smoke``: seconds on a CPU, for tests (``config.shrink_for_smoke``);
* ``hf``: a Hugging Face checkpoint on accelerators
  (``config.for_real_models``);
* ``open`` (MOPD): the Open-MOPD mechanisms, the ablation's best setting.
"""

from __future__ import annotations

from typing import Callable

import ml_collections

from mopd_jax.config import defaults, for_real_models, shrink_for_smoke


def _pretrain(config, variant: str) -> None:
  # The base must stay partially competent (room for RL), and skills appear
  # abruptly at a step that moves with the seed and with the machine's float
  # rounding. So the base is chosen by measurement: at a constant rate, the
  # first checkpoint (every 25 steps) where every training domain reaches
  # 25% greedy on its validation split; up to 3000 steps (runs so far
  # stopped between 775 and 1700, docs/base.md).
  config.data.weights = (1.0, 1.0, 0.5, 0.5, 1.5)
  config.train.update(steps=3000, eval_every=25)
  config.optim.end_lr_fraction = 1.0
  config.select.update(target=0.25, ceiling=0.6)
  config.checkpoint.every = 100
  if variant == "smoke":
    shrink_for_smoke(config)
    config.select.target = 0.0  # a 4-step model reaches nothing
    config.model.update(embed_dim=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64)
    config.train.batch_size = 8


def _grpo(config, variant: str) -> None:
  if variant == "smoke":
    shrink_for_smoke(config)
    config.rl.update(prompts_per_step=4, group_size=4, minibatches=2)
    config.stop.gain = 0.0  # 4 steps: no target to reach


def _mix_rl(config, variant: str) -> None:
  if variant == "smoke":
    shrink_for_smoke(config)
    config.rl.update(prompts_per_step=8, group_size=4, minibatches=2)
    config.mixture.adaptive = True


def _mopd(config, variant: str) -> None:
  if variant == "open":
    config.open_mopd.update(token_share=True, gap_budget=True,
                            reward_refresh=True, token_share_power=0.5,
                            gap_statistic="sequence_kl")
  elif variant == "smoke":
    shrink_for_smoke(config)
    config.rl.update(prompts_per_step=8, group_size=2, minibatches=2)


def _merge(config, variant: str) -> None:
  if variant == "smoke":
    config.data.update(train_examples=64, test_examples=16)
    config.eval.update(num_prompts=8, batch_size=8)
    config.merge.update(sweep_lambdas=(0.5, 1.0), sweep_densities=(0.5,),
                        sweep_prompts=8)


# study variant -> the MOPD variants it adds (stages/study.py:MOPD_VARIANTS)
STUDY_ADDITIONS = {
    "beyond": ("mopd_delta", "mopd_entropy", "mopd_novelty", "mopd_align",
               "mopd_from_merge"),
    "variants": ("mopd_forward", "mopd_mixed", "mopd_teacher_reverse",
                 "mopd_teacher_forward", "mopd_curriculum", "mopd_trb"),
}


def _study(config, variant: str) -> None:
  if variant.startswith("smoke"):
    config.variant = "smoke"
    config.merge_methods = ("ties",)
    for name in config.overrides:  # the smoke configs' own sizes
      config.overrides[name] = ()
    config.eval.update(num_prompts=8, samples=2, coverage_prompts=4)
  added = next((steps for name, steps in STUDY_ADDITIONS.items()
                if variant.endswith(name)), ())
  if added:  # MOPD variants beside plain MOPD, before the evaluations
    at = config.steps.index("evaluate")
    config.steps = config.steps[:at] + added + config.steps[at:]
  if variant == "seeds":
    config.update(seeds=(0, 1, 2), seed_processes=2)  # a 2-core CPU
  elif variant == "smoke_seeds":
    config.seeds = (0, 1)
  elif variant == "hf":
    config.variant = "hf"
    config.mesh.update(data=1, fsdp=-1)


# method -> (its variants' changes, the variants it has)
RECIPES: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "pretrain": (_pretrain, ("smoke",)),
    "grpo": (_grpo, ("smoke", "hf")),
    "mix_rl": (_mix_rl, ("smoke", "hf")),
    "mopd": (_mopd, ("open", "smoke", "hf")),
    "merge": (_merge, ("smoke", "hf")),
    "study": (_study, ("smoke", "hf", "seeds", "smoke_seeds", "beyond",
                       "smoke_beyond", "variants", "smoke_variants")),
}


def recipe(method: str, variant: str = "") -> ml_collections.ConfigDict:
  """``configs/<method>.py:<variant>``: the method's defaults with its
  recipe and the variant's changes."""
  change, variants = RECIPES[method]
  if variant and variant not in variants:
    raise ValueError(f"unknown variant {variant!r} of configs/{method}.py"
                     f" (known: {', '.join(variants)})")
  config = defaults(method)
  change(config, variant)
  if variant == "hf" and method != "study":
    for_real_models(config)
  return config
