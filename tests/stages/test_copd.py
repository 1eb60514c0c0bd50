"""CoPD: co-evolving experts, each one's GRPO with a reverse KL toward the
others (the reference log-probs the mean of theirs)."""

import json
import shutil

import numpy as np
import pytest

from conftest import ROOT, load_config, train_cli
from mopd_jax import runs, stages
from mopd_jax.errors import ConfigError
from mopd_jax.stages import copd
from mopd_jax.stages import merge as merge_stage


def _kl(p, q):
  return float(np.sum(p * (np.log(p) - np.log(q))))


def test_the_mean_kl_to_the_others_is_the_kl_to_their_geometric_mean():
  """``1/(J-1) sum_{j != i} KL(pi_i || pi_j) = KL(pi_i || G_i) - log Z``
  with ``G_i`` the normalised geometric mean of the others, and per token
  ``log pi_i(y) - mean_j log pi_j(y) = log pi_i(y) - log G_i(y) - log Z``:
  the reference whose log-probs are the others' mean has the same
  gradient (numpy, random distributions over 7 tokens, J = 4)."""
  rng = np.random.default_rng(0)
  pis = rng.dirichlet(np.ones(7), size=4)
  i, others = 0, pis[1:]
  mean_kl = np.mean([_kl(pis[i], q) for q in others])
  unnormalised = np.exp(np.mean(np.log(others), axis=0))
  z = unnormalised.sum()
  g = unnormalised / z
  np.testing.assert_allclose(mean_kl, _kl(pis[i], g) - np.log(z), rtol=1e-12)
  ref = np.mean(np.log(others), axis=0)  # what signal() puts in ref_logp
  np.testing.assert_allclose(np.log(pis[i]) - ref,
                             np.log(pis[i]) - np.log(g) - np.log(z))


def test_k2_on_the_experts_samples_follows_the_reverse_kl_gradient():
  """With ``pi = softmax(theta)`` and ``ref = mean_j log pi_j``: the
  expected gradient of k2, ``sum_y pi(y) (log pi(y) - ref(y)) (e_y - pi)``,
  equals the gradient of ``mean_j KL(pi || pi_j)`` (central differences);
  k3's, ``-sum_y exp(ref(y)) (e_y - pi)``, does not."""
  rng = np.random.default_rng(1)
  theta = rng.normal(size=6)
  others = rng.dirichlet(np.ones(6), size=3)
  ref = np.mean(np.log(others), axis=0)

  def softmax(t):
    e = np.exp(t - t.max())
    return e / e.sum()

  def mean_kl(t):
    return np.mean([_kl(softmax(t), q) for q in others])

  eps = 1e-6
  numeric = np.array([(mean_kl(theta + eps * e) - mean_kl(theta - eps * e))
                      / (2 * eps) for e in np.eye(6)])
  pi = softmax(theta)
  grad_log = np.eye(6) - pi[None, :]  # row y: grad log pi(y)
  k2 = (pi * (np.log(pi) - ref)) @ grad_log
  k3 = -np.exp(ref) @ grad_log
  np.testing.assert_allclose(k2, numeric, atol=1e-7)
  assert not np.allclose(k3, numeric, atol=1e-3)


def test_the_reference_is_the_mean_of_the_others_log_probs():
  config = load_config("copd", "smoke")
  others = [np.full((2, 3), -1.0), np.full((2, 3), -2.0),
            np.full((2, 3), -6.0)]
  method = copd.CoEvolving(config, "add", lambda: others,
                           lambda params, data: params)
  data = {}
  method.signal({}, data, np.zeros(2, np.int32))
  np.testing.assert_array_equal(data["ref_logp"], np.full((2, 3), -3.0))


@pytest.mark.parametrize("field, value, words", [
    ("data.domains", ("add", "add"),
     "data.domains: co-evolving experts need at least two distinct"),
    ("rl.beta", 0.0, "rl.beta: the weight of the KL to the other experts"),
    ("rl.kl_estimator", "k3", "rl.kl_estimator: k2, whose gradient"),
])
def test_one_domain_no_kl_or_another_estimator_is_refused(field, value,
                                                          words):
  config = load_config("copd", "smoke")
  config.init = "runs/base"
  section, name = field.split(".")
  config[section][name] = value
  with pytest.raises(ConfigError, match=words):
    stages.validate(config)


def test_cli_co_evolves_resumes_exactly_and_writes_expert_runs(
    smoke_run, tmp_path, data_dir, cached_env):
  """Two rounds of the smoke config from the smoke base: one expert run
  per domain (finished, evaluated, a merge's experts); killed after round
  1 (its checkpoint kept) the same command ends with the same parameters."""
  run = tmp_path / "copd"
  args = (f"--config={ROOT}/configs/copd.py:smoke", f"--workdir={run}",
          f"--config.init={smoke_run[0]}", "--config.train.steps=2",
          "--config.checkpoint.every=1", f"--config.data.data_dir={data_dir}")
  result = train_cli(*args, env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads((run / "summary.json").read_text())
  record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
  assert {"kl/add", "kl/sort", "reward/chain", "loss"} <= set(record)
  for d in ("add", "chain", "instruct", "sort"):
    assert runs.finished(run / f"expert_{d}")
    assert (run / f"expert_{d}" / runs.EVAL_FILE).exists()
  config = load_config("merge", "smoke")
  config.update(init=str(smoke_run[0]), experts=f"{run}/expert_{{domain}}")
  config = stages.validate(config)
  runs.resolve_model(config)
  merge_stage.check(config)  # the experts of a merge
  shutil.rmtree(run / "ckpt" / "2")
  (run / "summary.json").unlink()
  result = train_cli(*args, env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resuming from step 1" in result.stdout + result.stderr
  assert json.loads((run / "summary.json").read_text())["params_sha256"] == (
      summary["params_sha256"])
