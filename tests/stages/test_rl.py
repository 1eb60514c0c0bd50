"""GRPO machinery end to end: the stage's own loss, update and minibatch loop
raise the mean reward of an easy task within a few steps; the mixture follows
its equations; the CLI trains an expert and Mix RL from a base run."""

import json
import math
import os

import jax
import numpy as np
import optax
import pytest

from conftest import ROOT, train_cli
from mopd_jax import stages
from mopd_jax.data import batching, mixture
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.models.tokenizer import CharTokenizer
from mopd_jax.ops import vocab
from mopd_jax.rollout import sampler
from mopd_jax.stages import on_policy
from mopd_jax.stages import grpo as grpo_stage

TOK = CharTokenizer()


def test_grpo_raises_reward_on_an_easy_task():
  """Reward 1 when the completion starts with a digit (about 10 in 58 at
  random): 12 GRPO steps must lift the mean reward well above chance."""
  cfg = ModelConfig(vocab_size=TOK.vocab_size, embed_dim=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
  rl = stages.defaults("grpo").rl
  rl.update(group_size=8, prompts_per_step=8, minibatches=2, epochs=2)
  sampling = sampler.SamplingConfig(max_new_tokens=4, stop_ids=(TOK.eos_id,))
  optimizer = optax.adam(1e-2)
  train = dict(params=decoder.init_params(cfg, jax.random.key(0)))
  train["opt_state"] = optimizer.init(train["params"])
  update = on_policy.make_update(grpo_stage.make_loss(cfg, sampling, rl, vocab.DEFAULT_OPS),
                                optimizer)
  prompts = ["add 1+2=", "rev abc:", "sort cab:", "first 1 of ab:"] * 2
  prompt, mask = batching.encode_prompts(
      [p for p in prompts for _ in range(rl.group_size)], TOK, 16)
  curve = []
  for step in range(12):
    out = sampler.sample(train["params"], cfg, prompt, mask,
                         jax.random.key(step), sampling)
    texts = [TOK.decode(row) for row in np.asarray(out.completion)]
    rewards = np.array([float(t[:1].isdigit()) for t in texts], np.float32)
    curve.append(rewards.mean())
    data, _ = on_policy.rollout_batch(out, prompt, mask, rewards, rl)
    train, pairs = on_policy.optimise(train, data, update, rl,
                                     np.random.default_rng(step))
    assert np.isfinite(float(pairs["loss"][0]))
  assert np.mean(curve[:3]) < 0.35
  assert np.mean(curve[-3:]) > np.mean(curve[:3]) + 0.3, curve


def test_fixed_and_adaptive_proportions():
  base = mixture.base_weights(("a", "b", "c"), (2.0, 1.0, 1.0))
  np.testing.assert_allclose(base, [0.5, 0.25, 0.25])
  np.testing.assert_allclose(mixture.base_weights(("a", "b"), ()), [0.5, 0.5])
  state = mixture.init_state(3)
  # Before any data every u_d is equal: base proportions, floored.
  np.testing.assert_allclose(
      mixture.proportions(base, state, True, 0.5, 0.05), 0.05 + 0.85 * base,
      rtol=1e-6)
  state = mixture.update_state(state, np.array([0, 0, 1, 2]),
                               np.array([0.0, 0.0, 0.8, 0.4]), 0.9)
  np.testing.assert_allclose(state["count"], [2, 1, 1])
  np.testing.assert_allclose(state["signal"], [0.0, 0.8, 0.4])
  w = mixture.proportions(base, state, True, 0.0, 0.05)
  # No exploration: u = signal; w = floor + (1 - 3 floor) * base u / sum.
  u = np.array([0.0, 0.8, 0.4]) + 1e-12
  expect = 0.05 + 0.85 * base * u / (base * u).sum()
  np.testing.assert_allclose(w, expect / expect.sum(), rtol=1e-6)
  assert w.min() >= 0.05 - 1e-9
  state = mixture.update_state(state, np.array([1]), np.array([0.0]), 0.9)
  np.testing.assert_allclose(state["signal"][1], 0.72, rtol=1e-6)
  np.testing.assert_allclose(
      mixture.proportions(base, state, False, 0.5, 0.05), base)


def test_adaptive_exploration_bonus_hand_computed():
  """``u_d = s_d + c sqrt(ln(1 + N) / (1 + n_d))``: with counts (3, 0, 1),
  N = 4, the unseen domain gets the largest bonus."""
  base = np.array([0.5, 0.25, 0.25])
  state = dict(count=np.array([3.0, 0.0, 1.0]),
               signal=np.array([0.2, 0.0, 0.1]))
  c, floor = 0.5, 0.1
  u = np.array([0.2 + c * math.sqrt(math.log(5) / 4),
                0.0 + c * math.sqrt(math.log(5) / 1),
                0.1 + c * math.sqrt(math.log(5) / 2)])
  raw = base * u / np.sum(base * u)
  np.testing.assert_allclose(
      mixture.proportions(base, state, True, c, floor),
      floor + (1 - 3 * floor) * raw, rtol=1e-9)
  # Without the bonus the unseen domain (no signal yet) is held at the floor.
  np.testing.assert_allclose(
      mixture.proportions(base, state, True, 0.0, floor)[1], floor,
      rtol=1e-9)


@pytest.mark.parametrize("drop", [False, True])
def test_rollout_batch_drops_only_all_equal_groups(drop):
  rl = stages.defaults("grpo").rl
  rl.update(group_size=2, drop_equal_groups=drop, advantage="drgrpo")
  rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], np.float32)
  mask = np.zeros((6, 12), np.float32)
  mask[:, :3] = 1.0
  rollout = sampler.Rollout(np.ones((6, 12), np.int32),
                            np.zeros((6, 12), np.float32), mask)
  data, _ = on_policy.rollout_batch(rollout, np.zeros((6, 4), np.int32),
                                   np.ones((6, 4), np.float32), rewards, rl)
  np.testing.assert_array_equal(
      data["keep"], [0, 0, 1, 1, 0, 0] if drop else np.ones(6))
  np.testing.assert_allclose(data["advantages"], [0, 0, -0.5, 0.5, 0, 0])
  assert data["mask"].shape == (6, 8)  # trimmed to the used columns, x8


@pytest.mark.parametrize("config, extra", [
    # an expert whose stop.gain is never reached ends at its last step
    ("grpo", ("--config.stop.gain=0.5", "--config.stop.num_prompts=8")),
    ("mix_rl", ()),
    ("grpo", ("--config.rl.beta=0.1", "--config.rl.tis_cap=2.0"))])
def test_cli_trains_from_the_base_run(smoke_run, tmp_path, data_dir, config,
                                      extra, cached_env):
  base = smoke_run[0]
  run = tmp_path / config
  result = train_cli(f"--config={ROOT}/configs/{config}.py:smoke",
                     f"--workdir={run}", f"--config.init={base}",
                     f"--config.data.data_dir={data_dir}", *extra,
                     env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  step = records[0]
  for key in ("reward", "response_length", "clip_fraction", "kl_to_old",
              "entropy", "advantage_abs", "advantage_std", "loss"):
    assert key in step, key
  domains = ["add"] if config == "grpo" else ["add", "chain", "instruct",
                                                "sort"]
  assert sum(step[f"share/prompts/{d}"] for d in domains) == pytest.approx(1)
  assert "eval/greedy/reverse/accuracy" in records[-1]  # forgetting watch
  if "--config.rl.beta=0.1" in extra:
    assert step["kl"] >= 0.0  # the reference forward pass ran
  if "--config.stop.gain=0.5" in extra:
    assert "stop.gain 0.5 not reached by step 4" in result.stdout
    assert json.load(open(run / "eval.json"))["step"] == 4
    assert "stopped" not in json.load(open(run / "summary.json"))
  saved = json.load(open(run / "config.json"))
  assert saved["model"] == json.load(open(base / "config.json"))["model"]
  assert sorted(os.listdir(run / "ckpt")) == ["2", "4"]


def test_cli_missing_init_is_one_line(tmp_path):
  result = train_cli(f"--config={ROOT}/configs/grpo.py:smoke",
                     f"--workdir={tmp_path / 'w'}",
                     f"--config.init={tmp_path / 'nowhere'}")
  assert result.returncode == 2
  assert "nowhere" in result.stderr and "Traceback" not in result.stderr
  result = train_cli(f"--config={ROOT}/configs/grpo.py:smoke",
                     f"--workdir={tmp_path / 'w'}")
  assert result.returncode == 2 and result.stderr.startswith("error: init:")
