"""GRPO: RLVR on one ``domain``, the expert of that domain, on the shared
on-policy loop (``stages/on_policy.py``); Mix RL (``stages/mix_rl.py``)
is the same method over pooled domains.

GRPO's part of a step: the verifiers' rewards become group advantages for
the clipped policy-gradient loss. An expert stops by measurement
(``stages/expert_stop.py``): once its domain's greedy validation accuracy
has gained ``stop.gain``.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from mopd_jax.config import DOMAIN_NAMES, non_negative, positive
from mopd_jax import config as config_lib
from mopd_jax.data import mixture
from mopd_jax.data.domains import is_domain
from mopd_jax.errors import ConfigError
from mopd_jax.objectives import grpo, policy
from mopd_jax.ops import vocab
from mopd_jax.stages import expert_stop, on_policy


def defaults() -> ml_collections.ConfigDict:
  """One ``domain``'s expert."""
  c = on_policy.defaults("grpo", steps=300)
  c.domain = "add"
  # Stop by measurement (stages/expert_stop.py): at the first evaluation
  # (every train.eval_every steps) where the domain's greedy accuracy on
  # stop.num_prompts validation prompts has gained ``gain`` over the
  # start; train.steps is then the limit. 0: off, train.steps steps.
  # confirm_prompts > 0: the gain must hold on that many other validation
  # prompts too (a second draw, looked at once the first has passed).
  # On the built-in base the experts stop at 75-250 steps
  # (docs/results.md).
  c.stop = ml_collections.ConfigDict(dict(gain=0.2, num_prompts=128,
                                          confirm_prompts=128))
  c.train.eval_every = 25
  return c


CHECKS = (
    *on_policy.CHECKS,
    ("domain", is_domain, "one of " + DOMAIN_NAMES),
    ("stop.gain", config_lib.is_fraction, "in [0, 1] (0: off)"),
    ("stop.num_prompts", positive, "> 0"),
    ("stop.confirm_prompts", non_negative, ">= 0 (0: no second draw)"),
)


def validate(full) -> None:
  on_policy.validate(full)
  if full.stop.gain > 0 and full.train.eval_every <= 0:
    raise ConfigError("train.eval_every: stop.gain needs a validation"
                      " evaluation every N > 0 steps")
  drawn = full.stop.num_prompts + full.stop.confirm_prompts
  if (full.stop.gain > 0 and full.stop.confirm_prompts
      and drawn > full.data.test_examples):
    raise ConfigError(f"stop.confirm_prompts: the two validation draws"
                      f" ({full.stop.num_prompts} + "
                      f"{full.stop.confirm_prompts}) exceed the"
                      f" {full.data.test_examples} validation prompts"
                      " (data.test_examples)")


VARIANTS = ("smoke", "hf")
# an expert's rollouts at smoke size (CoPD's experts take them too)
SMOKE_RL = dict(prompts_per_step=4, group_size=4, minibatches=2)


def recipe(config, variant: str) -> None:
  if variant == "smoke":
    config_lib.shrink_for_smoke(config)
    config.rl.update(SMOKE_RL)
    config.stop.gain = 0.0  # 4 steps: no target to reach
    config.stop.confirm_prompts = 8  # its 16 validation prompts: 8 + 8


def make_loss(model_cfg, sampling, rl, ops):
  """Minibatch loss: clipped PG (+ beta KL to the reference), aggregated;
  ``ops``: options of the fused vocabulary ops."""

  def loss_fn(params, mb):
    stats = policy.student_positions(params, model_cfg, mb,
                                     sampling.temperature, ops)
    per_token, clipped = grpo.clipped_policy_loss(
        stats["logp"], mb["old_logp"], mb["advantages"], rl.eps_low,
        rl.eps_high, rl.dual_clip, mb.get("behaviour_logp"), rl.tis_cap)
    return policy.aggregate_loss(per_token, clipped, stats, mb, rl,
                                 sampling.max_new_tokens)

  return loss_fn


class GRPO:
  """The ``on_policy.Method`` of experts and Mix RL: prompts of ``names``
  drawn by ``weights`` (empty: uniform), or by the adaptive ``mixture``
  section when given."""

  shared = ()

  def __init__(self, config, names, weights=(), adaptive=None):
    self.config = config
    self.names = names
    self.base = mixture.base_weights(names, weights)
    self.adaptive = adaptive is not None
    self.explore, self.floor = ((adaptive.exploration, adaptive.floor)
                                if adaptive else (0.0, 0.0))
    self.momentum = adaptive.momentum if adaptive else 0.0

  def init_state(self) -> dict:
    return {"mixture": mixture.init_state(len(self.names))}

  def proportions(self, state) -> np.ndarray:
    return mixture.proportions(self.base, state["mixture"], self.adaptive,
                               self.explore, self.floor)

  def signal(self, state, data, seq_ids) -> None:
    """The verifiers' rewards, already in ``data["advantages"]``."""

  def weigh(self, state, data, seq_ids):
    return {}, None

  def behaviour(self, state, step):
    return None, 0  # the policy samples, the whole budget

  def metrics(self, state, new_state, ids, data, informative, notes,
              trained):
    """The mixture follows each group's mean |advantage|; advantage
    statistics."""
    rl = self.config.rl
    advantages = data["advantages"]
    group_signal = np.abs(advantages).reshape(-1, rl.group_size).mean(1)
    updates = {"mixture": mixture.update_state(state["mixture"], ids,
                                               group_signal, self.momentum)}
    return updates, {
        "advantage_abs": (np.abs(advantages).sum(), len(advantages)),
        "advantage_std": (float(np.std(advantages)), 1.0),
        "informative_groups": (informative.sum() / rl.group_size,
                               rl.prompts_per_step),
    }


def method_maker(method):
  """``on_policy.run``'s ``make_method`` for a ``GRPO`` built by
  ``method(config)``."""

  def make_method(config, tokenizer, model_cfg, mesh, sampling):
    del tokenizer, mesh
    loss = make_loss(model_cfg, sampling, config.rl,
                     vocab.VocabOps.of(config.ops))
    return method(config), loss, config.rl.beta > 0

  return make_method


make_method = method_maker(lambda c: GRPO(c, (c.domain,)))


def run(config, workdir: str):
  """Train ``config.domain``'s expert; returns the final state."""
  stopper = expert_stop.gain_stop if config.stop.gain else None
  return on_policy.run(config, workdir, (config.domain,), make_method,
                       f"grpo[{config.domain}]", stopper=stopper)
