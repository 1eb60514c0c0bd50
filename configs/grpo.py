"""One domain expert: GRPO from the base model on one domain's prompts.

    python -m mopd_jax.train --config=configs/grpo.py --config.domain=add \
        --config.init=runs/base --workdir=runs/expert_add

Every field and its default lives in ``mopd_jax/config.py``. Variants:
``:smoke`` (seconds, for tests).
"""

from mopd_jax.config import defaults


def get_config(variant: str = ""):
  config = defaults("grpo")
  if variant == "smoke":
    config.rl.update(prompts_per_step=4, group_size=4, minibatches=2)
    config.train.update(steps=4, log_every=2, eval_every=0)
    config.checkpoint.update(every=2, keep=2)
    config.data.update(train_examples=64, test_examples=16)
    config.eval.update(num_prompts=8, batch_size=8)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of configs/grpo.py")
  return config
