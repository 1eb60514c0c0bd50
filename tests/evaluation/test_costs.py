import json

import pytest

from mopd_jax.evaluation import costs
from mopd_jax.models.config import ModelConfig

MODEL = dict(vocab_size=40, embed_dim=8, num_layers=2, num_heads=2,
             num_kv_heads=1, head_dim=4, mlp_dim=16)


def _run(tmp_path, records):
  (tmp_path / "metrics.jsonl").write_text(
      "".join(json.dumps(r) + "\n" for r in records))
  return str(tmp_path)


def test_flops_per_token_by_hand():
  cfg = ModelConfig(**MODEL)
  # tied table: every matmul but the input lookup, which the output
  # matmul's shared table stands in for: N = all parameters
  n = cfg.num_params()
  assert cfg.forward_flops_per_token(10) == 2 * n + 4 * 2 * 2 * 4 * 10
  assert cfg.train_flops_per_token(10) == 3 * cfg.forward_flops_per_token(10)


def test_mopd_cost_counts_sampling_scoring_and_training(tmp_path):
  config = dict(method="mopd", model=MODEL, data=dict(max_prompt_len=6),
                rl=dict(prompts_per_step=2, group_size=3, epochs=2))
  run = _run(tmp_path, [dict(step=4, steps_per_sec=2.0, response_length=4.0),
                        dict(step=4, loss=0.1),
                        dict(step=10, steps_per_sec=3.0,
                             response_length=2.0)])
  cost = costs.run_cost(run, config, {"flops": 1.0, "wall_seconds": 5.0})
  cfg = ModelConfig(**MODEL)
  first, second = 4 * 6 * 4.0, 6 * 6 * 2.0  # tokens of each stretch
  assert cost["tokens_sampled"] == cost["tokens_teacher_scored"] == (
      first + second)
  assert cost["tokens_trained"] == 2 * (first + second)
  assert cost["wall_seconds"] == pytest.approx(4 / 2 + 6 / 3)
  want = sum(t * (2 * cfg.forward_flops_per_token(6 + r)
                  + 2 * cfg.train_flops_per_token(6 + r))
             for t, r in ((first, 4.0), (second, 2.0)))
  assert cost["flops"] == pytest.approx(want)
  assert cost["with_experts"]["flops"] == pytest.approx(want + 1.0)


def test_pretraining_cost_counts_packed_rows(tmp_path):
  config = dict(method="pretrain", model=MODEL, data=dict(max_prompt_len=6),
                sampling=dict(max_new_tokens=10), train=dict(batch_size=4))
  cost = costs.run_cost(_run(tmp_path, [dict(step=5, steps_per_sec=1.0)]),
                        config)
  assert cost["tokens_trained"] == 5 * 4 * 16 and cost["tokens_sampled"] == 0
  assert cost["flops"] == pytest.approx(
      5 * 4 * 16 * ModelConfig(**MODEL).train_flops_per_token(16))


def test_the_delta_and_proxy_teachers_run_more_models_per_token(tmp_path):
  base = dict(method="mopd", model=MODEL, data=dict(max_prompt_len=6,
                                                    domains=["a", "b", "c"]),
              rl=dict(prompts_per_step=1, group_size=1, epochs=1))
  run = _run(tmp_path, [dict(step=1, steps_per_sec=1.0,
                             response_length=4.0)])
  cfg = ModelConfig(**MODEL)
  fwd, train = cfg.forward_flops_per_token(10), cfg.train_flops_per_token(10)
  for opd, models in ((dict(router="oracle"), 1),
                      (dict(router="oracle", proxy_teacher=True), 3),
                      (dict(router="delta"), 4),
                      # every expert scores every token; expert_align
                      # runs the student once more
                      (dict(router="novelty"), 3),
                      (dict(router="entropy", proxy_teacher=True), 9),
                      (dict(router="expert_align"), 4)):
    assert costs.teacher_models(dict(base, opd=opd)) == models
    cost = costs.run_cost(run, dict(base, opd=opd))
    assert cost["flops"] == pytest.approx(4 * ((1 + models) * fwd + train))


def test_off_policy_sampling_counts_its_extra_passes():
  """TRB's warm-up steps run the teacher's decode and the student's
  recomputation of pi_old (2 passes a token), later steps none; teacher
  prefixes and async rollouts recompute pi_old at every step."""
  trb = dict(opd=dict(trb_delta=0.5, trb_steps=3), rl=dict(tis_cap=0.0))
  assert costs.off_policy_passes(trb, 0, 2) == 4  # steps 0, 1
  assert costs.off_policy_passes(trb, 2, 6) == 2  # step 2 only
  assert costs.off_policy_passes(trb, 4, 6) == 0
  assert costs.off_policy_passes(dict(opd=dict(prefix="teacher")), 0, 5) == 5
  assert costs.off_policy_passes(dict(rl=dict(max_policy_lag=1,
                                              tis_cap=2.0)), 3, 5) == 2
  assert costs.off_policy_passes(dict(opd=dict(), rl=dict()), 0, 5) == 0
