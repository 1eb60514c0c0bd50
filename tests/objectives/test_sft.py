import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.models import decoder
from mopd_jax.models.config import PRESETS
from mopd_jax.objectives.sft import sft_loss
from mopd_jax.reductions import masked_sum_count, safe_mean


def test_sft_loss_against_numpy():
  cfg = PRESETS["micro"]
  params = decoder.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, cfg.vocab_size, (3, 10)).astype(np.int32)
  seg = np.array([[1] * 10, [1] * 6 + [2] * 4, [1] * 7 + [0] * 3], np.int32)
  mask = (rng.random((3, 10)) < 0.6).astype(np.int32) * (seg > 0)
  batch = dict(tokens=tokens, segment_ids=seg, loss_mask=mask)
  total, count = sft_loss(params, cfg, batch)
  logits = np.asarray(decoder.apply(params, cfg, tokens, seg)[0], np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ref = -sum(logp[b, t - 1, tokens[b, t]] * mask[b, t]
             for b in range(3) for t in range(1, 10))
  assert float(count) == mask[:, 1:].sum()
  np.testing.assert_allclose(float(total), ref, rtol=1e-5)


def test_masked_sum_count_and_safe_mean():
  x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
  m = jnp.array([[1, 0, 1], [0, 0, 1]])
  s, c = masked_sum_count(x, m)
  assert float(s) == 10.0 and float(c) == 3.0
  assert abs(float(safe_mean(s, c)) - 10.0 / 3.0) < 1e-6
  assert float(safe_mean(jnp.float32(0), jnp.float32(0))) == 0.0
