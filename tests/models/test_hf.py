"""The decoder against Hugging Face's own Llama / Qwen2 / Qwen3 models: the
same weights (through ``models.hf``) give the same log-probs on a long
prompt with sharp logits, where RoPE or norm mistakes would show."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mopd_jax.models import decoder, hf  # noqa: E402
from mopd_jax.models.config import ModelConfig  # noqa: E402

CONFIGS = {
    # head_dim * heads != hidden, untied, a non-default rope theta
    "llama": ModelConfig(vocab_size=97, embed_dim=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16,
                         mlp_dim=80, rope_theta=500_000.0,
                         tie_embeddings=False, norm_eps=1e-5),
    "qwen2": ModelConfig(vocab_size=97, embed_dim=64, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=16,
                         mlp_dim=96, attention_bias=True),
    "qwen3": ModelConfig(vocab_size=97, embed_dim=40, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=24,
                         mlp_dim=72, qk_norm=True, tie_embeddings=True),
}


def sharp_params(cfg, seed=0):
  """Random parameters with every tensor, biases and norms included, far
  from its initial value (std 0.3 instead of 0.02), so each one matters
  and the logits are sharp."""
  params = decoder.init_params(cfg, jax.random.key(seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape)
            for x, k in zip(leaves, keys)]
  params = jax.tree.unflatten(tree, leaves)
  return params


def hf_model(cfg, params):
  fields = hf.hf_config(cfg)
  config = transformers.AutoConfig.for_model(**fields)
  model = transformers.AutoModelForCausalLM.from_config(
      config, dtype=torch.float32)
  state = {k: torch.from_numpy(np.array(v))
           for k, v in hf.to_hf(params, cfg).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (
      missing, unexpected)
  return model.eval()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logprobs_match_transformers_on_a_long_prompt(family):
  cfg = CONFIGS[family]
  params = sharp_params(cfg)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 500))
  ours, _ = decoder.apply(params, cfg, jnp.asarray(tokens, jnp.int32),
                          jnp.ones(tokens.shape, jnp.int32))
  ours = np.asarray(jax.nn.log_softmax(ours, axis=-1))
  with torch.no_grad():
    theirs = hf_model(cfg, params)(torch.from_numpy(tokens)).logits
  theirs = torch.log_softmax(theirs.double(), -1).numpy()
  # Per-token log-probs of the sequence's own next tokens.
  nxt = tokens[:, 1:, None]
  ours = np.take_along_axis(ours[:, :-1], nxt, -1)
  theirs = np.take_along_axis(theirs[:, :-1], nxt, -1)
  assert ours.std() > 1.5  # sharp: log-probs spread over several nats
  # Both are float32 with the same RoPE phases (float32 ``p * f``, within
  # 4e-6 of each other at |x| ~ 10); each is about 2e-4 from the exact
  # rotation at position 500, which large q.k scores amplify.
  np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_to_hf_and_back_is_exact(family):
  cfg = CONFIGS[family]
  params = sharp_params(cfg, seed=3)
  back = hf.from_hf(hf.to_hf(params, cfg), cfg)
  for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(params),
                               jax.tree_util.tree_leaves_with_path(back)):
    np.testing.assert_array_equal(np.asarray(a), b, err_msg=str(path))


def test_from_hf_names_a_missing_or_misshapen_tensor():
  cfg = CONFIGS["llama"]
  tensors = hf.to_hf(decoder.init_params(cfg, jax.random.key(0)), cfg)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
    hf.from_hf(tensors, cfg)
  tensors = hf.to_hf(decoder.init_params(cfg, jax.random.key(0)), cfg)
  tensors["model.norm.weight"] = np.ones(7, np.float32)
  with pytest.raises(ValueError, match=r"model.norm.weight has shape \[7\]"):
    hf.from_hf(tensors, cfg)
