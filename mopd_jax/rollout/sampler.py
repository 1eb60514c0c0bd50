"""Batched autoregressive sampling: a jitted prefill that allocates the KV
cache (sharded on the mesh in scope) and fills it, then a ``lax.while_loop``
decode to which the cache's buffers are donated.

Prompts are left-padded so every row's next token goes to the same cache slot.
Returned log-probs are those of the sampling policy (after temperature, top-k
and top-p), so they can serve as ``pi_old`` in a policy-gradient ratio; with
temperature 0 (greedy) they are the model's plain log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mopd_jax import parallel
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.ops.logprobs import token_logprobs


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
  set to -inf. Greedy (temperature 0) leaves the logits unscaled.
  """
  z = logits.astype(jnp.float32)
  if sampling.temperature > 0:
    z = z / sampling.temperature
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


def _choose(logits, key, sampling: SamplingConfig):
  z = policy_logits(logits, sampling)
  if sampling.temperature > 0:
    token = jax.random.categorical(key, z, axis=-1)
  else:
    token = jnp.argmax(z, axis=-1)
  return token.astype(jnp.int32), token_logprobs(z, token)


@functools.partial(jax.jit, static_argnums=(1, 4))
def _prefill(params, cfg: ModelConfig, prompt, prompt_mask, slots: int):
  # The cache is created here, under jit, so that it is born sharded.
  cache = decoder.init_cache(cfg, prompt.shape[0], slots)
  segments = prompt_mask.astype(jnp.int32)
  h, cache = decoder.hidden_states(params, cfg, prompt, segments, None, cache)
  # Only the last position's logits are needed (rows are left-padded): the
  # vocabulary projection of the whole prompt was a fifth of a
  # SmolLM2-135M prefill's FLOPs.
  logits = decoder.unembed(params, cfg, h[:, -1:])[:, 0]
  next_position = jnp.sum(segments, axis=1)
  return logits, cache, next_position


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=(4,))
def _decode(params, cfg: ModelConfig, sampling: SamplingConfig, key,
            cache, last_logits, next_position):
  # On a CPU, each layer's weights their own buffer, sliced once here
  # rather than copied out of the stacked arrays at every step of the loop
  # (measured: decode 55.4 -> 45.3 s for SmolLM2-135M at batch 64). Not on
  # accelerators: unmeasured there, and the copy would double the
  # parameters' share of device memory while sampling.
  if jax.default_backend() == "cpu":
    params = decoder.unstack_layers(params, cfg.num_layers)
  batch = last_logits.shape[0]
  n = sampling.max_new_tokens
  out = jnp.full((batch, n), sampling.pad_id, jnp.int32)
  # A row with an empty prompt (padding of a short batch) is done at once.
  state = (jnp.int32(0), cache, last_logits, next_position,
           next_position == 0, out, jnp.zeros((batch, n), jnp.float32),
           jnp.zeros((batch, n), jnp.int32), key)

  def cond(state):
    step, done = state[0], state[4]
    return (step < n) & ~jnp.all(done)

  def body(state):
    step, cache, logits, position, done, out, lps, mask, key = state
    key, sub = jax.random.split(key)
    token, lp = _choose(logits, sub, sampling)
    live = ~done
    token = jnp.where(live, token, sampling.pad_id)
    out = out.at[:, step].set(token)
    lps = lps.at[:, step].set(jnp.where(live, lp, 0.0))
    mask = mask.at[:, step].set(live.astype(jnp.int32))
    done = done | jnp.isin(token, jnp.asarray(sampling.stop_ids, jnp.int32))
    logits, cache = decoder.apply(params, cfg, token[:, None],
                                  live.astype(jnp.int32)[:, None],
                                  position[:, None], cache)
    return (step + 1, cache, logits[:, 0], position + 1, done, out, lps, mask,
            key)

  state = jax.lax.while_loop(cond, body, state)
  # The cache is returned so that its donated input buffers are reused in place.
  return Rollout(state[5], state[6], state[7]), state[1]


def sample(params, cfg: ModelConfig, prompt: jax.Array, prompt_mask: jax.Array,
           key: jax.Array, sampling: SamplingConfig) -> Rollout:
  """Sample up to ``max_new_tokens`` per left-padded prompt row.

  ``prompt``: [B, P] int32, ``prompt_mask``: [B, P] (1 on real tokens, which
  must be right-aligned; a row without any is padding, never decoded).
  Deterministic for a given ``key``. Under a mesh
  (``parallel.activate``) the prompts are split over the batch axis, each
  host feeding its own rows, and the cache is sharded as ``init_cache``
  says; the result is then a global array (``parallel.to_host`` reads it).
  """
  mesh = jax.sharding.get_mesh()
  if not mesh.empty:
    prompt, prompt_mask = parallel.shard_batch(mesh, (prompt, prompt_mask))
  last_logits, cache, position = _prefill(
      params, cfg, prompt, prompt_mask,
      prompt.shape[1] + sampling.max_new_tokens)
  rollout, _ = _decode(params, cfg, sampling, key, cache, last_logits,
                       position)
  return rollout


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
