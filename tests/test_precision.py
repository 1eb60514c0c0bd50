"""bfloat16 compute (``model.dtype``) with float32 master weights
(``model.param_dtype``): parameters, AdamW moments, norms, softmax and every
log-prob stay float32, so a bfloat16 run tracks the float32 run."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from conftest import load_config
from mopd_jax import runs
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig
from mopd_jax.rollout import sampler
from mopd_jax import stages


def _pretrain_losses(tmp_path, data_dir, dtype):
  config = load_config("pretrain", "smoke")
  config.data.data_dir = data_dir
  config.model.dtype = dtype
  config.train.update(steps=30, log_every=5, eval_every=30)
  config.checkpoint.every = 30
  config = stages.validate(config)
  workdir = tmp_path / dtype
  stages.run(config, str(workdir))
  lines = [json.loads(line) for line in
           (workdir / "metrics.jsonl").read_text().splitlines()]
  losses = {r["step"]: r["loss"] for r in lines if "loss" in r}
  _, params = runs.final_model(str(workdir))
  return losses, {leaf.dtype.name for leaf in jax.tree.leaves(params)}


def test_bfloat16_pretraining_tracks_float32(tmp_path, data_dir):
  """30 steps of the smoke base: at every logged step the bfloat16 loss is
  within 0.1% of the float32 loss (measured: 2e-5 at most), while both
  fall by more than 10% (14%); the weights stay float32."""
  f32, f32_dtypes = _pretrain_losses(tmp_path, data_dir, "float32")
  bf16, bf16_dtypes = _pretrain_losses(tmp_path, data_dir, "bfloat16")
  assert sorted(f32) == sorted(bf16) and len(f32) == 6
  steps = sorted(f32)
  assert f32[steps[-1]] < 0.9 * f32[steps[0]]
  gaps = {s: abs(bf16[s] - f32[s]) / f32[s] for s in steps}
  assert max(gaps.values()) < 1e-3, gaps
  assert f32_dtypes == bf16_dtypes == {"float32"}
  assert any(gaps[s] > 0 for s in steps)  # bfloat16 was really used


def test_bfloat16_sampler_and_trainer_log_probs_within_the_clip():
  """In bfloat16 the sampler (prefill + cached decode) and the trainer
  (one full forward pass) compute each token's log-prob in another order;
  their ratio stays well inside the PPO clip [1 - 0.2, 1 + 0.28]."""
  cfg = ModelConfig(vocab_size=64, embed_dim=64, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, mlp_dim=128,
                    dtype="bfloat16")
  params = decoder.init_params(cfg, jax.random.key(0))
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
  prompt = jax.random.randint(jax.random.key(1), (16, 12), 3, 64)
  mask = jnp.ones_like(prompt)
  sampling = sampler.SamplingConfig(max_new_tokens=32, stop_ids=(2,))
  out = sampler.sample(params, cfg, prompt, mask, jax.random.key(2),
                       sampling)
  trainer = sampler.sequence_logprobs(params, cfg, prompt, mask, out,
                                      sampling)
  assert trainer.dtype == jnp.float32
  live = np.asarray(out.mask) > 0
  ratio = np.exp(np.asarray(trainer) - np.asarray(out.logprobs))[live]
  assert live.sum() > 200
  assert np.abs(ratio - 1).max() < 0.1, np.abs(ratio - 1).max()
  f32 = dataclasses.replace(cfg, dtype="float32")
  exact = sampler.sequence_logprobs(params, f32, prompt, mask, out, sampling)
  assert np.abs(np.asarray(exact) - np.asarray(trainer))[live].max() > 1e-4
