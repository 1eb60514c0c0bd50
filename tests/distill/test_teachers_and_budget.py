"""MOPD plumbing: teacher specs and checks, oracle and label-free token
routing, routed scoring, and the Open-MOPD weights against hand-computed
cases."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import parallel, runs
from mopd_jax.errors import ConfigError
from mopd_jax.distill import budget, teachers
from mopd_jax.models.config import ModelConfig
from mopd_jax.models.tokenizer import CharTokenizer

DOMAINS = ("add", "chain", "sort")


def test_parse_teachers_template_and_pairs():
  assert runs.runs_by_domain("runs/e_{domain}", DOMAINS) == {
      d: f"runs/e_{d}" for d in DOMAINS}
  assert runs.runs_by_domain("sort=c, add=a,chain=b", DOMAINS) == {
      "add": "a", "chain": "b", "sort": "c"}
  # A file domain's path never lands in a folder name: its label does.
  assert runs.runs_by_domain("runs/e_{domain}",
                                 ("math:/d/gsm8k.jsonl", "add")) == {
      "math:/d/gsm8k.jsonl": "runs/e_math_gsm8k", "add": "runs/e_add"}
  with pytest.raises(ConfigError, match="teachers: no run for domain 'sort'"):
    runs.runs_by_domain("add=a,chain=b", DOMAINS)
  with pytest.raises(ConfigError, match="not domain=run_dir"):
    runs.runs_by_domain("add=a,chain,sort=c", DOMAINS)
  with pytest.raises(ConfigError, match="'math' is not one of the domains"):
    runs.runs_by_domain("add=a,chain=b,sort=c,math=d", DOMAINS)


def test_oracle_router_sends_each_sample_to_its_domain_teacher():
  found = [teachers.Teacher(d, "", None, None) for d in ("sort", "add",
                                                          "chain")]
  router = teachers.OracleRouter(DOMAINS, found)
  ids = np.array([0, 1, 2, 2, 0, 1])
  routed = router.route(ids)
  assert [found[j].domain for j in routed] == [DOMAINS[i] for i in ids]


def test_token_routers_pick_each_tokens_teacher_as_a_loop_does():
  """The three label-free rules against a loop over tokens (novelty
  computed with the base term, which cancels), ``pick`` against indexing,
  and the confusion matrix against counting."""
  rng = np.random.default_rng(0)
  J, B, T = 3, 4, 5
  every = dict(teacher_logp=rng.normal(size=(J, B, T)),
               teacher_entropy=rng.uniform(size=(J, B, T)),
               align_kl=rng.uniform(size=(J, B, T)),
               teacher_hidden=rng.normal(size=(J, B, T, 2)))
  base_logp = rng.normal(size=(B, T))
  rules = {name: teachers.ROUTERS[name](DOMAINS, []) for name in
           ("entropy", "novelty", "expert_align")}
  assert all(r.per_token for r in rules.values())
  assert rules["expert_align"].needs_align
  assert not rules["novelty"].needs_align
  for name, score in (
      ("entropy", lambda j, b, t: -every["teacher_entropy"][j, b, t]),
      ("novelty", lambda j, b, t: every["teacher_logp"][j, b, t]
       - base_logp[b, t]),
      ("expert_align", lambda j, b, t: -every["align_kl"][j, b, t])):
    choice = rules[name].choose(every)
    want = [[max(range(J), key=lambda j: score(j, b, t)) for t in range(T)]
            for b in range(B)]
    assert choice.tolist() == want, name
  choice = rules["entropy"].choose(every)
  picked = teachers.pick(every, choice)
  for b in range(B):
    for t in range(T):
      j = choice[b, t]
      assert picked["teacher_logp"][b, t] == every["teacher_logp"][j, b, t]
      np.testing.assert_array_equal(picked["teacher_hidden"][b, t],
                                    every["teacher_hidden"][j, b, t])
  mask = rng.integers(0, 2, (B, T))
  seq_ids = np.array([0, 2, 2, 1])
  matrix = teachers.confusion(choice, mask, seq_ids, DOMAINS, DOMAINS)
  for i, d in enumerate(DOMAINS):
    rows = seq_ids == i
    for j, t in enumerate(DOMAINS):
      assert matrix[f"route/{d}/{t}"] == (
          np.sum((choice[rows] == j) * mask[rows]), np.sum(mask[rows]))


def test_score_runs_each_teacher_on_exactly_its_rows():
  """Fake scorers tag their outputs; every row must come back from its own
  teacher, and each teacher must see only its rows (plus padding copies)."""
  mesh = parallel.make_mesh(data=-1, fsdp=1, tensor=1)
  batch, width = 12, 5
  rng = np.random.default_rng(0)
  arrays = {"prompt": rng.integers(3, 50, (batch, 4)).astype(np.int32),
            "prompt_mask": np.ones((batch, 4), np.int32),
            "completion": rng.integers(3, 50, (batch, width)).astype(
                np.int32),
            "mask": np.ones((batch, width), np.int32)}
  teacher_ids = np.array([2, 0, 1, 2, 2, 0, 1, 1, 2, 0, 2, 2])
  seen = {}

  def fake(j, hidden):
    def scorer(params, prompt, prompt_mask, completion, mask):
      seen[j] = np.asarray(completion)
      out = {"teacher_logp": completion.astype(jnp.float32) + 100.0 * j}
      out["teacher_hidden"] = jnp.full(completion.shape + (hidden,), j + 1.0)
      return out
    return scorer

  widths = (3, 2, 4)  # teachers of different hidden sizes
  out = teachers.score([fake(j, widths[j]) for j in range(3)], [None] * 3,
                   teacher_ids, arrays, mesh, hidden_width=4)
  np.testing.assert_array_equal(
      out["teacher_logp"], arrays["completion"] + 100.0 * teacher_ids[:, None])
  for j in range(3):
    rows = np.flatnonzero(teacher_ids == j)
    assert len(seen[j]) % 8 == 0 and len(seen[j]) >= rows.size
    np.testing.assert_array_equal(seen[j][:rows.size],
                                  arrays["completion"][rows])
    np.testing.assert_array_equal(seen[j][rows.size:],
                                  arrays["completion"][rows[:1]].repeat(
                                      len(seen[j]) - rows.size, 0))
    hid = out["teacher_hidden"][rows]
    assert np.all(hid[..., :widths[j]] == j + 1.0)
    assert np.all(hid[..., widths[j]:] == 0.0)


def test_token_share_weights_hand_computed():
  w = budget.token_share_weights(np.array([100, 300, 0, 600]), np.ones(4))
  np.testing.assert_allclose(w, [10 / 3, 10 / 9, 0.0, 5 / 9], rtol=1e-9)
  shares = np.array([100, 300, 0, 600]) / 1000
  assert np.isclose(np.sum(shares * w), 1.0)
  w = budget.token_share_weights(np.array([200, 200]), np.array([3.0, 1.0]))
  np.testing.assert_allclose(w, [1.5, 0.5])


def test_token_share_power_moves_shares_part_way():
  tokens = np.array([100, 300, 0, 600])
  w = budget.token_share_weights(tokens, np.ones(4), power=0.5)
  raw = np.sqrt([1 / 3 / 0.1, 1 / 3 / 0.3, 0.0, 1 / 3 / 0.6])
  np.testing.assert_allclose(w, raw / np.sum(raw * tokens / 1000), rtol=1e-9)
  loss_share = w * tokens / 1000
  assert np.isclose(loss_share.sum(), 1.0)
  # the smallest domain's loss share lies between its token share and target
  assert 0.1 < loss_share[0] < 1 / 3
  np.testing.assert_allclose(
      budget.token_share_weights(tokens, np.ones(4), power=0.0),
      [1.0, 1.0, 0.0, 1.0])


def test_gap_factors_hand_computed():
  gap = np.array([0.2, 0.4, 0.1, 0.0])
  seen = np.array([True, True, True, False])
  f = budget.gap_factors(gap, seen, np.ones(4) / 4, 1.0, 0.5, 2.0)
  ref = 0.7 / 3
  np.testing.assert_allclose(f, [0.2 / ref, 0.4 / ref, 0.5, 1.0], rtol=1e-9)
  f = budget.gap_factors(gap, seen, np.ones(4) / 4, 2.0, 0.1, 10.0)
  np.testing.assert_allclose(f[:3], (gap[:3] / ref) ** 2, rtol=1e-9)
  np.testing.assert_array_equal(
      budget.gap_factors(gap, np.zeros(4, bool), np.ones(4), 1.0, 0.5, 2.0),
      np.ones(4))


def test_gap_state_keeps_each_domains_first_gap():
  state = budget.init_gap_state(3)
  state = budget.update_gap_state(state, np.array([0, 0, 2]),
                                np.array([1.0, 3.0, 0.5]), 0.5)
  np.testing.assert_allclose(state["initial"], [2.0, 0.0, 0.5])
  state = budget.update_gap_state(state, np.array([0, 1]),
                                np.array([1.0, 4.0]), 0.5)
  np.testing.assert_allclose(state["signal"], [1.5, 4.0, 0.5])
  np.testing.assert_allclose(state["initial"], [2.0, 4.0, 0.5])
  np.testing.assert_allclose(budget.remaining_gap(state, False),
                             [1.5, 4.0, 0.5])
  np.testing.assert_allclose(budget.remaining_gap(state, True),
                             [0.75, 1.0, 1.0])


def test_normalise_by_tokens_and_gap_statistics():
  w = budget.normalise_by_tokens(np.array([2.0, 1.0]), np.array([10, 30]))
  assert np.isclose((w * [10, 30]).sum() / 40, 1.0)
  np.testing.assert_allclose(w / w[1], [2.0, 1.0])
  signal = np.array([[-0.5, 0.25, 9.0], [0.1, -0.3, -0.2]])
  mask = np.array([[1, 1, 0], [1, 1, 1]])
  domains = np.array([1, 0])
  ids, values = budget.gap_observations(signal, mask, domains, "abs_signal")
  np.testing.assert_array_equal(ids, [1, 1, 0, 0, 0])
  np.testing.assert_allclose(values, [0.5, 0.25, 0.1, 0.3, 0.2])
  ids, values = budget.gap_observations(signal, mask, domains, "reverse_kl")
  np.testing.assert_allclose(values, [0.5, -0.25, -0.1, 0.3, 0.2])
  ids, values = budget.gap_observations(signal, mask, domains, "sequence_kl")
  np.testing.assert_array_equal(ids, [1, 0])
  np.testing.assert_allclose(values, [0.25, 0.4])
  with pytest.raises(ConfigError):
    budget.gap_observations(signal, mask, domains, "median")


def test_proxy_teacher_scores_with_shifted_logits():
  """Three models with signs (+, +, -) score ``log softmax(z_b + z_e -
  z_i)``; with the student's base equal to the expert's init, that is the
  expert itself."""
  import jax
  from mopd_jax.models import decoder
  from mopd_jax.rollout import sampler
  tok = CharTokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  base, expert, init = (decoder.init_params(cfg, jax.random.key(i))
                        for i in range(3))
  rng = np.random.default_rng(1)
  args = (rng.integers(3, 50, (8, 5)).astype(np.int32),
          np.ones((8, 5), np.int32),
          rng.integers(3, 50, (8, 6)).astype(np.int32),
          np.ones((8, 6), np.int32))
  proxy = teachers.make_scorer((cfg,) * 3, (1.0, 1.0, -1.0), False, False)
  alone = teachers.make_scorer((cfg,), (1.0,), False, False)
  np.testing.assert_allclose(proxy((init, expert, init), *args)["teacher_logp"],
                             alone((expert,), *args)["teacher_logp"],
                             rtol=1e-5, atol=1e-5)
  sampling = sampler.SamplingConfig()
  z = [np.asarray(sampler.completion_logits(p, cfg, *args, sampling))
       for p in (base, expert, init)]
  want = jax.nn.log_softmax(z[0] + z[1] - z[2], -1)
  want = np.take_along_axis(np.asarray(want), args[2][..., None], -1)[..., 0]
  np.testing.assert_allclose(proxy((base, expert, init), *args)["teacher_logp"],
                             want, rtol=1e-5, atol=1e-5)


def test_teachers_compute_as_the_students_run_says(smoke_run):
  """A teacher keeps its architecture and weights but runs in the
  student's precision, remat and attention (a bfloat16 MOPD run scores in
  bfloat16, and holds the teachers in bfloat16, whatever the expert
  trained in)."""
  run_dir = str(smoke_run[0])
  own = ModelConfig(**runs.load_run_config(run_dir).model.to_dict())
  student = dataclasses.replace(own, dtype="bfloat16", remat=True,
                                attention_chunk=16)
  mesh = parallel.make_mesh(data=-1)
  (teacher,) = teachers.load_teachers({"add": run_dir}, CharTokenizer(),
                                      mesh, with_init=False,
                                      execution=student)
  assert teacher.model.cfg == dataclasses.replace(student,
                                                  param_dtype="bfloat16")
  assert own.dtype == own.param_dtype == "float32" and not own.remat
  # Frozen weights held in the precision they compute in.
  assert {x.dtype.name for x in jax.tree.leaves(teacher.model.params)} == {
      "bfloat16"}


def test_delta_teacher_scores_the_base_shifted_by_every_expert():
  """``delta_models`` + ``make_scorer`` score ``log softmax(z_b + lambda
  sum_i (z_i - z_b))`` (checked against each model's full logits); the
  router sends every sample to it; experts of two bases are refused."""
  import jax
  from mopd_jax.models import decoder
  from mopd_jax.rollout import sampler
  tok = CharTokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, embed_dim=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  base, *experts = (decoder.init_params(cfg, jax.random.key(i))
                    for i in range(4))
  as_teachers = [teachers.Teacher(d, f"runs/{d}", teachers.Model(cfg, p),
                                  teachers.Model(cfg, base), "runs/base")
                 for d, p in zip("abc", experts)]
  models, signs = teachers.delta_models(as_teachers, 0.5)
  assert signs == (1.0 - 3 * 0.5, 0.5, 0.5, 0.5)
  rng = np.random.default_rng(1)
  args = (rng.integers(3, 50, (8, 5)).astype(np.int32),
          np.ones((8, 5), np.int32),
          rng.integers(3, 50, (8, 6)).astype(np.int32),
          np.ones((8, 6), np.int32))
  scorer = teachers.make_scorer(tuple(m.cfg for m in models), signs, False,
                                False)
  got = scorer(tuple(m.params for m in models), *args)["teacher_logp"]
  sampling = sampler.SamplingConfig()
  z = [np.asarray(sampler.completion_logits(p, cfg, *args, sampling),
                  np.float64) for p in (base, *experts)]
  target = z[0] + 0.5 * sum(zi - z[0] for zi in z[1:])
  target = target - np.log(np.exp(target - target.max(-1, keepdims=True)
                                  ).sum(-1, keepdims=True)) - target.max(
                                      -1, keepdims=True)
  want = np.take_along_axis(target, args[2][..., None], -1)[..., 0]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  router = teachers.ROUTERS["delta"](list("abc"), as_teachers)
  assert router.route(np.array([0, 2, 1])).tolist() == [0, 0, 0]
  other = dataclasses.replace(as_teachers[1], init_dir="runs/other_base")
  with pytest.raises(ConfigError, match="experts trained from one base"):
    teachers.delta_models([as_teachers[0], other], 0.5)
