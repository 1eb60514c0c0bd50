"""The on-policy loop that GRPO, Mix RL and MOPD share.

One step (``step``, a module-level function the tests call directly):
draw ``rl.prompts_per_step`` prompts by the method's domain proportions,
sample ``rl.group_size`` completions each, grade them with the domains'
verifiers, let the method add its signal (a teacher's scores, loss
weights), then take ``rl.epochs x rl.minibatches`` optimiser steps on the
method's loss with the rollout-time log-probs as ``pi_old``. A method is a
``Method``: only what differs (proportions, signal, loss, extra state and
metrics).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mopd_jax import config as config_lib
from mopd_jax import parallel, runs, training
from mopd_jax.config import DOMAIN_TUPLE, non_negative, positive
from mopd_jax.errors import ConfigError
from mopd_jax.data import batching, splits
from mopd_jax.data.domains import DOMAINS, completion_budget, get_domain
from mopd_jax.evaluation import evaluator
from mopd_jax.objectives import grpo
from mopd_jax.rollout import sampler


def defaults(method: str, steps: int) -> ml_collections.ConfigDict:
  """What GRPO, Mix RL and MOPD share: they start from ``init``, sample
  rollouts (``rl`` holds the batch shape and the clipped surrogate) and
  evaluate every domain (transfer and forgetting) as they go."""
  c = config_lib.common(method, init=True)
  config_lib.training(c, steps=steps, rl=True)
  c.eval.domains = tuple(DOMAINS)
  c.rl = ml_collections.ConfigDict(dict(
      group_size=8,
      prompts_per_step=32,
      epochs=1,
      minibatches=1,
      # > 1: each minibatch's rows sorted by completion length into that
      # many equal parts, each padded only to its own longest completion,
      # their gradients added before the one optimiser step (the same
      # step, less padding: a speed option for domains of unequal lengths)
      length_buckets=1,
      advantage="grpo",  # grpo | drgrpo | rloo | passk
      pass_k=4,  # passk: the group is rewarded for its best of k samples
      advantage_eps=1e-6,
      eps_low=0.2,
      eps_high=0.28,
      dual_clip=0.0,  # c > 1 bounds negative-advantage losses; 0: off
      tis_cap=0.0,  # truncated sampler/trainer importance weight; 0: off
      beta=0.0,  # KL-to-reference weight; 0: no reference forward at all
      kl_estimator="k3",  # k1 | k2 | k3
      # weight of the entropy bonus -c H(pi) per token (keeps exploring)
      entropy_coef=0.0,
      aggregation="token_mean",  # | seq_mean_token_mean | constant
      drop_equal_groups=False,
      # 1: one-step-async rollouts, step t+1's sampled with step t's
      # parameters on a device of their own while step t trains (needs
      # tis_cap > 0 and two devices: mesh.cpu_devices=2 on a CPU); 0: off
      max_policy_lag=0,
  ))
  return c


CHECKS = (
    *config_lib.COMMON_CHECKS, *config_lib.TRAINING_CHECKS,
    ("eval.domains", *DOMAIN_TUPLE),
    ("rl.group_size", lambda v: v >= 2, ">= 2"),
    ("rl.prompts_per_step", positive, "> 0"),
    ("rl.epochs", positive, "> 0"),
    ("rl.minibatches", positive, "> 0"),
    ("rl.length_buckets", positive, "> 0"),
    ("rl.advantage", lambda v: v in grpo.ADVANTAGES,
     " or ".join(grpo.ADVANTAGES)),
    ("rl.advantage_eps", positive, "> 0"),
    ("rl.eps_low", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("rl.eps_high", non_negative, ">= 0"),
    ("rl.dual_clip", lambda v: v == 0 or v > 1, "0 (off) or > 1"),
    ("rl.tis_cap", non_negative, ">= 0 (0 disables)"),
    ("rl.beta", non_negative, ">= 0"),
    ("rl.kl_estimator", lambda v: v in grpo.KL_ESTIMATORS,
     " or ".join(grpo.KL_ESTIMATORS)),
    ("rl.entropy_coef", non_negative, ">= 0"),
    ("rl.aggregation", lambda v: v in grpo.AGGREGATIONS,
     " or ".join(grpo.AGGREGATIONS)),
    ("rl.max_policy_lag", lambda v: v in (0, 1), "0 (synchronous) or 1"),
)


def validate(full) -> None:
  """The cross-field checks of the shared sections and of ``rl``."""
  config_lib.check_common(full)
  batch = full.rl.prompts_per_step * full.rl.group_size
  if full.rl.advantage == "passk" and not (
      1 <= full.rl.pass_k <= full.rl.group_size):
    raise ConfigError(f"rl.pass_k: {full.rl.pass_k} must be in [1,"
                      f" rl.group_size = {full.rl.group_size}]")
  if batch % full.rl.minibatches:
    raise ConfigError(f"rl.minibatches: {full.rl.minibatches} does not divide"
                      f" the {batch} sequences of a step")
  if (batch // full.rl.minibatches) % full.rl.length_buckets:
    raise ConfigError(f"rl.length_buckets: {full.rl.length_buckets} does not"
                      f" divide a minibatch's {batch // full.rl.minibatches}"
                      " sequences")
  if full.rl.max_policy_lag and not full.rl.tis_cap:
    raise ConfigError("rl.tis_cap: one-step-async rollouts are trained on"
                      " with the truncated importance weight to the"
                      " previous policy (> 0)")
  if full.sampling.top_k or full.sampling.top_p < 1:
    raise ConfigError("sampling.top_k: RL rollouts must sample the full"
                      " distribution (top_k=0, top_p=1)")
  if full.sampling.temperature <= 0:
    raise ConfigError("sampling.temperature: RL rollouts need temperature > 0")


def draw_prompts(train_sets, weights: np.ndarray, count: int, seed: int,
                 step: int):
  """``count`` examples of step ``step`` and their domain indices:
  ``d ~ w``, then an example of ``d`` uniformly, from ``rng(seed, step)``."""
  rng = np.random.default_rng([seed, step])
  ids = rng.choice(len(train_sets), size=count, p=weights)
  return [train_sets[d][int(rng.integers(len(train_sets[d])))]
          for d in ids], ids


def make_update(loss_fn, optimizer):
  """One optimiser step on a minibatch given as its row parts
  (``length_parts``): ``update(train, parts, *shared) -> (train,
  metrics)`` with ``train = {params, opt_state}`` (donated) and ``shared``
  arrays every part's loss reads whole; skipped when the loss or a
  gradient is not finite (``training.guarded_update``). One part: one
  jitted step. Several: each part's gradient of its loss sum ``S_p``
  (``loss = S / max(C, 1)`` with ``(S, C)`` the loss's ``"loss"`` pair,
  ``grpo.aggregate``, whose pairs add up over rows), then one step on

      L = sum_p S_p / max(sum_p C_p, 1),
      grad L = sum_p grad S_p / max(sum_p C_p, 1),

  the whole minibatch's loss and gradient (to float rounding), each part's
  forward and backward padded only to its own longest completion."""

  @functools.partial(jax.jit, donate_argnums=0)
  def whole(train, mb, *shared):
    metrics, params, opt_state, skipped = training.gradient_step(
        optimizer, loss_fn, train["params"], train["opt_state"], mb, *shared)
    metrics[training.SKIPPED] = (skipped, jnp.float32(1))
    return dict(params=params, opt_state=opt_state), metrics

  @functools.partial(jax.jit, donate_argnums=0)
  def add_gradient(total, params, mb, *shared):
    def loss_sum(p):
      _, metrics = loss_fn(p, mb, *shared)
      return metrics["loss"][0], metrics
    grads, metrics = jax.grad(loss_sum, has_aux=True)(params)
    return jax.tree.map(jnp.add, total, grads), metrics

  @functools.partial(jax.jit, donate_argnums=0)
  def apply(train, grads, loss_sum, count):
    count = jnp.maximum(count, 1.0)
    params, opt_state, skipped = training.guarded_update(
        optimizer, loss_sum / count, jax.tree.map(lambda g: g / count, grads),
        train["params"], train["opt_state"])
    return dict(params=params, opt_state=opt_state), skipped

  def update(train, parts, *shared):
    if len(parts) == 1:
      return whole(train, parts[0], *shared)
    grads = jax.tree.map(jnp.zeros_like, train["params"])
    metrics: dict = {}
    for mb in parts:
      grads, part_metrics = add_gradient(grads, train["params"], mb, *shared)
      training.accumulate(metrics, part_metrics)
    train, skipped = apply(train, grads, *metrics["loss"])
    metrics[training.SKIPPED] = (skipped, jnp.float32(1))
    return train, metrics

  return update


# per-sequence arrays of two axes or more whose axis 1 is not the
# completion's; every other one is per completion position
PROMPT_KEYS = ("prompt", "prompt_mask")


def length_parts(mb: dict, parts: int) -> list[dict]:
  """``mb``'s rows sorted by completion length (``mask``'s row sums) and
  split into ``parts`` equal parts, each cut to ``batching.bucket_width``
  of its longest completion on the completion axis; ``[mb]`` when
  ``parts`` is 1. Columns past a row's completion are masked in every
  loss and, attention being causal, change nothing before them."""
  if parts == 1:
    return [mb]
  lengths = mb["mask"].sum(1)
  width = mb["mask"].shape[1]
  per_token = {k for k, v in mb.items() if v.ndim > 1 and k not in
               PROMPT_KEYS}
  other = sorted(k for k in per_token if mb[k].shape[1] != width)
  if other:  # a new per-sequence array: name it in PROMPT_KEYS
    raise ValueError(f"length_parts: {other} are not per completion"
                     " position")
  if len(lengths) % parts:
    raise ValueError(f"length_parts: {len(lengths)} rows do not split into"
                     f" {parts} equal parts")
  order = np.argsort(lengths, kind="stable")
  size = len(order) // parts
  out = []
  for p in range(parts):
    idx = order[p * size:(p + 1) * size]
    cut = batching.bucket_width(int(lengths[idx].max()), width)
    out.append({k: v[idx][:, :cut] if k in per_token else v[idx]
                for k, v in mb.items()})
  return out


def check_mesh(mesh, rl) -> None:
  """Each minibatch, and each of its length parts, splits evenly over
  ``mesh``'s batch axis."""
  minibatch = rl.prompts_per_step * rl.group_size // rl.minibatches
  runs.check_divisible(mesh, minibatch, "rl.minibatches")
  runs.check_divisible(mesh, minibatch // rl.length_buckets,
                       "rl.length_buckets")


def optimise(train, data: dict, update, rl, rng: np.random.Generator,
             mesh=None, shared: tuple = ()):
  """``rl.epochs`` passes over the rollout batch ``data`` (per-sequence
  arrays), each in ``rl.minibatches`` shuffled minibatches of
  ``rl.length_buckets`` parts (``length_parts``; split over ``mesh``'s
  batch axis when given); the log-probs in ``data["old_logp"]`` stay
  ``pi_old`` throughout. Returns the new ``train`` and the accumulated
  ``(sum, count)`` metrics."""
  batch = len(data["advantages"])
  size = batch // rl.minibatches
  pairs: dict = {}
  for _ in range(rl.epochs):
    order = rng.permutation(batch)
    for m in range(rl.minibatches):
      idx = order[m * size:(m + 1) * size]
      parts = length_parts({k: v[idx] for k, v in data.items()},
                           rl.length_buckets)
      if mesh is not None:
        parts = [parallel.shard_batch(mesh, mb) for mb in parts]
      train, metrics = update(train, parts, *shared)
      pairs = training.accumulate(pairs, metrics)
  return train, pairs


def rollout_batch(rollout, prompt, prompt_mask, rewards: np.ndarray, rl):
  """The per-sequence arrays the loss needs, from a rollout and its rewards:
  group advantages, and ``keep`` = 0 on all-equal groups when
  ``rl.drop_equal_groups`` (they carry no signal)."""
  advantages = np.asarray(grpo.group_advantages(
      jnp.asarray(rewards), rl.group_size, rl.advantage, rl.advantage_eps,
      rl.pass_k))
  informative = np.repeat(np.asarray(grpo.informative_groups(
      jnp.asarray(rewards), rl.group_size)), rl.group_size)
  keep = informative if rl.drop_equal_groups else np.ones_like(informative)
  # Train only on the columns some completion reached, rounded up to a
  # multiple of 8 so that few distinct shapes are compiled.
  mask = np.asarray(rollout.mask)
  width = min(mask.shape[1], -(-max(int(mask.sum(1).max()), 1) // 8) * 8)
  data = dict(prompt=np.asarray(prompt), prompt_mask=np.asarray(prompt_mask),
              completion=np.asarray(rollout.completion)[:, :width],
              mask=mask[:, :width],
              old_logp=np.asarray(rollout.logprobs)[:, :width],
              advantages=advantages, keep=keep.astype(np.float32))
  return data, informative


class Rollouts:
  """What every on-policy stage does before its loss: draw a step's prompts
  by domain proportions, sample ``rl.group_size`` completions each, grade
  them with the domains' verifiers; and policy log-probs of a batch under
  any parameters (reference model, ``pi_old`` for TIS)."""

  def __init__(self, config, tokenizer, model_cfg, mesh, names, sampling,
               sample_mesh=None):
    by_domain = splits.domain_splits(config, names, "train")
    self.train_sets = [by_domain[d] for d in names]
    # each domain's own completion budget: a concise domain's rows are
    # sampled apart from a long one's (``sampler.sample_by_budget``)
    self.budgets = np.array([completion_budget((d,), sampling.max_new_tokens)
                             for d in names])
    self.verifiers = [get_domain(d).verify for d in names]
    self.config, self.tokenizer, self.model_cfg = config, tokenizer, model_cfg
    self.mesh, self.sampling = mesh, sampling
    # where the policy samples: the training mesh, or (one-step-async
    # rollouts) devices of its own, the parameters copied there
    self.sample_mesh = sample_mesh or mesh
    self.key = jax.random.fold_in(jax.random.key(config.seed), 2)

    @jax.jit
    def logprobs(params, prompt, prompt_mask, completion, mask):
      rollout = sampler.Rollout(completion, jnp.zeros(completion.shape), mask)
      return sampler.sequence_logprobs(params, model_cfg, prompt,
                                       prompt_mask, rollout, sampling)

    self._logprobs = logprobs

  def draw(self, weights: np.ndarray, step: int):
    """``(examples, domain ids, prompt, prompt_mask)`` of step ``step``;
    the group's rows contiguous."""
    rl = self.config.rl
    examples, ids = draw_prompts(self.train_sets, weights,
                                 rl.prompts_per_step, self.config.seed, step)
    prompt, prompt_mask = batching.encode_prompts(
        [e.prompt for e in examples for _ in range(rl.group_size)],
        self.tokenizer, self.config.data.max_prompt_len, fit=True)
    return examples, ids, prompt, prompt_mask

  def sample(self, params, prompt, prompt_mask, seq_ids, step: int,
             behaviour=None, max_new_tokens: int = 0):
    """The step's rollout as device arrays, dispatched and not waited for:
    the student (``params``) samples, or ``behaviour(params, prompt,
    prompt_mask, seq_ids, key, sampling) -> Rollout`` (a method's
    off-policy sampler); ``max_new_tokens`` (> 0) shortens the budget."""
    sampling = (dataclasses.replace(self.sampling,
                                    max_new_tokens=max_new_tokens)
                if max_new_tokens else self.sampling)
    key = jax.random.fold_in(self.key, step)
    if self.sample_mesh is not self.mesh:
      params = jax.device_put(params, parallel.replicated(self.sample_mesh))
    with parallel.activate(self.sample_mesh):
      if behaviour:
        return behaviour(params, prompt, prompt_mask, seq_ids, key, sampling)
      return sampler.sample_by_budget(params, self.model_cfg, prompt,
                                      prompt_mask, key, sampling,
                                      self.budgets[seq_ids])

  def grade(self, examples, seq_ids: np.ndarray, completion) -> np.ndarray:
    """[B] verifier rewards of the completions."""
    group = self.config.rl.group_size
    return np.array([
        self.verifiers[d](self.tokenizer.decode(row),
                          examples[i // group].answer)
        for i, (d, row) in enumerate(zip(seq_ids, completion))], np.float32)

  def __call__(self, params, weights: np.ndarray, step: int,
               behaviour=None, max_new_tokens: int = 0):
    """``(examples, domain ids, prompt, prompt_mask, rollout, rewards)`` of
    step ``step``, sampled now (``sample``'s arguments)."""
    examples, ids, prompt, prompt_mask = self.draw(weights, step)
    seq_ids = np.repeat(ids, self.config.rl.group_size)
    rollout = parallel.to_host(self.sample(
        params, prompt, prompt_mask, seq_ids, step, behaviour,
        max_new_tokens))
    return (examples, ids, prompt, prompt_mask, rollout,
            self.grade(examples, seq_ids, rollout.completion))

  def logprobs(self, params, data: dict) -> np.ndarray:
    """[B, T] policy log-probs of ``data``'s completions under ``params``."""
    with parallel.activate(self.mesh):
      batch = parallel.shard_batch(self.mesh, [
          data[k] for k in ("prompt", "prompt_mask", "completion", "mask")])
      return parallel.to_host(self._logprobs(params, *batch))

  def add_policy_inputs(self, data: dict, params, ref_params,
                        off_policy: bool = False) -> None:
    """``ref_logp`` under ``ref_params`` (if given); with ``rl.tis_cap``, or
    when another policy sampled (``off_policy``), ``pi_old`` recomputed by
    the trainer, the sampler's own log-probs kept as ``behaviour_logp``
    (the truncated importance weight's)."""
    if ref_params is not None:
      data["ref_logp"] = self.logprobs(ref_params, data)
    if self.config.rl.tis_cap > 0 or off_policy:
      data["behaviour_logp"] = data["old_logp"]
      data["old_logp"] = self.logprobs(params, data)


def batch_metrics(pairs: dict, names, seq_ids: np.ndarray, mask: np.ndarray,
                  rewards: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """Adds reward, response length and, per domain, prompt and token share,
  reward and sampling weight to ``pairs``; returns the sequence lengths."""
  batch = len(rewards)
  lengths = mask.sum(1).astype(np.float32)
  pairs.update({"reward": (rewards.sum(), batch),
                "response_length": (lengths.sum(), batch)})
  for d, name in enumerate(names):
    mine = seq_ids == d
    pairs[f"share/prompts/{name}"] = (mine.sum(), batch)
    pairs[f"share/tokens/{name}"] = (lengths[mine].sum(), lengths.sum())
    pairs[f"reward/{name}"] = (rewards[mine].sum(), mine.sum())
    pairs[f"weight/{name}"] = (weights[d], 1.0)
  return lengths


class Method(Protocol):
  """What one on-policy method adds to the shared step."""

  names: tuple[str, ...]  # its domains, in the order of domain ids
  shared: tuple  # arrays every minibatch's loss reads whole

  def init_state(self) -> dict:
    """Its own entries of the train state (checkpointed with it)."""

  def proportions(self, state) -> np.ndarray:
    """The domain proportions of this step's prompts."""

  def signal(self, state, data: dict, seq_ids: np.ndarray) -> dict:
    """Adds its per-sequence arrays to ``data`` before the policy inputs
    (MOPD: the routed teachers' scores)."""

  def weigh(self, state, data: dict, seq_ids: np.ndarray
            ) -> tuple[dict, Any]:
    """Adds what the loss needs after the policy inputs (MOPD: the
    per-sequence loss weight); returns its train-state updates and notes
    for ``metrics``."""

  def behaviour(self, state, step: int) -> tuple[Callable | None, int]:
    """Who samples this step and its completion budget: ``(None, 0)`` for
    the student and the full budget; else a sampler for ``Rollouts`` and
    ``max_new_tokens`` (MOPD: teacher prefixes, the TRB warm-up, the
    length curriculum)."""

  def metrics(self, state, new_state, ids: np.ndarray, data: dict,
              informative: np.ndarray, notes: Any, trained: dict
              ) -> tuple[dict, dict]:
    """``(train-state updates, {name: (sum, count)})`` after the update
    (``trained``: the update's own metrics, e.g. the policy's entropy)."""


@dataclasses.dataclass(frozen=True)
class Context:
  """What a run's steps share: its config, mesh, rollouts, jitted update
  and the reference parameters (None when no loss term reads them)."""
  config: Any
  mesh: Any
  rollouts: Rollouts
  update: Callable
  ref_params: Any


def init_pending(config, max_new_tokens: int, domains: int) -> dict:
  """The train state's slot for the next step's rollout under one-step-
  async sampling (``rl.max_policy_lag``): empty (``step`` -1) until the
  first step fills it; checkpointed, so a resumed run trains on the same
  in-flight batch."""
  rows = config.rl.prompts_per_step * config.rl.group_size
  return dict(completion=np.zeros((rows, max_new_tokens), np.int32),
              logprobs=np.zeros((rows, max_new_tokens), np.float32),
              mask=np.zeros((rows, max_new_tokens), np.int32),
              weights=np.zeros(domains), step=np.asarray(-1, np.int32),
              params_step=np.asarray(-1, np.int32))


def _this_steps_rollouts(ctx: Context, state: dict, step: int, weights,
                         behaviour, budget):
  """``(examples, ids, prompt, prompt_mask, rollout, rewards, lagged,
  next)``: this step's rollouts, sampled now or (one-step async) taken
  from the state, where the previous step left them sampled with its
  parameters; then, async, the next step's prompts drawn and their
  sampling dispatched with this step's parameters (``next``: what
  ``state["pending"]`` becomes once it is read back; None when
  synchronous). Data staler than ``rl.max_policy_lag`` steps is refused
  and sampled anew."""
  rl, rollouts = ctx.config.rl, ctx.rollouts
  if not rl.max_policy_lag:
    return (*rollouts(state["params"], weights, step, behaviour, budget),
            False, None)
  pending = state["pending"]
  lagged = (int(pending["step"]) == step
            and step - int(pending["params_step"]) <= rl.max_policy_lag)
  if lagged:
    examples, ids, prompt, prompt_mask = rollouts.draw(pending["weights"],
                                                       step)
    rollout = sampler.Rollout(pending["completion"], pending["logprobs"],
                              pending["mask"])
    rewards = rollouts.grade(examples, np.repeat(ids, rl.group_size),
                             rollout.completion)
    drawn = (examples, ids, prompt, prompt_mask, rollout, rewards)
  else:
    drawn = rollouts(state["params"], weights, step)
  _, next_ids, next_prompt, next_mask = rollouts.draw(weights, step + 1)
  dispatched = rollouts.sample(state["params"], next_prompt, next_mask,
                               np.repeat(next_ids, rl.group_size), step + 1)
  return (*drawn, lagged, (dispatched, weights, step + 1, step))


def step(ctx: Context, method: Method, state: dict, step: int):
  """One on-policy step (module docstring); returns ``(state, pairs)``.
  With ``rl.max_policy_lag = 1`` the rollouts of step t+1 are sampled with
  step t's parameters while step t's update runs, on devices of their own
  (``Rollouts.sample_mesh``), and are trained on with the truncated
  importance weight ``min(pi_t(y) / pi_{t-1}(y), rl.tis_cap)``; the
  proportions of step t+1's prompts are those of step t."""
  rl = ctx.config.rl
  weights = method.proportions(state)
  behaviour, budget = method.behaviour(state, step)
  (_, ids, prompt, prompt_mask, rollout, rewards, lagged,
   upcoming) = _this_steps_rollouts(ctx, state, step, weights, behaviour,
                                    budget)
  data, informative = rollout_batch(rollout, prompt, prompt_mask, rewards, rl)
  seq_ids = np.repeat(ids, rl.group_size)
  method.signal(state, data, seq_ids)
  ctx.rollouts.add_policy_inputs(data, state["params"], ctx.ref_params,
                                 off_policy=behaviour is not None or lagged)
  updates, notes = method.weigh(state, data, seq_ids)
  train = dict(params=state["params"], opt_state=state["opt_state"])
  with parallel.activate(ctx.mesh):
    train, pairs = optimise(
        train, data, ctx.update, rl,
        np.random.default_rng([ctx.config.seed, step, 1]), ctx.mesh,
        method.shared)
  new_state = dict(state, **train, step=state["step"] + 1, **updates)
  if upcoming is not None:
    dispatched, used_weights, for_step, params_step = upcoming
    host = parallel.to_host(dispatched)
    new_state["pending"] = dict(
        completion=np.asarray(host.completion),
        logprobs=np.asarray(host.logprobs), mask=np.asarray(host.mask),
        weights=np.asarray(used_weights, np.float64),
        step=np.asarray(for_step, np.int32),
        params_step=np.asarray(params_step, np.int32))
    pairs["policy_lag"] = (float(lagged), 1.0)
  batch_metrics(pairs, method.names, seq_ids, data["mask"], rewards, weights)
  more_state, more = method.metrics(state, new_state, ids, data, informative,
                                    notes, pairs)
  new_state.update(more_state)
  pairs.update(more)
  return new_state, pairs


def split_for_sampling(mesh, config):
  """``(training mesh, sampling mesh)``: the same mesh, or for one-step-
  async rollouts (``rl.max_policy_lag``) the last device for the sampler
  and the others for training."""
  if not config.rl.max_policy_lag:
    return mesh, mesh
  pool = list(mesh.devices.flat)
  if len(pool) < 2:
    raise ConfigError("rl.max_policy_lag: one-step-async rollouts sample on"
                      " a device of their own; this mesh has one (on a CPU:"
                      " --config.mesh.cpu_devices=2)")
  return (parallel.make_mesh(data=-1, fsdp=1, tensor=1, devices=pool[:-1]),
          parallel.make_mesh(data=1, fsdp=1, tensor=1, devices=pool[-1:]))


def run(config, workdir: str, names: tuple[str, ...], make_method, desc: str,
        on_final=None, stopper=None):
  """The whole on-policy run on the domains ``names``: set up, build the
  method (``make_method(config, tokenizer, model_cfg, mesh, sampling)`` ->
  ``(method, loss_fn, needs_reference)``), load ``init``, then the step
  loop with its evaluations (``on_final(scalars)`` at the end; default:
  ``eval.json``). ``stopper(config, model_cfg, tokenizer, mesh, params,
  eval_fn, workdir) -> (eval_fn, on_eval)`` ends the run by measurement
  (``expert_stop``). Returns the final state."""
  tokenizer, model_cfg, mesh = runs.setup(config)
  mesh, sample_mesh = split_for_sampling(mesh, config)
  rl = config.rl
  check_mesh(mesh, rl)
  sampling = sampler.SamplingConfig.of(
      config.sampling, tokenizer, max_new_tokens=completion_budget(
          names, config.sampling.max_new_tokens))
  # The method first: its runs (teachers) are checked before any loading.
  method, loss_fn, needs_reference = make_method(
      config, tokenizer, model_cfg, mesh, sampling)
  params = runs.load_params(config.init, model_cfg, mesh)
  test_sets = splits.eval_sets(config, config.eval.domains)
  rollouts = Rollouts(config, tokenizer, model_cfg, mesh, method.names,
                      sampling, sample_mesh)
  # A copy: the policy's own buffers are donated to every update.
  ref_params = jax.tree.map(jnp.copy, params) if needs_reference else None
  optimizer = training.make_optimizer(config.optim, config.train.steps)
  with parallel.activate(mesh):
    state = training.init_state(params, optimizer)
  state.update(method.init_state())
  if rl.max_policy_lag:
    state["pending"] = init_pending(config, sampling.max_new_tokens,
                                    len(method.names))
  ctx = Context(config, mesh, rollouts, make_update(loss_fn, optimizer),
                ref_params)
  eval_fn = evaluator.make_eval_fn(
      config, model_cfg, tokenizer, test_sets, mesh,
      on_final or runs.write_eval(workdir, config.train.steps))
  on_eval = None
  if stopper:
    with parallel.activate(mesh):
      eval_fn, on_eval = stopper(config, model_cfg, tokenizer, mesh,
                                 state["params"], eval_fn, workdir)
  return training.run_loop(workdir, state, functools.partial(step, ctx,
                                                             method),
                           config.train.steps, config.checkpoint,
                           config.train, eval_fn, desc=desc, on_eval=on_eval)
