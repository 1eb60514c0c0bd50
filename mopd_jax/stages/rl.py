"""RLVR with the GRPO family: one domain's expert (``grpo``) or one run over
the pooled domains (``mix_rl``, proportions fixed or adaptive), on the
shared on-policy loop (``stages/on_policy.py``).

GRPO's part of a step: the verifiers' rewards become group advantages for
the clipped policy-gradient loss; Mix RL's adaptive mixture follows each
domain's mean |advantage|.
"""

from __future__ import annotations

import numpy as np

from mopd_jax import config as config_lib
from mopd_jax.data import mixture
from mopd_jax.objectives import grpo, policy
from mopd_jax.stages import expert_stop, on_policy


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
  """The ``on_policy.Method`` of experts and Mix RL."""

  shared = ()

  def __init__(self, config):
    self.config = config
    self.names = on_policy.domains(config)
    self.base = mixture.base_weights(self.names, (
        () if config.method == "grpo" else config.data.weights))
    adaptive = config.method == "mix_rl" and config.mixture.adaptive
    self.adaptive = adaptive
    self.explore, self.floor = ((config.mixture.exploration,
                                 config.mixture.floor)
                                if adaptive else (0.0, 0.0))
    self.momentum = config.mixture.momentum if adaptive else 0.0

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


def make_method(config, tokenizer, model_cfg, mesh, sampling):
  del tokenizer, mesh
  loss = make_loss(model_cfg, sampling, config.rl,
                   config_lib.op_options(config))
  return GRPO(config), loss, config.rl.beta > 0


def run(config, workdir: str):
  """Train an expert (``grpo``) or the Mix RL model; returns the state."""
  desc = (config.method if config.method != "grpo"
          else f"grpo[{config.domain}]")
  stopper = (expert_stop.gain_stop if config.method == "grpo"
             and config.stop.gain else None)
  return on_policy.run(config, workdir, make_method, desc, stopper=stopper)
