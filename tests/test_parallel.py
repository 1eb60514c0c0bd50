"""Sharding on 8 fake CPU devices: parameters and optimiser state laid out
as the rules say, and a train step and greedy generation on every mesh equal
to one device; the rule sets; a sharded MOPD run from the CLI; multi-host
start-up and process-0-only files."""

import dataclasses
import json
import os

import jax
import numpy as np
import optax
import pytest
from conftest import ROOT, train_cli
from jax.sharding import PartitionSpec as P

from mopd_jax import stages
from mopd_jax import metrics, parallel, runs, training
from mopd_jax.errors import ConfigError
from mopd_jax.models.config import ModelConfig
from mopd_jax.objectives.sft import make_train_step
from mopd_jax.rollout import sampler

# Its module-scoped fixture is built once: every test of the module on one
# pytest-xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("parallel")

CFG = ModelConfig(vocab_size=40, embed_dim=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mlp_dim=64)
OPT = optax.adamw(1e-2, weight_decay=0.1)
GREEDY = sampler.SamplingConfig(max_new_tokens=6, temperature=0.0, stop_ids=(2,))


def test_make_mesh_shapes_and_errors():
  assert len(jax.devices()) == 8
  assert dict(parallel.make_mesh(2, 2, 2).shape) == dict(
      data=2, fsdp=2, tensor=2)
  assert dict(parallel.make_mesh(-1, 1, 4).shape)["data"] == 2
  # a batch splits over data x fsdp, not over tensor
  assert parallel.data_parallel(parallel.make_mesh(2, 2, 2)) == 4
  assert parallel.data_parallel(parallel.make_mesh(1, 1, 8)) == 1
  assert parallel.data_parallel(jax.sharding.get_mesh()) == 1  # no mesh
  with pytest.raises(ConfigError, match="mesh"):
    parallel.make_mesh(3, 1, 1)
  with pytest.raises(ConfigError, match="mesh"):
    parallel.make_mesh(-1, -1, 1)
  with pytest.raises(ConfigError, match="mesh.rules"):
    parallel.make_mesh(rules="zero3")


@pytest.mark.parametrize("rules, q_spec, embed_spec", [
    ("fsdp_tp", P(None, "fsdp", "tensor", None), P("tensor", "fsdp")),
    ("fsdp", P(None, "fsdp", None, None), P(None, "fsdp")),
    ("dp", P(None, None, None, None), P(None, None)),
])
def test_rule_sets_place_parameters(rules, q_spec, embed_spec):
  mesh = parallel.make_mesh(2, 2, 2)
  with parallel.use_rules(rules):
    shardings = runs.param_shardings(CFG, mesh)
  assert shardings["layers"]["q"].spec == q_spec
  assert shardings["embed"].spec == embed_spec


def test_axes_that_do_not_divide_stay_replicated():
  one_kv = dataclasses.replace(CFG, num_kv_heads=1)
  shardings = runs.param_shardings(one_kv, parallel.make_mesh(2, 2, 2))
  assert shardings["layers"]["k"].spec == P(None, "fsdp", None, None)
  # A batch of 2 over data x fsdp = 2 x 4 goes over data alone.
  assert parallel.batch_sharding(parallel.make_mesh(2, 4, 1),
                                 (2, 5)).spec == P("data", None)


def _batch():
  rng = np.random.default_rng(0)
  return dict(tokens=rng.integers(3, 40, (8, 12)).astype(np.int32),
              segment_ids=np.ones((8, 12), np.int32),
              loss_mask=np.ones((8, 12), np.int32))


_step = jax.jit(make_train_step(CFG, OPT))


def _run(mesh, params=None):
  """Initial state (from ``params``, else initialised sharded), one train
  step and greedy completions on ``mesh``."""
  prompt = np.random.default_rng(1).integers(3, 40, (8, 5)).astype(np.int32)
  with parallel.activate(mesh):
    if params is None:
      params = runs.init_params(CFG, mesh, 0)
    else:
      params = jax.device_put(params, runs.param_shardings(CFG, mesh))
    state = training.init_state(params, OPT)
    rollout = sampler.sample(state["params"], CFG, prompt,
                             np.ones_like(prompt), jax.random.key(0), GREEDY)
    new, metrics = _step(state, parallel.shard_batch(mesh, _batch()))
  total, count = metrics["loss"]
  return state, new, float(total / count), np.asarray(rollout.completion)


@pytest.fixture(scope="module")
def single_device():
  return _run(parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))


@pytest.mark.parametrize("shape", [(1, 8, 1), (2, 4, 1), (2, 2, 2)])
def test_sharded_state_step_and_generation_match_one_device(shape,
                                                            single_device):
  mesh = parallel.make_mesh(*shape)
  ref_state, ref_new, ref_loss, ref_tokens = single_device
  # Initialising sharded compiles slowly on CPU (threefry): done on one mesh,
  # checked against the single-device parameters below.
  state, new, loss, tokens = _run(
      mesh, None if shape == (2, 2, 2) else ref_state["params"])
  mu = state["opt_state"][0].mu
  fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
  for leaf, spec, ways in [
      (state["params"]["layers"]["q"], P(None, "fsdp", "tensor", None),
       fsdp * tensor),
      (mu["layers"]["q"], P(None, "fsdp", "tensor", None), fsdp * tensor),
      (state["params"]["embed"], P("tensor", "fsdp"), fsdp * tensor),
      (mu["embed"], P("tensor", "fsdp"), fsdp * tensor),
      (mu["layers"]["down"], P(None, "tensor", "fsdp"), fsdp * tensor),
      (mu["final_norm"], P(None), 1)]:
    assert leaf.sharding.spec == spec
    assert len(leaf.sharding.device_set) == 8
    # No device holds more than its 1/ways share.
    assert max(s.data.size for s in leaf.addressable_shards) * ways == (
        leaf.size)
  for a, r in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
  for before, after in zip(jax.tree.leaves(state["opt_state"]),
                           jax.tree.leaves(new["opt_state"])):
    assert after.sharding.is_equivalent_to(before.sharding, before.ndim)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for a, r in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=1e-5)
  np.testing.assert_array_equal(tokens, ref_tokens)


def test_cli_mopd_with_two_teachers_on_a_sharded_mesh(smoke_run, tmp_path,
                                                      data_dir, cached_env):
  """The student (the smoke base: one kv head, so kv stays replicated)
  sharded over data=2 x fsdp=2 x tensor=2, its two teachers on a sub-mesh
  of 4 devices, with the full-vocabulary KL loss."""
  base = smoke_run[0]
  run = tmp_path / "mopd"
  result = train_cli(
      f"--config={ROOT}/configs/mopd.py:smoke", f"--workdir={run}",
      f"--config.init={base}", f"--config.teachers=add={base},sort={base}",
      "--config.data.domains=('add','sort')", "--config.eval.domains=('add',)",
      f"--config.data.data_dir={data_dir}", "--config.train.steps=2",
      "--config.eval.greedy=False", "--config.mesh.fsdp=2",
      "--config.mesh.tensor=2", "--config.opd.teacher_devices=4",
      "--config.mesh.cpu_devices=8", "--config.opd.loss=kl", env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  # No array resharded by replicating it whole (a sharded gather's fallback).
  assert "full rematerialization" not in result.stderr
  records = [json.loads(l) for l in open(run / "metrics.jsonl")]
  assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
  assert os.path.exists(run / "summary.json")
  # Headroom on the evaluated domain and decoding mode only (teachers equal
  # to the base: no headroom to divide by).
  assert json.load(open(run / "headroom.json")) == {"sampled": {"mean": 0.0}}


def test_stacked_teachers_keep_their_sharding_and_their_scores():
  """``teachers.stack_teachers`` on a teacher sub-mesh of 4 devices
  (fsdp=2 x tensor=2): every stacked leaf is sharded as the teacher's own
  leaf on its other axes, and the one vmapped pass gives each teacher's
  scores of every row."""
  from mopd_jax.distill import teachers
  from mopd_jax.models import decoder
  mesh = parallel.make_mesh(data=1, fsdp=2, tensor=2,
                            devices=jax.devices()[4:])
  shardings = runs.param_shardings(CFG, mesh)
  params = [(jax.device_put(decoder.init_params(CFG, jax.random.key(k)),
                            shardings),) for k in (1, 2)]
  scorers = [teachers.make_scorer((CFG,), (1.0,), True, False)] * 2
  scorer, stacked = teachers.stack_teachers(scorers, params)
  for leaf, alone in zip(jax.tree.leaves(stacked),
                         jax.tree.leaves(params[0])):
    assert leaf.sharding.spec == P(None, *alone.sharding.spec)
    assert leaf.sharding.mesh == alone.sharding.mesh
  rng = np.random.default_rng(0)
  arrays = dict(prompt=rng.integers(3, 40, (4, 5)).astype(np.int32),
                prompt_mask=np.ones((4, 5), np.int32),
                completion=rng.integers(3, 40, (4, 6)).astype(np.int32),
                mask=np.ones((4, 6), np.int32))
  one_each = teachers.score_every(scorers, params, arrays, mesh)
  together = teachers.score_every(scorers, params, arrays, mesh,
                                  stacked=(scorer, stacked))
  for key in ("teacher_logp", "teacher_entropy"):
    assert one_each[key].shape == (2, 4, 6)
    np.testing.assert_allclose(together[key], one_each[key], rtol=1e-5,
                               atol=1e-5)


def test_only_process_zero_writes_files(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  training.write_json_atomic(str(tmp_path / "summary.json"), {"a": 1})
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(1, {"loss": 1.0})
  writer.close()
  assert list(tmp_path.iterdir()) == []


def test_distributed_start_from_config_or_environment(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda **kw: calls.append(kw))
  section = stages.defaults("pretrain").distributed
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert not parallel.init_distributed(section) and not calls
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert parallel.init_distributed(section)
  assert calls == [dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                        process_id=3)]
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
               "JAX_PROCESS_ID"):
    monkeypatch.delenv(name)
  section.enabled = True  # a TPU pod slice: everything detected
  parallel.init_distributed(section)
  assert calls[-1] == dict(coordinator_address=None, num_processes=None,
                           process_id=None)


def test_cpu_devices_not_in_effect_is_one_line():
  """A config asking for 2 CPU devices in a process that has 8 (the split
  happens only at a process's start) is refused, not silently ignored."""
  config = stages.defaults("pretrain")
  config.mesh.cpu_devices = 2
  with pytest.raises(ConfigError, match="mesh.cpu_devices: 2 takes effect"):
    runs.setup(stages.validate(config))


def test_config_checks_the_rule_set():
  config = stages.defaults("pretrain")
  config.mesh.rules = "zero3"
  with pytest.raises(ConfigError, match="mesh.rules"):
    stages.validate(config)
