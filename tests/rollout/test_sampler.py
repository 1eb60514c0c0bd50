"""The KV-cached sampler against one full forward pass, and its policy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.rollout import packing, sampler

# Its module-scoped fixture is built once: every test of the module on one
# pytest-xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("sampler")

CFG = ModelConfig(vocab_size=30, embed_dim=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mlp_dim=64)
EOS = 2


def _full_logits(params, prompt, mask, out):
  """Logits of one plain forward pass over prompt + completion."""
  tokens = jnp.concatenate([prompt, out.completion], 1)
  segments = jnp.concatenate([mask, out.mask], 1)
  return decoder.apply(params, CFG, tokens, segments)[0]


@pytest.fixture(scope="module")
def setup():
  params = decoder.init_params(CFG, jax.random.key(0))
  # Larger weights than init so the distribution is far from uniform.
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
  B, P = 5, 9
  prompt = jax.random.randint(jax.random.key(1), (B, P), 3, CFG.vocab_size)
  starts = jnp.array([0, 3, 5, 7, 8])  # rows of different lengths
  mask = (jnp.arange(P)[None] >= starts[:, None]).astype(jnp.int32)
  return params, prompt * mask, mask


SETTINGS = [
    sampler.SamplingConfig(max_new_tokens=24, stop_ids=(EOS,)),
    sampler.SamplingConfig(max_new_tokens=24, temperature=0.7, top_k=8,
                           top_p=0.9, stop_ids=(EOS,)),
    sampler.SamplingConfig(max_new_tokens=24, temperature=0.0, stop_ids=(EOS,)),
    # three phases (18, 36, 72 new tokens), every row to the end
    sampler.SamplingConfig(max_new_tokens=72, stop_ids=()),
]


def test_phases_grow_the_cache_to_the_completion():
  assert sampler.phase_ends(24) == (24,)
  assert sampler.phase_ends(72) == (18, 36, 72)


@pytest.mark.parametrize("sampling", SETTINGS,
                         ids=["t1", "topkp", "greedy", "phased"])
def test_logprobs_equal_full_forward(setup, sampling):
  params, prompt, mask = setup
  out = sampler.sample(params, CFG, prompt, mask, jax.random.key(7), sampling)
  ref = sampler.sequence_logprobs(params, CFG, prompt, mask, out, sampling)
  assert np.asarray(out.mask).sum() > 0
  diff = np.abs(np.asarray(ref) - np.asarray(out.logprobs))
  assert diff.max() <= 1e-5


def test_temperature_one_logprobs_are_model_logprobs(setup):
  params, prompt, mask = setup
  sampling = SETTINGS[0]
  out = sampler.sample(params, CFG, prompt, mask, jax.random.key(2), sampling)
  logits = np.asarray(_full_logits(params, prompt, mask, out), np.float64)
  P = prompt.shape[1]
  comp, m = np.asarray(out.completion), np.asarray(out.mask)
  for b in range(prompt.shape[0]):
    for t in range(sampling.max_new_tokens):
      if m[b, t]:
        z = logits[b, P - 1 + t]
        ref = z[comp[b, t]] - np.log(np.exp(z - z.max()).sum()) - z.max()
        assert abs(ref - float(out.logprobs[b, t])) < 1e-5


def test_eos_stops_the_row_and_deterministic(setup):
  params, prompt, mask = setup
  sampling = sampler.SamplingConfig(max_new_tokens=30, stop_ids=(5,))
  a = sampler.sample(params, CFG, prompt, mask, jax.random.key(11), sampling)
  b = sampler.sample(params, CFG, prompt, mask, jax.random.key(11), sampling)
  c = sampler.sample(params, CFG, prompt, mask, jax.random.key(12), sampling)
  np.testing.assert_array_equal(a.completion, b.completion)
  assert not np.array_equal(np.asarray(a.completion), np.asarray(c.completion))
  comp, m = np.asarray(a.completion), np.asarray(a.mask)
  stopped = 0
  for row, mrow in zip(comp, m):
    n = int(mrow.sum())
    assert np.all(mrow[:n] == 1) and np.all(mrow[n:] == 0)
    assert np.all(row[n:] == sampling.pad_id)
    assert not np.any(row[:n - 1] == 5)
    if n < sampling.max_new_tokens:
      assert row[n - 1] == 5
      stopped += 1
  assert stopped > 0


def test_policy_logits_top_k_and_top_p_against_numpy():
  logits = jax.random.normal(jax.random.key(0), (4, 20)) * 3
  z = np.asarray(sampler.policy_logits(
      logits, sampler.SamplingConfig(temperature=0.5, top_k=5)))
  ref = np.asarray(logits) / 0.5
  for row, r in zip(z, ref):
    kept = np.isfinite(row)
    assert kept.sum() == 5
    assert set(np.flatnonzero(kept)) == set(np.argsort(-r)[:5])
    np.testing.assert_allclose(row[kept], r[kept], rtol=1e-6)
  z = np.asarray(sampler.policy_logits(
      logits, sampler.SamplingConfig(top_p=0.8)))
  for row, r in zip(z, np.asarray(logits)):
    order = np.argsort(-r)
    p = np.exp(r - r.max())
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    expect = set(order[before < 0.8])
    assert set(np.flatnonzero(np.isfinite(row))) == expect


@pytest.mark.parametrize("vocab,block", [(600, 256), (58, 256), (49, 8)])
def test_draw_matches_the_softmax_frequencies_and_skips_impossible_tokens(
    vocab, block):
  """``draw`` against numpy's softmax: over 256 keys x 64 rows, every
  token's frequency within 5 standard errors of its probability (the
  vocabulary a multiple of the block or not, smaller than one block), and
  the tokens masked to -inf (as top-k leaves them) never drawn."""
  rng = np.random.default_rng(vocab)
  logits = rng.normal(size=vocab).astype(np.float32) * 2
  logits[rng.choice(vocab, vocab // 3, replace=False)] = -np.inf
  p = np.exp(logits - logits[np.isfinite(logits)].max())
  p /= p.sum()
  z = jnp.asarray(np.repeat(logits[None], 64, 0))
  fn = jax.jit(lambda k: sampler.draw(k, z, block))
  tokens = np.concatenate([np.asarray(fn(k)) for k in
                           jax.random.split(jax.random.key(0), 256)])
  n = tokens.size
  freq = np.bincount(tokens, minlength=vocab) / n
  assert freq.shape == (vocab,)  # never a padding index
  assert freq[p == 0].sum() == 0
  bound = 5 * np.sqrt(p * (1 - p) / n) + 1 / n
  assert np.all(np.abs(freq - p) <= bound), np.max(np.abs(freq - p) / bound)


def test_draw_keeps_the_leading_shape_and_a_certain_token():
  z = jnp.full((2, 3, 300), -jnp.inf).at[..., 257].set(0.0)
  for dtype in (jnp.float32, jnp.bfloat16):
    tokens = sampler.draw(jax.random.key(1), z.astype(dtype))
    assert tokens.shape == (2, 3) and np.all(np.asarray(tokens) == 257)


def test_greedy_takes_argmax(setup):
  params, prompt, mask = setup
  sampling = SETTINGS[2]
  out = sampler.sample(params, CFG, prompt, mask, jax.random.key(0), sampling)
  logits = _full_logits(params, prompt, mask, out)
  P = prompt.shape[1]
  pred = np.asarray(jnp.argmax(logits[:, P - 1:-1], -1))
  m = np.asarray(out.mask, bool)
  np.testing.assert_array_equal(pred[m], np.asarray(out.completion)[m])


def test_empty_rows_are_never_decoded_and_change_nothing(setup):
  """Rows without a prompt token (padding of a short batch) are done at
  once (no tokens, mask 0); the real rows decode as in a batch without
  them (greedy: the same tokens), and any stop id ends a row."""
  params, prompt, mask = setup
  greedy = sampler.SamplingConfig(max_new_tokens=16, temperature=0.0,
                                  stop_ids=(EOS, 7))
  alone = sampler.sample(params, CFG, prompt, mask, jax.random.key(0), greedy)
  padded = sampler.sample(
      params, CFG, jnp.pad(prompt, ((0, 3), (0, 0))),
      jnp.pad(mask, ((0, 3), (0, 0))), jax.random.key(0), greedy)
  np.testing.assert_array_equal(padded.completion[:5], alone.completion)
  np.testing.assert_array_equal(padded.mask[:5], alone.mask)
  assert np.asarray(padded.mask[5:]).sum() == 0
  comp, m = np.asarray(alone.completion), np.asarray(alone.mask)
  for row, length in zip(comp, m.sum(1)):
    assert not set(row[:length - 1]) & {EOS, 7}  # stops at the first
    assert length == 16 or row[length - 1] in (EOS, 7)


def _groups(setup, copies=4):
  """A GRPO-like batch: each prompt ``copies`` times, then an empty row."""
  params, prompt, mask = setup
  return (params, jnp.pad(jnp.repeat(prompt, copies, 0), ((0, 1), (0, 0))),
          jnp.pad(jnp.repeat(mask, copies, 0), ((0, 1), (0, 0))))


def test_packing_holds_each_distinct_prompt_once_where_its_rows_find_it(
    setup):
  _, prompt, mask = _groups(setup)
  packed = packing.pack(prompt, mask, pad_id=0)
  assert packed.tokens.shape == (8, 9)  # 5 distinct prompts, 21 rows
  # lengths 9, 6, 4, 2, 1 first fit by decreasing length into rows of 9:
  # [9], [6, 2, 1], [4]
  np.testing.assert_array_equal((packed.segments > 0).sum(1),
                                [9, 9, 4, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(packed.segments.max(1)[:3], [1, 3, 1])
  real = np.asarray(mask) != 0
  found = packed.tokens[packed.row, packed.col]
  np.testing.assert_array_equal(found[real], np.asarray(prompt)[real])
  # distinct prompts, full width, one row each: nothing to save
  assert packing.pack(*setup[1:], pad_id=0) is None
  # a row not right-aligned: left to the padded prefill's contract
  assert packing.pack(prompt, mask.at[0, -1].set(0), pad_id=0) is None
  # 17 distinct full-width prompts twice: 17 rows rounded up to 32, a
  # power of two (few shapes to compile)
  rows = jnp.repeat(jnp.tile(prompt[:1], (17, 1)) + jnp.arange(17)[:, None],
                    2, 0)
  packed = packing.pack(rows, jnp.ones_like(rows), pad_id=0)
  assert packed.tokens.shape == (32, 9)
  assert (packed.segments.max(1) > 0).sum() == 17


@pytest.mark.parametrize("chunk", [0, 4])
def test_the_packed_prefill_equals_the_padded_one(setup, chunk):
  """Logits, next positions and every attended slot of the cache, with
  dense and with blocked attention."""
  params, prompt, mask = _groups(setup)
  cfg = dataclasses.replace(CFG, attention_chunk=chunk)
  packed = packing.pack(prompt, mask, pad_id=0)
  slots = prompt.shape[1] + 6
  ref = sampler._prefill(params, cfg, prompt, mask, slots)  # pylint: disable=protected-access
  got = sampler._prefill(params, cfg, prompt, mask, slots, packed)  # pylint: disable=protected-access
  real = np.asarray(mask) != 0
  np.testing.assert_allclose(got[0][real[:, -1]], ref[0][real[:, -1]],
                             atol=1e-5)
  np.testing.assert_array_equal(got[2], ref[2])
  assert int(got[1].index) == int(ref[1].index) == prompt.shape[1]
  filled = np.pad(real, ((0, 0), (0, 6)))  # the prompts' slots
  for got_c, ref_c, slot_axis in ((got[1].k, ref[1].k, 4),
                                  (got[1].v, ref[1].v, 3)):
    assert got_c.shape == ref_c.shape
    # [L, B, S, K, d]: the attended slots of every layer
    got_c, ref_c = (np.moveaxis(np.asarray(c), slot_axis, 2)
                    for c in (got_c, ref_c))
    np.testing.assert_allclose(got_c[:, filled], ref_c[:, filled], atol=1e-5)


def test_a_batch_of_groups_samples_the_policy_of_the_full_forward(setup):
  """Packed (each prompt prefilled once): the log-probs of the sampled
  tokens are those of one plain forward pass, and greedy decoding gives
  every copy of a prompt its prompt's tokens decoded alone."""
  params, prompt, mask = _groups(setup)
  assert packing.pack(prompt, mask, pad_id=0) is not None
  sampling = SETTINGS[0]
  out = sampler.sample(params, CFG, prompt, mask, jax.random.key(3), sampling)
  ref = sampler.sequence_logprobs(params, CFG, prompt, mask, out, sampling)
  assert np.asarray(out.mask[:-1]).sum(1).min() > 0
  assert np.asarray(out.mask[-1]).sum() == 0
  assert np.abs(np.asarray(ref) - np.asarray(out.logprobs)).max() <= 1e-5
  greedy = SETTINGS[2]
  alone = sampler.sample(params, CFG, *setup[1:], jax.random.key(0), greedy)
  copies = sampler.sample(params, CFG, prompt, mask, jax.random.key(0),
                          greedy)
  np.testing.assert_array_equal(copies.completion[:-1],
                                np.repeat(alone.completion, 4, 0))


def _numpy_blend(lp_s, lp_t, delta):
  """The largest beta on a grid of 2001 with KL(b_beta || pi) <= delta, and
  log b_beta, per row, in numpy."""
  betas = np.linspace(0.0, 1.0, 2001)
  out = np.array(lp_s, np.float64)
  chosen = np.zeros(lp_s.shape[0])
  for r in range(lp_s.shape[0]):
    best = 0.0
    for beta in betas:
      z = (1 - beta) * lp_s[r] + beta * lp_t[r]
      lb = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
      # (1e-7: float32 log-probs renormalised in float64 at beta = 0)
      if np.sum(np.exp(lb) * (lb - lp_s[r])) <= delta + 1e-7:
        best, out[r] = beta, lb
    chosen[r] = best
  return out, chosen


def test_trust_region_blend_is_the_largest_mixture_inside_the_region():
  rng = np.random.default_rng(0)
  lp_s = np.asarray(jax.nn.log_softmax(rng.normal(size=(6, 30)) * 2, -1))
  lp_t = np.asarray(jax.nn.log_softmax(rng.normal(size=(6, 30)) * 2, -1))
  for delta in (0.0, 0.05, 0.3, 100.0):
    got = np.asarray(sampler.trust_region_blend(lp_s, lp_t, delta))
    want, beta = _numpy_blend(lp_s, lp_t, delta)
    # bisection to 2^-20 against a grid of 1/2000: within a grid step
    np.testing.assert_allclose(got, want, atol=2e-2)
    kl = np.sum(np.exp(got) * (got - lp_s), -1)
    assert np.all(kl <= delta + 1e-5), (delta, kl)
    if delta == 0.0:
      np.testing.assert_allclose(got, lp_s, atol=1e-5)
    if delta == 100.0:  # the teacher itself is inside
      np.testing.assert_allclose(got, lp_t, atol=1e-5)
    if delta == 0.05:
      assert 0 < beta.min() and beta.max() < 1


@pytest.mark.parametrize("groups", [False, True])
def test_guided_sampling_draws_from_the_blend_of_both_full_forwards(
    setup, groups):
  """Sampling under a teacher's guide: each token's log-prob is the blend
  of the student's and the teacher's policies at that prefix (from one
  full forward pass of each); at delta 0 the tokens are the student's.
  Also for a batch of groups, both models prefilled packed and both
  caches grown over three decode phases."""
  params, prompt, mask = _groups(setup) if groups else setup
  teacher = decoder.init_params(CFG, jax.random.key(5))
  teacher = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, teacher)
  sampling = SETTINGS[-1] if groups else SETTINGS[0]
  plain = sampler.sample(params, CFG, prompt, mask, jax.random.key(7),
                         sampling)
  same = sampler.sample(params, CFG, prompt, mask, jax.random.key(7),
                        sampling, guide=(teacher, CFG, 0.0))
  np.testing.assert_array_equal(plain.completion, same.completion)
  out = sampler.sample(params, CFG, prompt, mask, jax.random.key(7),
                       sampling, guide=(teacher, CFG, 0.2))
  m = np.asarray(out.mask)
  assert m.sum() > 0
  assert not np.array_equal(np.asarray(out.completion), plain.completion)
  lp = [np.asarray(jax.nn.log_softmax(sampler.completion_logits(
      p, CFG, prompt, mask, out.completion, out.mask, sampling), -1))
        for p in (params, teacher)]
  blend = np.asarray(sampler.trust_region_blend(lp[0], lp[1], 0.2))
  picked = np.take_along_axis(blend, np.asarray(out.completion)[..., None],
                              -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logprobs) * m, picked * m,
                             atol=1e-4)
  kl = np.sum(np.exp(blend) * (blend - lp[0]), -1)
  assert np.all(kl[m > 0] <= 0.2 + 1e-4)


def test_keys_on_one_device_or_the_mesh_and_every_temperature_run_one_program(
    setup):
  """The rollouts' keys are made on one device, the evaluation's under the
  mesh: the same bytes, and one compiled decode for both (it compiled
  twice, 4 s each on SmolLM2, before the sampler put its scalars on the
  mesh). Greedy and sampled decoding (an evaluation runs both) share it
  too: the temperature is traced."""
  from mopd_jax import parallel
  params, prompt, mask = setup
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  greedy = sampler.SamplingConfig(max_new_tokens=3, temperature=0.0,
                                  stop_ids=(EOS,))
  key = jax.random.key(0)
  with parallel.activate(mesh):
    first = sampler.sample(params, CFG, prompt, mask, key, greedy)
    compiled = sampler._decode._cache_size()
    second = sampler.sample(params, CFG, prompt, mask, jax.device_put(
        key, parallel.replicated(mesh)), greedy)
    warm = sampler.sample(params, CFG, prompt, mask, key,
                          dataclasses.replace(greedy, temperature=0.7))
  assert sampler._decode._cache_size() == compiled
  np.testing.assert_array_equal(first.completion, second.completion)
  assert (np.asarray(warm.completion) != np.asarray(first.completion)).any()


def test_budget_groups_split_concise_rows_from_long_ones():
  groups = sampler.budget_groups(np.array([24, 4, 24, 6, 4]), 24, unit=2)
  (long_rows, long_width, long_n), (short, short_width, short_n) = groups
  np.testing.assert_array_equal(long_rows, [0, 2])
  np.testing.assert_array_equal(short, [1, 3, 4])
  assert (long_width, long_n, short_width, short_n) == (2, 24, 4, 6)
  # one group: every row's budget above n / 2, or every row's at most
  ((rows, width, n),) = sampler.budget_groups(np.array([13, 24, 20]), 24)
  assert (list(rows), width, n) == ([0, 1, 2], 3, 24)
  ((rows, width, n),) = sampler.budget_groups(np.array([4, 8]), 24)
  assert (list(rows), width, n) == ([0, 1], 2, 8)


def test_rows_sampled_by_budget_are_cut_at_theirs_and_scored_as_sampled(
    setup):
  """Long and concise rows sampled by two calls (each padded with empty
  rows) come back in their own order: every row runs to its own budget
  (no stop token) and its log-probs are those of one full forward pass
  over its own prompt; the long rows are those of a call of their own."""
  params, prompt, mask = setup
  sampling = sampler.SamplingConfig(max_new_tokens=24, stop_ids=())
  budgets = np.array([24, 4, 24, 6, 4])
  key = jax.random.key(3)
  out = sampler.sample_by_budget(params, CFG, np.asarray(prompt),
                                 np.asarray(mask), key, sampling, budgets)
  assert out.completion.shape == (5, 24)
  np.testing.assert_array_equal(np.asarray(out.mask).sum(1), budgets)
  ref = sampler.sequence_logprobs(params, CFG, prompt, mask, out, sampling)
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref),
                             atol=1e-5)
  alone = sampler.sample(params, CFG, prompt[::2][:2], mask[::2][:2], key,
                         sampling)
  np.testing.assert_array_equal(np.asarray(out.completion)[[0, 2]],
                                alone.completion)
