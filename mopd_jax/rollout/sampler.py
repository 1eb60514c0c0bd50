"""Batched autoregressive sampling: a jitted prefill that allocates the KV
cache (sharded on the mesh in scope) and fills it, then a ``lax.while_loop``
decode in phases, each growing the cache to the slots it needs.

Prompts are left-padded so every row's next token goes to the same cache slot.
Returned log-probs are those of the sampling policy (after temperature, top-k
and top-p), so they can serve as ``pi_old`` in a policy-gradient ratio; with
temperature 0 (greedy) they are the model's plain log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import parallel
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.ops.logprobs import token_logprobs
from mopd_jax.rollout import packing


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those;
  any of ``stop_ids`` ends a row (none: every row runs ``max_new_tokens``)."""
  max_new_tokens: int = 48
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  stop_ids: tuple[int, ...] = (2,)
  pad_id: int = 0

  @classmethod
  def of(cls, section, tokenizer, **overrides) -> "SamplingConfig":
    """From a config's ``sampling`` section, with the stop and padding ids
    of ``tokenizer`` and ``overrides``."""
    fields = dict(section.to_dict(), stop_ids=tuple(tokenizer.stop_ids),
                  pad_id=tokenizer.pad_id)
    fields.update(overrides)
    return cls(**fields)


class Rollout(NamedTuple):
  """Completions of a batch of prompts.

  ``completion[b, t]`` is the t-th generated token (PAD after EOS),
  ``logprobs[b, t]`` its log-prob under the sampling policy and ``mask[b, t]``
  is 1 for generated tokens up to and including EOS.
  """
  completion: jax.Array  # [B, N] int32
  logprobs: jax.Array  # [B, N] float32
  mask: jax.Array  # [B, N] int32


def policy_logits(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """Logits of the distribution actually sampled from.

  ``z / temperature``, with tokens outside the top-k, or outside the smallest
  set whose probability reaches ``top_p`` (the most likely token always kept),
  set to -inf. Greedy (temperature 0) leaves the logits unscaled. The
  temperature may be traced (the sampler's is: one program for greedy and
  sampled decoding).
  """
  t = sampling.temperature
  z = logits.astype(jnp.float32) / jnp.where(t > 0, t, 1.0)
  if sampling.top_k > 0:
    kth = jax.lax.top_k(z, sampling.top_k)[0][..., -1:]
    z = jnp.where(z < kth, -jnp.inf, z)
  if sampling.top_p < 1.0:
    sorted_z = jnp.sort(z, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_z, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < sampling.top_p, sorted_z, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    z = jnp.where(z < threshold, -jnp.inf, z)
  return z


def trust_region_blend(student_logp: jax.Array, teacher_logp: jax.Array,
                       delta, iters: int = 20) -> jax.Array:
  """The behaviour policy closest to the teacher inside a KL trust region
  around the student (TRB), per row, as log-probs.

  ``b_beta = softmax((1 - beta) log pi + beta log T)``, the geometric
  mixture, with ``beta*`` the largest ``beta`` in [0, 1] such that
  ``KL(b_beta || pi) <= delta``: ``KL(b_beta || pi)`` grows with ``beta``
  (its derivative is ``beta Var_b(log T - log pi) >= 0``), so ``beta*`` is
  found by bisection (``iters`` halvings; ``beta* = 1`` where the teacher
  itself is inside the region, 0 at ``delta = 0``). ``student_logp``,
  ``teacher_logp``: [..., V] log-probs (``-inf`` allowed).
  """
  floor = -1e30  # -inf * 0 would be nan
  lp_s = jnp.maximum(student_logp.astype(jnp.float32), floor)
  lp_t = jnp.maximum(teacher_logp.astype(jnp.float32), floor)

  def blend(beta):
    return jax.nn.log_softmax((1.0 - beta) * lp_s + beta * lp_t, axis=-1)

  def kl(beta):
    lb = blend(beta)
    return jnp.sum(jnp.exp(lb) * (lb - lp_s), axis=-1)

  def halve(_, bounds):
    low, high = bounds
    mid = 0.5 * (low + high)
    inside = kl(mid[..., None]) <= delta
    return jnp.where(inside, mid, low), jnp.where(inside, high, mid)

  shape = student_logp.shape[:-1]
  low, _ = jax.lax.fori_loop(0, iters, halve, (jnp.zeros(shape),
                                               jnp.ones(shape)))
  beta = jnp.where(kl(jnp.ones(shape + (1,))) <= delta, 1.0, low)
  # float32 rounds a tiny KL to <= 0: no region is no mixture at all
  return blend(jnp.where(delta > 0, beta, 0.0)[..., None])


DRAW_BLOCK = 256


def draw(key, z, block: int = DRAW_BLOCK):
  """A token per row of the logits ``z`` [..., V], drawn from
  ``p = softmax(z)`` by the inverse of its cumulative distribution, in
  two levels: with one ``u ~ U(0, 1]`` a row, the vocabulary in blocks of
  ``block`` with sums ``S_b`` and the target ``u * sum_b S_b``, the block
  ``j`` is the first whose cumulative sum reaches the target and the token
  the first of block ``j`` whose cumulative sum reaches what is left of
  it. The same distribution as ``jax.random.categorical`` (which draws a
  Gumbel number for every entry of the vocabulary: 57-88 ms at [64,
  49152] on a 2-core CPU, against 3.5 ms for this), another token for
  the same key. A token of probability 0 (top-k, top-p, padding) is never
  drawn: the float rounding between the two levels' sums can only move
  the draw to the block's last token of positive probability."""
  *lead, V = z.shape
  n = -(-V // block)
  # float32 sums whatever the logits' dtype (bfloat16's 8 bits would bias
  # a block's cumulative sum)
  z = jnp.pad(z.reshape(-1, V).astype(jnp.float32),
              ((0, 0), (0, n * block - V)),
              constant_values=-jnp.inf)
  p = jax.nn.softmax(z, axis=-1).reshape(-1, n, block)
  sums = p.sum(-1)
  ends = jnp.cumsum(sums, axis=-1)  # [R, n]
  u = 1.0 - jax.random.uniform(key, (p.shape[0], 1))  # (0, 1]
  target = u * ends[:, -1:]
  j = jnp.minimum(jnp.sum(ends < target, axis=-1), n - 1)[:, None]
  left = target - jnp.take_along_axis(ends - sums, j, axis=1)  # [R, 1]
  inside = jnp.take_along_axis(p, j[..., None], axis=1)[:, 0]  # [R, b]
  i = jnp.sum(jnp.cumsum(inside, -1) < left, -1)
  last = block - 1 - jnp.argmax((inside > 0)[:, ::-1], axis=-1)
  return (j[:, 0] * block + jnp.minimum(i, last)).reshape(lead)


def _choose(z, key, temperature):
  """A token from the policy logits ``z`` and its log-prob under them:
  drawn (``draw``), or the most likely at ``temperature`` 0."""
  token = jax.lax.cond(temperature > 0, lambda: draw(key, z),
                       lambda: jnp.argmax(z, axis=-1))
  return token.astype(jnp.int32), token_logprobs(z, token)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _prefill(params, cfg: ModelConfig, prompt, prompt_mask, slots: int,
             packed=None):
  """The next-token logits, the cache of ``slots`` positions holding the
  prompts, and each row's next position. ``packed``: the prompts' packed
  rows (``packing.Packing``), prefilled in place of ``prompt``'s."""
  # The cache is created here, under jit, so that it is born sharded; of
  # the prompt's width first, so that the prompt attends over its own
  # slots only, then grown for the completion.
  segments = prompt_mask.astype(jnp.int32)
  tokens, filled = (prompt, segments) if packed is None else packed[:2]
  cache = decoder.init_cache(cfg, tokens.shape[0], prompt.shape[1])
  h, cache = decoder.hidden_states(params, cfg, tokens, filled, None, cache)
  # Only the last position's hidden state is needed (rows are left-padded):
  # the vocabulary projection of the whole prompt was a fifth of a
  # SmolLM2-135M prefill's FLOPs.
  if packed is None:
    h = h[:, -1]
  else:
    row, col = packed[2:]
    cache = decoder.gather_cache(cache, row, col, segments)
    h = h[row[:, -1], col[:, -1]]
  cache = decoder.extend_cache(cache, slots)
  logits = decoder.unembed(params, cfg, h[:, None])[:, 0]
  next_position = jnp.sum(segments, axis=1)
  return logits, cache, next_position


def phase_ends(n: int) -> tuple[int, ...]:
  """The numbers of new tokens after which the decode's cache grows:
  ``n/4, n/2, n`` for ``n >= 64``, else ``n`` alone. A decode step reads
  every slot of its cache (masked or not): the built-in model at batch
  128 takes 5.1 ms a token over 72 slots and 8.5 ms over 216, so a
  cache only as wide as the phase needs saves the reads of slots not yet
  written. Each phase is a loop of its own in the program (compiled
  apart), hence no phases for short completions."""
  return (n // 4, n // 2, n) if n >= 64 else (n,)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _decode(params, cfgs: tuple[ModelConfig, ...], sampling: SamplingConfig,
            key, caches, last_logits, next_position, delta, temperature):
  """Decodes with one model (``params``, ``cfgs``, ``caches`` and
  ``last_logits`` tuples of one), or the student and a teacher in lockstep
  (of two), each token drawn from ``trust_region_blend`` of their policies
  at ``delta``; ``temperature`` traced, in place of ``sampling``'s. The
  caches hold the prompts and the slots of the first of ``phase_ends``;
  each later phase grows them to its own end."""
  sampling = dataclasses.replace(sampling, temperature=temperature)
  # On a CPU, each layer's weights their own buffer, sliced once here
  # rather than copied out of the stacked arrays at every step of the loop
  # (measured: decode 55.4 -> 45.3 s for SmolLM2-135M at batch 64). Not on
  # accelerators: unmeasured there, and the copy would double the
  # parameters' share of device memory while sampling.
  # The same for the cache (``decoder.unstack_cache``).
  unstacked = jax.default_backend() == "cpu"
  if unstacked:
    params = tuple(decoder.unstack_layers(p, c.num_layers)
                   for p, c in zip(params, cfgs))
    caches = tuple(decoder.unstack_cache(c) for c in caches)
  batch = last_logits[0].shape[0]
  n = sampling.max_new_tokens
  ends = phase_ends(n)
  prompt_width = caches[0].segment_ids.shape[1] - ends[0]
  out = jnp.full((batch, n), sampling.pad_id, jnp.int32)
  # A row with an empty prompt (padding of a short batch) is done at once.
  state = (jnp.int32(0), caches, last_logits, next_position,
           next_position == 0, out, jnp.zeros((batch, n), jnp.float32),
           jnp.zeros((batch, n), jnp.int32), key)

  def body(state):
    step, caches, logits, position, done, out, lps, mask, key = state
    key, sub = jax.random.split(key)
    zs = [policy_logits(z, sampling) for z in logits]
    z = zs[0] if len(zs) == 1 else trust_region_blend(
        jax.nn.log_softmax(zs[0], -1), jax.nn.log_softmax(zs[1], -1), delta)
    token, lp = _choose(z, sub, temperature)
    live = ~done
    token = jnp.where(live, token, sampling.pad_id)
    out = out.at[:, step].set(token)
    lps = lps.at[:, step].set(jnp.where(live, lp, 0.0))
    mask = mask.at[:, step].set(live.astype(jnp.int32))
    done = done | jnp.isin(token, jnp.asarray(sampling.stop_ids, jnp.int32))
    stepped = [decoder.apply(p, c, token[:, None],
                             live.astype(jnp.int32)[:, None],
                             position[:, None], cache)
               for p, c, cache in zip(params, cfgs, caches)]
    return (step + 1, tuple(c for _, c in stepped),
            tuple(z[:, 0] for z, _ in stepped), position + 1, done, out, lps,
            mask, key)

  for end in ends:
    caches = tuple(decoder.extend_cache(c, prompt_width + end)
                   for c in state[1])
    state = jax.lax.while_loop(
        lambda s, end=end: (s[0] < end) & ~jnp.all(s[4]), body,
        state[:1] + (caches,) + state[2:])
  return Rollout(state[5], state[6], state[7])


def sample(params, cfg: ModelConfig, prompt: jax.Array, prompt_mask: jax.Array,
           key: jax.Array, sampling: SamplingConfig, guide=None) -> Rollout:
  """Sample up to ``max_new_tokens`` per left-padded prompt row.

  ``prompt``: [B, P] int32, ``prompt_mask``: [B, P] (1 on real tokens, which
  must be right-aligned; a row without any is padding, never decoded).
  Deterministic for a given ``key``. Under a mesh
  (``parallel.activate``) the prompts are split over the batch axis, each
  host feeding its own rows, and the cache is sharded as ``init_cache``
  says; the result is then a global array (``parallel.to_host`` reads it).
  ``guide = (teacher_params, teacher_cfg, delta)``: every token drawn from
  ``trust_region_blend`` of this policy and the teacher's at ``delta``
  instead (``logprobs`` are then the blend's: the behaviour policy's).
  """
  mesh = jax.sharding.get_mesh()
  delta = jnp.float32(guide[2] if guide else 0.0)
  # traced: greedy and sampled evaluations run one compiled decode
  temperature = jnp.float32(sampling.temperature)
  # On one device, the distinct prompts prefilled once each, packed (on
  # a mesh the rows of each device would have to be packed apart).
  packed = packing.pack(prompt, prompt_mask, sampling.pad_id) if (
      mesh.empty or mesh.size == 1) else None
  if not mesh.empty:
    prompt, prompt_mask = parallel.shard_batch(mesh, (prompt, prompt_mask))
    # one layout for the scalars, wherever they were made: a key on one
    # device and a key on the mesh are the same bytes, but two programs
    key, delta, temperature = jax.device_put((key, delta, temperature),
                                             parallel.replicated(mesh))
  models = [(params, cfg)] + ([guide[:2]] if guide else [])
  first = phase_ends(sampling.max_new_tokens)[0]
  filled = [_prefill(p, c, prompt, prompt_mask, prompt.shape[1] + first,
                     packed)
            for p, c in models]
  return _decode(tuple(p for p, _ in models), tuple(c for _, c in models),
                 dataclasses.replace(sampling, temperature=1.0), key,
                 tuple(f[1] for f in filled), tuple(f[0] for f in filled),
                 filled[0][2], delta, temperature)


# A group's rows are padded to a multiple of this (with empty rows), so
# that few batch shapes compile whatever the step's domain counts.
GROUP_ROWS = 16


def budget_groups(budgets: np.ndarray, n: int, unit: int = GROUP_ROWS):
  """``[(rows, width, max_new_tokens)]``: the rows (indices) whose budget
  is above ``n // 2`` in one group, the others in a second (an empty
  group left out), each group's ``width`` its row count rounded up to a
  multiple of ``unit`` (at most ``len(budgets)``) and its
  ``max_new_tokens`` its largest budget."""
  groups = []
  for rows in (np.flatnonzero(budgets > n // 2),
               np.flatnonzero(budgets <= n // 2)):
    if len(rows):
      width = min(-(-len(rows) // unit) * unit, len(budgets))
      groups.append((rows, width, int(budgets[rows].max())))
  return groups


@functools.partial(jax.jit, static_argnums=(3, 4))
def _merged(parts: tuple[Rollout, ...], order, budgets, n: int,
            pad_id: int) -> Rollout:
  """The rows of ``parts`` concatenated (columns padded to ``n``), taken
  in ``order``, each cut after its ``budgets[b]`` tokens (PAD, log-prob
  0, mask 0 beyond)."""
  keep = jnp.arange(n)[None] < budgets[:, None]

  def cat(field, fill):
    rows = jnp.concatenate([
        jnp.pad(getattr(r, field), ((0, 0), (0, n - r.mask.shape[1])),
                constant_values=fill) for r in parts])[order]
    return jnp.where(keep, rows, fill)

  return Rollout(cat("completion", pad_id), cat("logprobs", 0.0),
                 cat("mask", 0))


def sample_by_budget(params, cfg: ModelConfig, prompt, prompt_mask, key,
                     sampling: SamplingConfig, budgets) -> Rollout:
  """``sample`` with each row's completion cut after ``min(budgets[b], n)``
  tokens (a domain's ``completion_budget``; ``n =
  sampling.max_new_tokens``). On a CPU, where a decode step costs in
  proportion to its rows, the rows of budget at most ``n / 2`` are
  sampled by a call of their own, up to their largest budget, and the
  others by another (``budget_groups``; each call's rows padded with
  empty ones to a multiple of ``GROUP_ROWS`` and of the mesh's devices):
  one call decodes every row until the longest has ended, so a concise
  domain's rows beside a long one's would pay for its length. The same
  distribution either way, not the same tokens (the second call draws
  with ``fold_in(key, 1)``); a batch of one group, or on an accelerator,
  is one ``sample`` call. ``prompt``, ``prompt_mask``: host arrays."""
  n = sampling.max_new_tokens
  budgets = np.minimum(np.asarray(budgets), n)
  mesh = jax.sharding.get_mesh()
  if jax.default_backend() == "cpu":
    groups = budget_groups(budgets, n, math.lcm(
        GROUP_ROWS, parallel.data_parallel(mesh)))
  else:
    groups = [(np.arange(len(budgets)), len(budgets), n)]
  prompt, prompt_mask = np.asarray(prompt), np.asarray(prompt_mask)
  parts, order, start = [], np.empty(len(budgets), np.int32), 0
  for i, (rows, width, budget) in enumerate(groups):
    empty = np.zeros((width - len(rows), prompt.shape[1]), prompt.dtype)
    parts.append(sample(
        params, cfg, np.concatenate([prompt[rows], empty + sampling.pad_id]),
        np.concatenate([prompt_mask[rows], empty.astype(prompt_mask.dtype)]),
        jax.random.fold_in(key, i) if i else key,
        dataclasses.replace(sampling, max_new_tokens=budget)))
    order[rows] = start + np.arange(len(rows))
    start += width
  return _merged(tuple(parts), order, budgets, n, sampling.pad_id)


def completion_hidden(params, cfg: ModelConfig, prompt, prompt_mask,
                      completion, completion_mask) -> jax.Array:
  """Final hidden states [B, N, D] at the positions that predict each
  completion token, from one full forward pass over ``prompt ++ completion``
  (no cache). Position ``t`` predicts ``completion[:, t]``."""
  tokens = jnp.concatenate([prompt, completion], axis=1)
  segments = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(
      jnp.int32)
  h, _ = decoder.hidden_states(params, cfg, tokens, segments)
  return h[:, prompt.shape[1] - 1:-1]


def completion_logits(params, cfg: ModelConfig, prompt, prompt_mask,
                      completion, completion_mask,
                      sampling: SamplingConfig) -> jax.Array:
  """Sampling-policy logits [B, N, V] at every completion position."""
  h = completion_hidden(params, cfg, prompt, prompt_mask, completion,
                        completion_mask)
  return policy_logits(decoder.unembed(params, cfg, h), sampling)


def sequence_logprobs(params, cfg: ModelConfig, prompt, prompt_mask,
                      rollout: Rollout, sampling: SamplingConfig) -> jax.Array:
  """Sampling-policy log-probs of ``rollout`` from one full forward pass.

  The no-cache reference for the sampler: the log-probs must match
  ``rollout.logprobs`` where ``rollout.mask`` is 1.
  """
  z = completion_logits(params, cfg, prompt, prompt_mask, rollout.completion,
                        rollout.mask, sampling)
  return jnp.where(rollout.mask > 0, token_logprobs(z, rollout.completion), 0.0)
