"""The MOPD stage: its loss against naive full-logit computations (teachers
of two sizes, routed), the reward refresh, distillation closing the gap to a
teacher, and the CLI end to end."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import ROOT, train_cli
from mopd_jax import stages
from mopd_jax import parallel
from mopd_jax.data import batching
from mopd_jax.distill import budget
from mopd_jax.distill import teachers as teacher_lib
from mopd_jax.errors import ConfigError
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.models.tokenizer import CharTokenizer
from mopd_jax.objectives import opd
from mopd_jax.ops import vocab
from mopd_jax.rollout import sampler
from mopd_jax.stages import grpo as grpo_stage
from mopd_jax.stages import mopd as mopd_stage
from mopd_jax.stages import on_policy

TOK = CharTokenizer()
SAMPLING = sampler.SamplingConfig(max_new_tokens=6, stop_ids=(TOK.eos_id,))
OPS = vocab.DEFAULT_OPS


def _cfg(embed, layers=1):
  return ModelConfig(vocab_size=TOK.vocab_size, embed_dim=embed,
                     num_layers=layers, num_heads=2, num_kv_heads=1,
                     head_dim=16, mlp_dim=2 * embed)


def _sections(**opd_overrides):
  c = stages.defaults("mopd")
  c.rl.update(minibatches=1)
  c.opd.update(opd_overrides)
  return c.rl, c.opd


def _batch(student, teachers, teacher_ids):
  """A sampled batch with its routed teacher scores, as the stage builds it:
  ``teacher_ids`` [B] routes whole samples (each teacher scores its rows);
  [B, T] routes tokens (every teacher scores every row, ``teachers.pick``
  keeps each token's own)."""
  prompts = ["add 12+7=", "sort dcba:", "rev xyz:", "add 3+4="]
  prompt, prompt_mask = batching.encode_prompts(prompts, TOK, 12)
  rollout = sampler.sample(student[1], student[0], prompt, prompt_mask,
                           jax.random.key(3), SAMPLING)
  mask = np.asarray(rollout.mask)
  data = dict(prompt=np.asarray(prompt), prompt_mask=np.asarray(prompt_mask),
              completion=np.asarray(rollout.completion), mask=mask,
              old_logp=np.asarray(rollout.logprobs),
              advantages=np.zeros(4, np.float32),
              keep=np.ones(4, np.float32), weight=np.ones(4, np.float32))
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  scorers = [teacher_lib.make_scorer((cfg,), (1.0,), True, True)
             for cfg, _ in teachers]
  params = [(p,) for _, p in teachers]
  width = max(cfg.embed_dim for cfg, _ in teachers)
  if teacher_ids.ndim == 1:
    data.update(teacher_lib.score(scorers, params, teacher_ids, data, mesh,
                                  width))
    teacher_ids = np.broadcast_to(teacher_ids[:, None], mask.shape)
  else:
    every = [teacher_lib.score([s], [p], np.zeros(4, np.int32), data, mesh,
                               width) for s, p in zip(scorers, params)]
    data.update(teacher_lib.pick(
        {k: np.stack([e[k] for e in every]) for k in every[0]}, teacher_ids))
  data["teacher_id"] = np.array(teacher_ids, np.int32)
  return data


def _models():
  student = (_cfg(32), decoder.init_params(_cfg(32), jax.random.key(0)))
  teachers = [(_cfg(32), decoder.init_params(_cfg(32), jax.random.key(1))),
              (_cfg(48, 2), decoder.init_params(_cfg(48, 2),
                                                jax.random.key(2)))]
  return student, teachers


def _teacher_logits(teachers, data):
  """Each token's own teacher's full logits, the naive way."""
  zs = np.stack([np.asarray(sampler.completion_logits(
      p, cfg, data["prompt"], data["prompt_mask"], data["completion"],
      data["mask"], SAMPLING)) for cfg, p in teachers])
  return np.take_along_axis(zs, data["teacher_id"][None, ..., None],
                            0)[0]


def _student_log_softmax(params, cfg, data):
  """The student's full [B, T, V] log-probabilities, the naive way."""
  return jax.nn.log_softmax(sampler.completion_logits(
      params, cfg, data["prompt"], data["prompt_mask"], data["completion"],
      data["mask"], SAMPLING), -1)


def _teacher_w(teachers):
  """The stage's stacked teacher unembeddings, one single-model teacher per
  entry."""
  return mopd_stage.stacked_unembeddings(
      [(p,) for _, p in teachers], [(cfg,) for cfg, _ in teachers])


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.sum(mask)


@pytest.mark.parametrize("per_token", [False, True])
def test_routed_scores_and_the_kl_loss_match_full_logits(per_token):
  """Teachers of two sizes, routed by sample or (as a token router does)
  token by token: the scores and the KL loss match each token's own
  teacher's full logits."""
  student, teachers = _models()
  ids = (np.random.default_rng(1).integers(0, 2, (4, SAMPLING.max_new_tokens))
         if per_token else np.array([1, 0, 1, 0]))
  data = _batch(student, teachers, ids.astype(np.int32))
  if per_token:  # the rows mix teachers
    assert all(0 < r.sum() < len(r) for r in data["teacher_id"][:2])
  zt = _teacher_logits(teachers, data)
  mask = data["mask"].astype(np.float32)
  lt = np.asarray(jax.nn.log_softmax(zt, -1))
  picked = np.take_along_axis(lt, data["completion"][..., None], -1)[..., 0]
  np.testing.assert_allclose(data["teacher_logp"] * mask, picked * mask,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(data["teacher_entropy"] * mask,
                             -(np.exp(lt) * lt).sum(-1) * mask, rtol=1e-5,
                             atol=1e-5)
  rl, opd_cfg = _sections(loss="kl", kl_alpha=0.3)
  loss_fn = opd.make_loss(student[0], SAMPLING, rl, opd_cfg, False, OPS)
  teacher_w = _teacher_w(teachers)

  def naive(params):
    ls = _student_log_softmax(params, student[0], data)
    lt = jax.nn.log_softmax(zt, -1)
    reverse = jnp.sum(jnp.exp(ls) * (ls - lt), -1)
    forward = jnp.sum(jnp.exp(lt) * (lt - ls), -1)
    return _masked_mean(0.3 * forward + 0.7 * reverse, mask)

  value_and_grad = jax.jit(jax.value_and_grad(
      lambda p, d: loss_fn(p, d, teacher_w)[0]))
  loss, got = value_and_grad(student[1], data)
  want_loss, want = jax.jit(jax.value_and_grad(naive))(student[1])
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_stacked_teachers_score_every_token_as_one_pass_each_does():
  """``opd.teacher_vmap``: three teachers of one architecture, stacked and
  vmapped, give each teacher's own pass's log-probs, entropies and hidden
  states; teachers of two architectures are not stacked."""
  student, _ = _models()
  models = [(_cfg(32), decoder.init_params(_cfg(32), jax.random.key(k)))
            for k in (1, 2, 3)]
  data = _batch(student, models[:1], np.zeros(4, np.int32))
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  scorers = [teacher_lib.make_scorer((cfg,), (1.0,), True, True)
             for cfg, _ in models]
  params = [(p,) for _, p in models]
  one_each = teacher_lib.score_every(scorers, params, data, mesh, 32)
  stacked = teacher_lib.stack_teachers(scorers, params)
  together = teacher_lib.score_every(scorers, [None] * 3, data, mesh, 32,
                                     stacked)
  assert one_each.keys() == together.keys() == {
      "teacher_logp", "teacher_entropy", "teacher_hidden"}
  assert one_each["teacher_logp"].shape == (3, 4, SAMPLING.max_new_tokens)
  for key in one_each:
    np.testing.assert_allclose(together[key], one_each[key], rtol=1e-5,
                               atol=1e-5)
  # the teachers differ, so each slot holds its own teacher's scores
  assert not np.allclose(one_each["teacher_logp"][0],
                         one_each["teacher_logp"][1])
  _, mixed = _models()
  assert teacher_lib.stack_teachers(
      [teacher_lib.make_scorer((cfg,), (1.0,), True, True)
       for cfg, _ in mixed], [(p,) for _, p in mixed]) is None


def test_the_stage_stacks_a_token_routers_teachers_as_teacher_vmap_says():
  """``MOPD._stack``: ``on`` stacks teachers of one architecture and drops
  their separate copies; ``auto`` does not on the CPU; ``off``, routing
  by sample or proxy teachers never stack; ``on`` with two architectures
  is one ConfigError."""
  student, _ = _models()
  same = [(_cfg(32), decoder.init_params(_cfg(32), jax.random.key(k)))
          for k in (1, 2)]

  def stage(models, router="entropy", proxy=False):
    method = mopd_stage.MOPD.__new__(mopd_stage.MOPD)
    method.config = stages.defaults("mopd")
    method.config.opd.proxy_teacher = proxy
    method.scorers = [teacher_lib.make_scorer((cfg,), (1.0,), True, False)
                      for cfg, _ in models]
    method.teacher_params = [(p,) for _, p in models]
    method.teachers = [teacher_lib.Teacher(d, "", teacher_lib.Model(cfg, p),
                                           None)
                       for d, (cfg, p) in zip("ab", models)]
    method.router = teacher_lib.ROUTERS[router](("a", "b"), method.teachers)
    return method

  method = stage(same)
  scorer, stacked = method._stack("on")
  assert jax.tree.leaves(stacked)[0].shape[0] == 2
  assert method.teacher_params == [None, None]
  assert all(t.model.params is None and t.model.cfg == same[0][0]
             for t in method.teachers)
  assert stage(same)._stack("auto") is None  # the CPU
  assert not teacher_lib.room_to_stack([(p,) for _, p in same])
  for method in (stage(same)._stack("off"),
                 stage(same, router="oracle")._stack("on"),
                 stage(same, proxy=True)._stack("on")):
    assert method is None
  with pytest.raises(ConfigError, match="'on' needs teachers of one"):
    stage(_models()[1])._stack("on")


def test_expert_align_scores_are_the_full_kl_to_every_teacher():
  """``make_align_kl``: ``KL(pi || T_j)`` per token for every teacher (two
  sizes, hidden states zero-padded), against full logits."""
  student, teachers = _models()
  data = _batch(student, teachers, np.zeros((4, SAMPLING.max_new_tokens),
                                            np.int32))
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  width = max(cfg.embed_dim for cfg, _ in teachers)
  hidden = np.stack([teacher_lib.score(
      [teacher_lib.make_scorer((cfg,), (1.0,), False, True)], [(p,)],
      np.zeros(4, np.int32), data, mesh, width)["teacher_hidden"]
      for cfg, p in teachers])
  align = opd.make_align_kl(student[0], 1.0, OPS)
  got = np.asarray(align(student[1], {k: data[k] for k in (
      "prompt", "prompt_mask", "completion", "mask")}, jnp.asarray(hidden),
      _teacher_w(teachers)))
  ls = np.asarray(_student_log_softmax(student[1], student[0], data))
  mask = data["mask"].astype(np.float32)
  for j, (cfg, p) in enumerate(teachers):
    lt = np.asarray(jax.nn.log_softmax(sampler.completion_logits(
        p, cfg, data["prompt"], data["prompt_mask"], data["completion"],
        data["mask"], SAMPLING), -1))
    want = np.sum(np.exp(ls) * (ls - lt), -1)
    np.testing.assert_allclose(got[j] * mask, want * mask, rtol=1e-4,
                               atol=1e-5)
  assert not np.allclose(got[0] * mask, got[1] * mask, atol=1e-3)


def test_topk_loss_with_every_extra_matches_full_logits():
  """``opd.loss=topk`` with gating, entropy-aware forward KL, an outcome
  advantage and per-sequence Open-MOPD weights, against the same terms
  written out on full [B, T, V] logits."""
  student, teachers = _models()
  data = _batch(student, teachers, np.array([0, 1, 1, 0], np.int32))
  rng = np.random.default_rng(0)
  data["advantages"] = rng.normal(size=4).astype(np.float32)
  data["weight"] = rng.uniform(0.5, 2.0, size=4).astype(np.float32)
  zt = _teacher_logits(teachers, data)
  mask = data["mask"].astype(np.float32)
  lt = jax.nn.log_softmax(zt, -1)
  h_t = -np.sum(np.exp(lt) * lt, -1)
  # Midway between the two middle entropies: no token sits on the threshold.
  n = int(mask.sum())
  threshold = float(np.sort(h_t[mask > 0])[n // 2 - 1:n // 2 + 1].mean())
  rl, opd_cfg = _sections(loss="topk", top_k=5, gate=True, lambda_orm=0.5,
                          entropy_threshold=threshold)
  loss_fn = opd.make_loss(student[0], SAMPLING, rl, opd_cfg, False, OPS)
  teacher_w = _teacher_w(teachers)

  def naive(params):
    ls = _student_log_softmax(params, student[0], data)
    logp = jnp.take_along_axis(ls, data["completion"][..., None], -1)[..., 0]
    gate = (data["teacher_logp"] > data["old_logp"]).astype(jnp.float32)
    top = jnp.argsort(-jax.lax.stop_gradient(ls), -1)[..., :5]
    top_s = jnp.take_along_axis(ls, top, -1)
    top_t = jnp.take_along_axis(lt, top, -1)
    p = jnp.exp(top_s) / jnp.sum(jnp.exp(top_s), -1, keepdims=True)
    dense = -jnp.sum(jax.lax.stop_gradient(p * (top_t - top_s)) * top_s, -1)
    outcome = -0.5 * data["advantages"][:, None] * jnp.exp(
        logp - data["old_logp"])
    forward = jnp.sum(jnp.exp(lt) * (lt - ls), -1)
    per_token = (gate * dense + outcome
                 + jnp.where(h_t > threshold, forward, 0.0))
    return _masked_mean(per_token * data["weight"][:, None], mask)

  assert 0 < np.sum((h_t > threshold) * mask) < mask.sum()
  gate = (data["teacher_logp"] > data["old_logp"]) * mask
  assert 0 < gate.sum() < mask.sum()
  loss, got = jax.jit(jax.value_and_grad(
      lambda p, d: loss_fn(p, d, teacher_w)[0]))(student[1], data)
  want_loss, want = jax.jit(jax.value_and_grad(naive))(student[1])
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_pg_loss_is_reinforce_on_the_signal_and_refresh_rescores():
  student, teachers = _models()
  data = _batch(student, teachers, np.array([0, 1, 0, 1], np.int32))
  mask = data["mask"].astype(np.float32)
  rl, opd_cfg = _sections(loss="pg")
  teacher_w = jnp.zeros((2, 1, 1))

  def logp_of(params):
    return sampler.sequence_logprobs(
        params, student[0], data["prompt"], data["prompt_mask"],
        sampler.Rollout(data["completion"], None, data["mask"]), SAMPLING)

  def naive(params):
    a = data["teacher_logp"] - data["old_logp"]
    return _masked_mean(-a * logp_of(params), mask)

  loss_fn = opd.make_loss(student[0], SAMPLING, rl, opd_cfg, False, OPS)
  got = jax.jit(jax.grad(lambda p, d: loss_fn(p, d, teacher_w)[0]))(
      student[1], data)
  for g, w in zip(jax.tree.leaves(got),
                  jax.tree.leaves(jax.jit(jax.grad(naive))(student[1]))):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)

  moved = jax.tree.map(lambda x: x * 1.1, student[1])
  current = np.asarray(logp_of(moved))
  for refresh, student_logp in ((False, data["old_logp"]), (True, current)):
    fn = opd.make_loss(student[0], SAMPLING, rl, opd_cfg, refresh, OPS)
    total, count = jax.jit(fn)(moved, data, teacher_w)[1]["signal"]
    np.testing.assert_allclose(
        total / count,
        np.sum((data["teacher_logp"] - student_logp) * mask) / mask.sum(),
        rtol=1e-4)
  assert not np.allclose(current * mask, data["old_logp"] * mask, atol=1e-3)


@pytest.mark.parametrize("loss", ["kl", "topk"])
def test_refresh_does_not_change_a_dense_loss(loss):
  """Under a dense loss (``opd.loss=kl``, the exact KL under the current
  student, or ``topk``) without the gate, the refresh only changes the
  logged signal: an ablation row with ``reward_refresh`` alone equals plain
  MOPD (``mopd.as_trained``). The gradients are the same sums, though XLA
  may fuse the two programs differently: equal to float32 reassociation
  here (XLA:CPU's older emitters, conftest.py; bit-identical under its
  defaults, as the imbalanced study's runs measured)."""
  student, teachers = _models()
  data = _batch(student, teachers, np.array([1, 0, 1, 0], np.int32))
  rl, opd_cfg = _sections(loss=loss)
  teacher_w = _teacher_w(teachers)
  moved = jax.tree.map(lambda x: x * 1.1, student[1])
  out = []
  for refresh in (False, True):
    fn = opd.make_loss(student[0], SAMPLING, rl, opd_cfg, refresh, OPS)
    (loss, metrics), grad = jax.jit(jax.value_and_grad(
        fn, has_aux=True))(moved, data, teacher_w)
    out.append((loss, grad, metrics["signal"][0]))
  np.testing.assert_array_equal(out[0][0], out[1][0])
  for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-9)
  assert abs(float(out[0][2]) - float(out[1][2])) > 1e-3


def test_as_trained_drops_the_refresh_only_where_it_changes_nothing():
  """A study links a MOPD variant to plain MOPD where the two are equal
  ``as_trained``: reward refresh under a dense loss without the gate (the
  test above); under the ``pg`` loss or the gate it is a run of its own."""
  plain = stages.recipe("mopd", "").to_dict()

  def with_(fields, **opd_fields):
    return dict(fields, opd=dict(fields["opd"], **opd_fields))
  refreshed = dict(plain, open_mopd=dict(plain["open_mopd"],
                                         reward_refresh=True))
  assert plain["opd"]["loss"] == "kl"
  assert mopd_stage.as_trained(refreshed) == mopd_stage.as_trained(plain)
  assert mopd_stage.as_trained(with_(refreshed, loss="topk")) == (
      mopd_stage.as_trained(with_(plain, loss="topk")))
  for opd_fields in ({"loss": "pg"}, {"gate": True}):
    assert mopd_stage.as_trained(with_(refreshed, **opd_fields)) != (
        mopd_stage.as_trained(with_(plain, **opd_fields)))
  # anything else that differs still differs
  assert mopd_stage.as_trained(with_(refreshed, kl_alpha=1.0)) != (
      mopd_stage.as_trained(plain))


def test_distillation_closes_the_gap_to_a_teacher():
  """The stage's own loss, scorer and minibatch loop: 14 steps of sampled-
  token MOPD from a random student towards a sharper random teacher must
  cut the per-token reverse KL (estimated on the student's samples) by more
  than half."""
  cfg = _cfg(32)
  student = decoder.init_params(cfg, jax.random.key(0))
  teacher = decoder.init_params(cfg, jax.random.key(1))
  teacher["final_norm"] = teacher["final_norm"] * 20.0  # a sharp teacher
  rl, opd_cfg = _sections(loss="pg")
  rl.update(group_size=4, minibatches=2, epochs=2)
  optimizer = optax.adam(1e-2)
  train = dict(params=student, opt_state=optimizer.init(student))
  update = on_policy.make_update(
      opd.make_loss(cfg, SAMPLING, rl, opd_cfg, True, OPS), optimizer)
  scorer = teacher_lib.make_scorer((cfg,), (1.0,), False, False)
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  prompts = ["add 1+2=", "rev abc:", "sort cab:", "first 1 of ab:"]
  prompt, pmask = batching.encode_prompts(
      [p for p in prompts for _ in range(rl.group_size)], TOK, 16)
  curve = []
  for step in range(14):
    out = sampler.sample(train["params"], cfg, prompt, pmask,
                         jax.random.key(step), SAMPLING)
    data, _ = on_policy.rollout_batch(out, prompt, pmask,
                                     np.zeros(len(prompt), np.float32), rl)
    data.update(teacher_lib.score([scorer], [(teacher,)],
                           np.zeros(len(prompt), np.int32), data, mesh))
    data["weight"] = np.ones(len(prompt), np.float32)
    mask = data["mask"]
    curve.append(float(np.sum((data["old_logp"] - data["teacher_logp"])
                              * mask) / mask.sum()))
    train, _ = on_policy.optimise(train, data, update, rl,
                                 np.random.default_rng(step), None,
                                 (jnp.zeros((1, 1, 1)),))
  assert curve[0] > 3.0, curve
  assert np.mean(curve[-3:]) < 0.5 * np.mean(curve[:3]), curve


def _rows_of_lengths(cfg, params, lengths):
  """``(sampling, data, logprobs)``: 8 rows sampled from ``params`` with
  no stop token, their completions masked to ``lengths`` (the widest
  reaches ``max(lengths)`` columns, the sampling budget)."""
  width = max(lengths)
  sampling = sampler.SamplingConfig(max_new_tokens=width, stop_ids=())
  prompts = ["add 12+7=", "sort dcba:", "rev xyz:", "add 3+4="] * 2
  prompt, prompt_mask = batching.encode_prompts(prompts, TOK, 12)
  rollout = sampler.sample(params, cfg, prompt, prompt_mask,
                           jax.random.key(3), sampling)
  mask = (np.arange(width) < np.array(lengths)[:, None]).astype(np.int32)
  data = dict(prompt=np.asarray(prompt), prompt_mask=np.asarray(prompt_mask),
              completion=np.asarray(rollout.completion), mask=mask)
  return sampling, data, np.asarray(rollout.logprobs)


@pytest.mark.parametrize("loss", ["grpo", "kl"])
def test_length_parts_take_the_whole_minibatchs_step(loss):
  """``rl.length_buckets``: the rows sorted by length in 4 parts, each cut
  to its own width, give the optimiser step of the whole minibatch (SGD
  with rate 1: the new parameters are ``params - grad``), with the same
  metrics; GRPO with the KL to a reference and per-sequence aggregation,
  and the full-vocabulary KL of two routed teachers (their hidden states
  cut with the rest; the teacher of the short rows scores only the columns
  they reach, and its scores are still its full logits')."""
  (cfg, params), teachers = _models()
  sampling, data, logprobs = _rows_of_lengths(cfg, params,
                                              [1, 24, 3, 17, 5, 9, 2, 12])
  mask = data["mask"]
  rng = np.random.default_rng(0)
  # pi_old off the current policy, so that some ratios clip
  data.update(old_logp=logprobs
              + rng.normal(0, 0.3, mask.shape).astype(np.float32),
              advantages=rng.normal(size=8).astype(np.float32),
              keep=np.ones(8, np.float32),
              weight=rng.uniform(0.5, 2, 8).astype(np.float32))
  rl, opd_cfg = _sections(loss=loss if loss != "grpo" else "kl")
  if loss == "grpo":
    rl.update(beta=0.1, aggregation="seq_mean_token_mean")
    data["ref_logp"] = data["old_logp"] + 0.2
    loss_fn, shared = grpo_stage.make_loss(cfg, sampling, rl, OPS), ()
  else:
    mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1,
                              devices=jax.devices()[:1])
    ids = np.array([0, 1] * 4, np.int32)
    data.update(teacher_lib.score(
        [teacher_lib.make_scorer((c,), (1.0,), True, True)
         for c, _ in teachers], [(p,) for _, p in teachers], ids, data,
        mesh, max(c.embed_dim for c, _ in teachers), cut_columns=True))
    data["teacher_id"] = np.broadcast_to(ids[:, None], mask.shape).copy()
    # teacher 0's rows are scored on 8 columns of 24: still its own scores
    lt = jax.nn.log_softmax(_teacher_logits(teachers, data), -1)
    np.testing.assert_allclose(data["teacher_logp"], np.take_along_axis(
        lt, data["completion"][..., None], -1)[..., 0] * mask, rtol=1e-5,
                               atol=1e-5)
    loss_fn = opd.make_loss(cfg, sampling, rl, opd_cfg, False, OPS)
    shared = (_teacher_w(teachers),)
  update = on_policy.make_update(loss_fn, optax.sgd(1.0))

  def step(parts):
    train = dict(params=jax.tree.map(jnp.copy, params))
    train["opt_state"] = optax.sgd(1.0).init(train["params"])
    train, metrics = update(train, parts, *shared)
    return train["params"], {k: (float(s), float(c))
                             for k, (s, c) in metrics.items()}

  want, want_metrics = step([data])
  moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), want,
                       params)
  assert max(jax.tree.leaves(moved)) > 1e-3
  with pytest.raises(ValueError, match="not per completion position"):
    on_policy.length_parts(dict(data, top=np.zeros((8, 3))), 4)
  with pytest.raises(ValueError, match="do not split into 3 equal parts"):
    on_policy.length_parts(data, 3)
  parts = on_policy.length_parts(data, 4)
  assert [p["mask"].shape[1] for p in parts] == [8, 8, 12, 24]
  assert [p["teacher_hidden"].shape[1] for p in parts
          if "teacher_hidden" in p] in ([], [8, 8, 12, 24])
  got, got_metrics = step(parts)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=2e-5, atol=2e-6), got, want)
  assert got_metrics.keys() == want_metrics.keys()
  for k, pair in want_metrics.items():
    np.testing.assert_allclose(got_metrics[k], pair, rtol=2e-5, atol=2e-5,
                               err_msg=k)


def test_the_student_as_its_own_routed_teachers_takes_no_step():
  """Distilling a model from itself is a no-op, exactly: two routed
  teachers equal to the student, rows of unequal lengths (teacher 0's
  reach 5 of 48 columns), the full-vocabulary KL: the loss 0 and SGD's
  step leaves every parameter as it was, bit for bit, because the
  teachers score the columns the student's loss reads. (Scoring teacher
  0's rows on the 8 columns they reach rounds differently: the loss is then
  9.5e-7, float noise that Adam would scale up to whole steps.)"""
  cfg = _cfg(64, 2)
  params = decoder.init_params(cfg, jax.random.key(0))
  sampling, data, logprobs = _rows_of_lengths(cfg, params,
                                              [1, 48, 3, 17, 5, 30, 2, 12])
  mask = data["mask"]
  data.update(old_logp=logprobs * mask, advantages=np.zeros(8, np.float32),
              keep=np.ones(8, np.float32), weight=np.ones(8, np.float32))
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1,
                            devices=jax.devices()[:1])
  ids = np.array([0, 1] * 4, np.int32)
  scorer = teacher_lib.make_scorer((cfg,), (1.0,), False, True)
  data.update(teacher_lib.score([scorer] * 2, [(params,)] * 2, ids, data,
                                mesh, cfg.embed_dim))
  data["teacher_id"] = np.broadcast_to(ids[:, None], mask.shape).copy()
  rl, opd_cfg = _sections(loss="kl")
  loss_fn = opd.make_loss(cfg, sampling, rl, opd_cfg, False, OPS)
  shared = (_teacher_w([(cfg, params)] * 2),)
  update = on_policy.make_update(loss_fn, optax.sgd(1.0))
  train = dict(params=jax.tree.map(jnp.copy, params))
  train["opt_state"] = optax.sgd(1.0).init(train["params"])
  train, metrics = update(train, [data], *shared)
  assert float(metrics["loss"][0]) == 0.0, metrics["loss"]
  jax.tree.map(np.testing.assert_array_equal, train["params"], params)


@pytest.mark.parametrize("extra", [
    ("--config.opd.loss=pg", "--config.open_mopd.token_share=True",
     "--config.open_mopd.gap_budget=True",
     "--config.open_mopd.reward_refresh=True",
     "--config.open_mopd.gap_steers=both"),
    ("--config.open_mopd.token_share=True",
     "--config.open_mopd.token_share_power=0.5",
     "--config.open_mopd.gap_budget=True",
     "--config.open_mopd.gap_statistic=sequence_kl",
     "--config.open_mopd.gap_relative=True"),
    ("--config.opd.loss=topk", "--config.opd.entropy_threshold=0.5",
     "--config.opd.gate=True", "--config.opd.lambda_orm=0.5")])
def test_cli_distils_from_teachers(smoke_run, tmp_path, data_dir, extra,
                                   cached_env):
  base = smoke_run[0]
  run = tmp_path / "mopd"
  if "--config.opd.loss=topk" in extra:  # once is enough
    result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                       f"--workdir={run}", f"--config.init={base}",
                       f"--config.teachers=add={base}",
                       f"--config.data.data_dir={data_dir}", *extra)
    assert result.returncode == 2 and (
        "teachers: no run for domain" in result.stderr)
  teachers = ",".join(f"{d}={base}" for d in ("add", "chain", "instruct",
                                                "sort"))
  result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                     f"--workdir={run}",
                     f"--config.init={base}", f"--config.teachers={teachers}",
                     f"--config.data.data_dir={data_dir}", *extra,
                     env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  step = records[0]
  for d in ("add", "chain", "instruct", "sort"):
    for key in ("share/tokens", "share/loss", "signal", "reverse_kl",
                "loss_weight", "gap"):
      assert f"{key}/{d}" in step, (key, d)
  assert sum(step[f"share/loss/{d}"] for d in ("add", "chain", "instruct",
                                                "sort")) == pytest.approx(1)
  # Teachers identical to the student: the signal starts at zero.
  assert abs(step["signal"]) < 0.05
  assert "eval/greedy/add/accuracy" in records[-1]
  # Teachers equal to the base leave no headroom: nothing to divide by.
  assert json.load(open(run / "headroom.json")) == {
      "greedy": {"mean": 0.0}, "sampled": {"mean": 0.0}}
  if "--config.open_mopd.gap_relative=True" in extra:
    # Resumed from step 2 (as after a kill before the last checkpoint), the
    # run restores the gap-budget state (with its first-batch reference)
    # and ends identical.
    summary = json.load(open(run / "summary.json"))
    shutil.rmtree(run / "ckpt" / "4")
    result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                       f"--workdir={run}", f"--config.init={base}",
                       f"--config.teachers={teachers}",
                       f"--config.data.data_dir={data_dir}", *extra,
                       env=cached_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from step 2" in result.stdout + result.stderr
    assert json.load(open(run / "summary.json"))["params_sha256"] == (
        summary["params_sha256"])
    again = [json.loads(l) for l in open(run / "metrics.jsonl")]
    for r in records + again:
      r.pop("steps_per_sec", None)
    assert again == records


def test_cli_teacher_with_another_vocabulary_is_one_line(smoke_run, tmp_path):
  base = smoke_run[0]
  odd = tmp_path / "odd_teacher"
  odd.mkdir()
  saved = json.load(open(base / "config.json"))
  saved["model"]["vocab_size"] = 60
  json.dump(saved, open(odd / "config.json", "w"))
  teachers = f"add={odd},chain={base},instruct={base},sort={base}"
  result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                     f"--workdir={tmp_path / 'w'}", f"--config.init={base}",
                     f"--config.teachers={teachers}")
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [x for x in result.stderr.splitlines() if x.strip()]
  assert len(lines) == 1 and "vocabulary of 60 tokens" in lines[0], lines
  assert not (tmp_path / "w").exists()  # checked before anything is written


@pytest.mark.parametrize("token_share, power, steers, want", [
    # shares (0.1, 0.3, 0.6), uniform targets: 1/(3 share) = (10/3, 10/9,
    # 5/9); times the gap factors (1, 2, 0.5) = (10/3, 20/9, 5/18), whose
    # token-weighted mean is 7/6: divided by it.
    (True, 1.0, "loss", [20 / 7, 40 / 21, 5 / 21]),
    # (1/(3 share))^0.5 = (1.8257, 1.0541, 0.7454), times the gap factors.
    (True, 0.5, "both", np.array([1.8257419, 2.1081851, 0.3726780])
     / ((18.257419 + 63.245553 + 22.360680) / 100)),
    # The gap steers only the sampling: no loss weight at all.
    (False, 1.0, "sampling", [1.0, 1.0, 1.0]),
    # The gap factors alone: (1, 2, 0.5) over their token mean 0.1+0.6+0.3.
    (False, 1.0, "loss", [1.0, 2.0, 0.5])])
def test_domain_loss_weights_hand_computed(token_share, power, steers, want):
  om = stages.defaults("mopd").open_mopd
  om.update(token_share=token_share, token_share_power=power, gap_budget=True,
            gap_steers=steers)
  tokens = np.array([10.0, 30.0, 60.0])
  got = budget.domain_loss_weights(tokens, np.array([1.0, 2.0, 0.5]), om,
                                       3)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(np.sum(got * tokens) / tokens.sum(), 1.0)


def test_cli_distils_from_the_delta_teacher(smoke_run, tmp_path, data_dir,
                                            cached_env):
  """``opd.router=delta``: every sample scored by ``z_base + lambda
  sum_i (z_i - z_base)`` over the four experts (here copies of the base
  that name it as their init: the target is the student itself, so the
  signal starts at 0); the cost counts the five models it runs."""
  base = smoke_run[0]
  expert = tmp_path / "expert"
  shutil.copytree(base, expert)
  config = json.loads((expert / "config.json").read_text())
  (expert / "config.json").write_text(json.dumps(dict(config,
                                                      init=str(base))))
  run = tmp_path / "mopd"
  teachers = ",".join(f"{d}={expert}" for d in ("add", "chain", "instruct",
                                                  "sort"))
  result = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                     f"--workdir={run}", f"--config.init={base}",
                     f"--config.teachers={teachers}",
                     "--config.opd.router=delta",
                     "--config.opd.delta_scale=0.5",
                     f"--config.data.data_dir={data_dir}", env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
  assert abs(first["signal"]) < 1e-4 and "share/tokens/sort" in first


@pytest.mark.parametrize("fields, words", [
    (dict(prefix="teacher", loss="pg"),
     "opd.prefix: teacher prefixes need a per-position"),
    (dict(trb_delta=0.5), "opd.trb_steps: the TRB warm-up needs"),
    (dict(prefix="teacher", trb_delta=0.5, trb_steps=2),
     "opd.trb_delta: teacher prefixes are sampled by the teacher alone"),
    (dict(router="delta", proxy_teacher=True),
     "opd.proxy_teacher: the delta teacher already"),
    (dict(router="entropy", prefix="teacher"),
     "opd.prefix: teacher prefixes and TRB sample from each"),
    (dict(teacher_vmap="on"), "opd.teacher_vmap: 'on' stacks the teachers"),
])
def test_combinations_that_do_not_go_together_are_refused(fields, words):
  """The MOPD module's cross-field checks, each a ConfigError naming the
  field (the command line prints it as one line, exit 2: test_config)."""
  config = stages.recipe("mopd", "smoke")
  config.update(init="runs/base", teachers="runs/expert_{domain}")
  config.opd.update(fields)
  with pytest.raises(ConfigError, match=re.escape(words)):
    stages.validate(config)


@pytest.mark.parametrize("extra", [
    ("--config.opd.prefix=teacher", "--config.opd.kl_alpha=1.0",
     "--config.opd.curriculum_entropy=0.01",
     "--config.opd.curriculum_start=8", "--config.opd.curriculum_growth=8"),
    ("--config.opd.trb_delta=0.5", "--config.opd.trb_steps=2",
     "--config.opd.loss=pg", "--config.rl.tis_cap=2.0")])
def test_cli_distils_on_teacher_prefixes_trb_and_a_curriculum(
    smoke_run, tmp_path, data_dir, cached_env, extra):
  """Forward KL on the experts' own samples with the entropy-gated length
  curriculum (its budget grows while the student's entropy stays above
  the gate, and is restored on resume), and the TRB warm-up (its radius
  annealed to 0 by step 2); four steps, logged every two."""
  base = smoke_run[0]
  teachers = ",".join(f"{d}={base}" for d in ("add", "chain", "instruct",
                                                "sort"))
  run = tmp_path / "mopd"
  args = (f"--config={ROOT}/configs/mopd.py:smoke", f"--workdir={run}",
          f"--config.init={base}", f"--config.teachers={teachers}",
          f"--config.data.data_dir={data_dir}", *extra)
  result = train_cli(*args, env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  if "--config.opd.prefix=teacher" in extra:
    # 8, 16, 24, 32 tokens at steps 0-3, logged as means over two steps
    budgets = [r["budget"] for r in records if "budget" in r]
    assert budgets == [12.0, 28.0], budgets
    assert all(r["response_length"] <= r["budget"] for r in records
               if "budget" in r)
    summary = json.load(open(run / "summary.json"))
    shutil.rmtree(run / "ckpt" / "4")
    result = train_cli(*args, env=cached_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.load(open(run / "summary.json"))["params_sha256"] == (
        summary["params_sha256"])
  else:
    # 0.5, 0.25, 0, 0 at steps 0-3, logged as means over two steps
    radii = [r["trb_delta"] for r in records if "trb_delta" in r]
    assert radii == [0.375, 0.0], radii


def test_routed_sampling_gives_each_row_its_teachers_own_sample():
  """``sample_routed``: with teacher prefixes, each row is what its
  teacher samples for it (the teacher's key, its padded rows); under TRB
  at radius 0, the student's own sample for the row."""
  student, teachers = _models()
  found = [teacher_lib.Teacher(d, "", teacher_lib.Model(*t), None)
           for d, t in zip(("add", "sort"), teachers)]
  prompt, mask = batching.encode_prompts(
      ["add 1+2=", "sort ba:", "add 3+4=", "rev ab:", "add 5+5="], TOK, 12)
  ids = np.array([0, 1, 0, 1, 0])
  key = jax.random.key(4)
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1, devices=jax.devices()[:1])
  with parallel.activate(mesh):
    out = teacher_lib.sample_routed(teacher_lib.Model(*student), found, ids,
                                    prompt, mask, key, SAMPLING, None)
    same = teacher_lib.sample_routed(teacher_lib.Model(*student), found, ids,
                                     prompt, mask, key, SAMPLING, 0.0)
    for j, (cfg, params) in enumerate(teachers):
      rows = np.flatnonzero(ids == j)
      idx = teacher_lib.padded_rows(rows, mesh)
      want = sampler.sample(params, cfg, np.asarray(prompt)[idx],
                            np.asarray(mask)[idx], jax.random.fold_in(key, j),
                            SAMPLING)
      mine = sampler.sample(student[1], student[0], np.asarray(prompt)[idx],
                            np.asarray(mask)[idx], jax.random.fold_in(key, j),
                            SAMPLING)
      for got, ref in ((out, want), (same, mine)):
        np.testing.assert_array_equal(got.completion[rows],
                                      np.asarray(ref.completion)[:rows.size])
        np.testing.assert_allclose(got.logprobs[rows],
                                   np.asarray(ref.logprobs)[:rows.size],
                                   atol=1e-5)
  assert not np.array_equal(out.completion, same.completion)
