"""CoPD: co-evolving experts, each one's RLVR with the others as teachers.

Instead of training the experts apart and distilling afterwards, one
expert per domain of ``data.domains`` trains from the base ``init`` in
turn, one step each (round-robin, in one process), and each one's loss
adds a reverse KL toward the other experts as they are now, on its own
rollouts. For expert ``i`` with GRPO's clipped surrogate ``L_GRPO``:

    L_i = L_GRPO + beta / (J - 1) * sum_{j != i} KL(pi_i || pi_j)
        = L_GRPO + beta * KL(pi_i || G_i) + const,
    G_i(y) = prod_{j != i} pi_j(y)^(1/(J-1)) / Z

(``const = -beta log Z`` has no gradient), so the term is ``rl.beta``'s KL
to a reference whose log-prob of each sampled token is the mean of the
other experts'. Its estimator on the expert's own samples is ``k2``,
``(log pi_i(y) - ref(y))^2 / 2``, whose expected gradient
``E_{pi_i}[(log pi_i - ref) grad log pi_i]`` is the reverse KL's (``log Z``
drops out: ``E[grad log pi_i] = 0``); ``k3``'s would be ``-sum_y
exp(ref(y)) grad log pi_i(y)``, the forward KL's, and ``k1``'s is zero in
expectation, so ``rl.kl_estimator`` must be ``k2`` (tested against numpy).
The experts are each other's teachers: they stay close while
each keeps its own domain's gain, so a merge of them interferes less, or a
short MOPD of them has less to bridge. A round (every expert one step) is
one step of the loop: the experts' states are saved together, and a run
resumes exactly. At the end each expert is written as an ordinary finished
run, ``<workdir>/expert_<domain>``, with its evaluation: any later run's
expert or teacher (the consolidation: a merge or MOPD of them).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mopd_jax import config as config_lib
from mopd_jax import parallel, runs, training
from mopd_jax.checkpointing import Checkpointer
from mopd_jax.data import files, splits
from mopd_jax.data.domains import TRAIN_DOMAINS, completion_budget
from mopd_jax.errors import ConfigError
from mopd_jax.evaluation import evaluator
from mopd_jax.ops import vocab
from mopd_jax.rollout.sampler import SamplingConfig
from mopd_jax.stages import grpo, on_policy


def defaults() -> ml_collections.ConfigDict:
  """One expert per domain of ``data.domains``, co-evolved for
  ``train.steps`` rounds; ``rl.beta`` weighs the KL to the others."""
  c = on_policy.defaults("copd", steps=150)
  c.data.domains = TRAIN_DOMAINS
  c.rl.update(beta=0.05, kl_estimator="k2")
  c.train.eval_every = 25
  return c


CHECKS = on_policy.CHECKS


def validate(full) -> None:
  on_policy.validate(full)
  domains = full.data.domains
  if len(domains) < 2 or len(set(domains)) < len(domains):
    raise ConfigError("data.domains: co-evolving experts need at least two"
                      f" distinct domains, got {tuple(domains)}")
  if full.rl.kl_estimator != "k2":
    raise ConfigError("rl.kl_estimator: k2, whose gradient on the experts'"
                      " own samples is the reverse KL's (k3's is the forward"
                      f" KL's, k1's zero), got {full.rl.kl_estimator!r}")
  if full.rl.beta <= 0:
    raise ConfigError("rl.beta: the weight of the KL to the other experts"
                      " must be > 0 (0 is training the experts apart: grpo)")
  if full.rl.max_policy_lag:
    raise ConfigError("rl.max_policy_lag: co-evolving experts sample"
                      " synchronously")


VARIANTS = grpo.VARIANTS


def recipe(config, variant: str) -> None:
  if variant == "smoke":
    config_lib.shrink_for_smoke(config)
    config.rl.update(grpo.SMOKE_RL)


def expert_dir(workdir: str, domain: str) -> str:
  return os.path.join(workdir, f"expert_{files.label(domain)}")


class CoEvolving(grpo.GRPO):
  """Expert ``domain``'s ``on_policy.Method``: GRPO, with the reference
  log-probs of its rollouts the mean of the other experts' (read from
  ``others()``, their current parameters)."""

  def __init__(self, config, domain, others, logprobs):
    super().__init__(config, (domain,))
    self.others, self.logprobs = others, logprobs

  def signal(self, state, data, seq_ids) -> None:
    """``ref_logp = mean_{j != i} log pi_j(y_t)``: the log-prob of each
    sampled token under the others' geometric mean, up to its norm."""
    data["ref_logp"] = np.mean([self.logprobs(p, data)
                                for p in self.others()], axis=0)


def run(config, workdir: str):
  """Co-evolve the experts; returns the final combined state."""
  tokenizer, model_cfg, mesh = runs.setup(config)
  names = tuple(config.data.domains)
  on_policy.check_mesh(mesh, config.rl)
  params = runs.load_params(config.init, model_cfg, mesh)
  optimizer = training.make_optimizer(config.optim, config.train.steps)
  ops = vocab.VocabOps.of(config.ops)
  # the experts' parameters under "params" (what the loop's summary and
  # evaluations read), the rest of each one's state under "experts"
  state = {"step": np.asarray(0, np.int32), "params": {}, "experts": {}}
  contexts, methods = {}, {}
  current = {}  # each expert's parameters as they are now

  for d in names:
    sampling = SamplingConfig.of(config.sampling, tokenizer,
                                 max_new_tokens=completion_budget(
                                     (d,), config.sampling.max_new_tokens))
    rollouts = on_policy.Rollouts(config, tokenizer, model_cfg, mesh, (d,),
                                  sampling)
    methods[d] = CoEvolving(
        config, d, lambda d=d: [current[e] for e in names if e != d],
        rollouts.logprobs)
    loss = grpo.make_loss(model_cfg, sampling, config.rl, ops)
    contexts[d] = on_policy.Context(config, mesh, rollouts,
                                    on_policy.make_update(loss, optimizer),
                                    None)
    with parallel.activate(mesh):
      # a copy each: every expert's buffers are donated to its updates
      own = training.init_state(jax.tree.map(jnp.copy, params), optimizer)
    own.update(methods[d].init_state())
    state["params"][d] = own.pop("params")
    state["experts"][d] = own
  del params

  def step_fn(state, step):
    """One round: every expert one step, in order, against the others as
    they are then. Metrics per expert (``<name>/<domain>``; the per-domain
    ones already are), the loss and skipped updates summed over them."""
    params, experts, pairs = dict(state["params"]), dict(state["experts"]), {}
    for d in names:
      current.update(params)
      mine, metrics = on_policy.step(
          contexts[d], methods[d], dict(experts[d], params=params[d]), step)
      params[d] = mine.pop("params")
      experts[d] = mine
      # the loss, skipped updates and response length over every expert
      # (the last is what a run's cost reads)
      pairs = training.accumulate(pairs, {
          k: metrics[k] for k in ("loss", training.SKIPPED, "response_length")
          if k in metrics})
      pairs.update({k if "/" in k else f"{k}/{d}": v
                    for k, v in metrics.items()})
    return dict(state, step=state["step"] + 1, params=params,
                experts=experts), pairs

  test_sets = splits.eval_sets(config, config.eval.domains)
  evals = {d: evaluator.make_eval_fn(config, model_cfg, tokenizer,
                                     {d: test_sets[d]}, mesh)
           for d in names if d in test_sets}

  def eval_fn(state, step):
    """Each expert on its own domain."""
    scalars = {}
    for d, fn in evals.items():
      scalars.update(fn({"params": state["params"][d]}, step))
    return scalars

  state = training.run_loop(workdir, state, step_fn, config.train.steps,
                            config.checkpoint, config.train, eval_fn,
                            desc="copd")
  write_experts(config, workdir, state["params"], model_cfg, tokenizer, mesh)
  return state


def write_experts(config, workdir: str, params: dict, model_cfg, tokenizer,
                  mesh) -> None:
  """Each co-evolved expert as an ordinary finished run in
  ``expert_<domain>``: its config, a checkpoint of its parameters, its
  evaluation on ``eval.domains`` and its summary (once: a finished one is
  kept)."""
  test_sets = splits.eval_sets(config, config.eval.domains)
  for d, expert in params.items():
    path = expert_dir(workdir, d)
    if runs.finished(path):
      continue
    os.makedirs(path, exist_ok=True)
    runs.save_run_config(config, path)
    ckpt = Checkpointer(path, every=1, keep=1)
    try:
      if config.train.steps not in ckpt.all_steps():
        ckpt.save(config.train.steps, {"params": expert}, force=True)
    finally:
      ckpt.close()
    evaluator.make_eval_fn(config, model_cfg, tokenizer, test_sets, mesh,
                           runs.write_eval(path, config.train.steps))(
                               {"params": expert}, config.train.steps)
    training.write_summary(path, config.train.steps, expert, domain=d)

