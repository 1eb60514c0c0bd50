"""The shared loss tail (policy.finish) against a numpy computation."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mopd_jax.objectives import policy


@pytest.mark.parametrize("beta,entropy_coef", [(0.0, 0.0), (0.1, 0.0),
                                               (0.0, 0.05), (0.2, 0.03)])
def test_finish_adds_kl_and_entropy_bonus(beta, entropy_coef):
  rng = np.random.default_rng(0)
  b, t = 6, 5
  per_token = rng.normal(size=(b, t)).astype(np.float32)
  logp = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
  ref_logp = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
  entropy = rng.uniform(0.0, 2.0, size=(b, t)).astype(np.float32)
  mask = (rng.uniform(size=(b, t)) < 0.7).astype(np.float32)
  keep = np.array([1, 1, 0, 1, 1, 1], np.float32)
  mb = dict(mask=jnp.asarray(mask), keep=jnp.asarray(keep),
            old_logp=jnp.asarray(logp), ref_logp=jnp.asarray(ref_logp))
  stats = dict(logp=jnp.asarray(logp), entropy=jnp.asarray(entropy))
  rl = ml_collections.ConfigDict(dict(beta=beta, kl_estimator="k3",
                                      entropy_coef=entropy_coef,
                                      aggregation="token_mean"))
  loss, metrics = policy.aggregate_loss(jnp.asarray(per_token),
                                jnp.zeros((b, t)), stats, mb, rl, t)

  d = ref_logp.astype(np.float64) - logp
  k3 = np.exp(d) - d - 1
  m = mask * keep[:, None]
  want = np.sum((per_token + beta * k3 - entropy_coef * entropy) * m) / m.sum()
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  total, count = metrics["entropy"]
  np.testing.assert_allclose(float(total) / float(count),
                             np.sum(entropy * m) / m.sum(), rtol=1e-5)
  assert ("kl" in metrics) == (beta > 0)
