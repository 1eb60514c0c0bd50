"""The Merge stage end to end: a merge of smoke experts is an ordinary run
(MOPD's init, evaluate's run), deterministic, with its geometry; malformed
input is one line, exit 2, nothing written."""

import json
import shutil

import jax
import pytest
from conftest import ROOT, python_m, train_cli

from mopd_jax.models.config import ModelConfig
from mopd_jax import parallel, runs
from mopd_jax.checkpointing import Checkpointer
from mopd_jax.evaluation import geometry

# Its module-scoped fixture is built once: every test of the module on one
# pytest-xdist worker (--dist=loadgroup).
pytestmark = pytest.mark.xdist_group("merge_stage")

DOMAINS = ("add", "chain", "instruct", "sort")


def _expert(base, out, seed):
  """A run directory like an expert of ``base``: its config, and its
  parameters moved by a sparse random task vector."""
  out.mkdir()
  shutil.copy(base / "config.json", out / "config.json")
  config = runs.load_run_config(str(base))
  cfg = ModelConfig.of(config.model)
  mesh = parallel.make_mesh(data=1, fsdp=1, tensor=1,
                                   devices=jax.devices()[:1])
  params = runs.load_params(str(base), cfg, mesh)
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  moved = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(
      next(keys), p.shape) * jax.random.bernoulli(next(keys), 0.3, p.shape),
      params)
  ckpt = Checkpointer(str(out), every=1, keep=1)
  ckpt.save(1, {"params": moved}, force=True)
  ckpt.close()


@pytest.fixture(scope="module")
def experts(smoke_run, tmp_path_factory):
  root = tmp_path_factory.mktemp("experts")
  for i, d in enumerate(DOMAINS):
    _expert(smoke_run[0], root / f"expert_{d}", seed=i)
  return smoke_run[0], str(root / "expert_{domain}")


def _merge(base, experts, workdir, data_dir, *extra, env=None):
  return train_cli(f"--config={ROOT}/configs/merge.py:smoke",
                   f"--workdir={workdir}", f"--config.init={base}",
                   f"--config.experts={experts}",
                   f"--config.data.data_dir={data_dir}", *extra, env=env)


def test_merge_is_a_run_that_other_stages_and_evaluate_accept(
    experts, tmp_path, data_dir, cached_env):
  base, template = experts
  run = tmp_path / "ties"
  result = _merge(base, template, run, data_dir, "--config.merge.method=ties",
                  "--config.merge.sweep=True", env=cached_env)
  assert result.returncode == 0, result.stderr[-3000:]
  for name in ("config.json", "eval.json", "summary.json", "geometry.json",
               "sweep.json", "cosine.png", "cosine_per_layer.png"):
    assert (run / name).exists(), name
  summary = json.loads((run / "summary.json").read_text())
  assert summary["step"] == 0 and summary["merge"]["method"] == "ties"
  sweep = json.loads((run / "sweep.json").read_text())
  assert len(sweep["grid"]) == 2 and sweep["split"] == "validation"
  assert summary["merge"]["lam"] == sweep["best"]["lam"]
  scalars = json.loads((run / "eval.json").read_text())
  for d in (*DOMAINS, "reverse"):
    for mode in ("greedy", "sampled"):
      assert f"eval/{mode}/{d}/accuracy" in scalars
  geometry = json.loads((run / "geometry.json").read_text())
  assert geometry["cosine"]["add"]["add"] == pytest.approx(1.0)
  assert 0.2 < geometry["sparsity"]["add"] < 0.4  # drawn with p = 0.3

  mopd = train_cli(f"--config={ROOT}/configs/mopd.py:smoke",
                   f"--workdir={tmp_path / 'mopd'}", f"--config.init={run}",
                   f"--config.teachers={template}",
                   "--config.train.steps=2",
                   f"--config.data.data_dir={data_dir}", env=cached_env)
  assert mopd.returncode == 0, mopd.stderr[-3000:]
  evaluated = python_m("mopd_jax.evaluate", f"--run={run}",
                       "--num_prompts=4", "--domains=add", env=cached_env)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  assert "eval/greedy/add/accuracy" in json.loads(
      (run / "eval_4.json").read_text())


@pytest.mark.parametrize("extra, message", [
    (("--config.merge.density=1.5",), "merge.density: must be in (0, 1]"),
    (("--config.merge.method=fisher",), "merge.method: must be one of"),
    (("--config.merge.overrides=(:density=0.5",), "merge.overrides: bad"
     " pattern"),
    (("--config.merge.method=slerp",), "merge.method: slerp takes 2 experts, got 4"),
])
def test_bad_settings_are_one_line_and_write_nothing(experts, tmp_path,
                                                     data_dir, extra,
                                                     message):
  base, template = experts
  result = _merge(base, template, tmp_path / "run", data_dir, *extra)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith(
      f"error: {message}"), result.stderr[-500:]
  assert not (tmp_path / "run").exists()


def test_bad_experts_are_one_line_and_write_nothing(experts, smoke_run,
                                                    tmp_path, data_dir):
  base, template = experts
  missing = template.replace("{domain}", "x_{domain}")
  result = _merge(base, missing, tmp_path / "run", data_dir)
  assert result.returncode == 2
  assert "not a mopd_jax run directory" in result.stderr.splitlines()[-1]
  # An expert of another shape
  other = tmp_path / "other"
  shutil.copytree(template.replace("{domain}", "sort"), other)
  config = json.loads((other / "config.json").read_text())
  config["model"]["embed_dim"] = 64
  (other / "config.json").write_text(json.dumps(config))
  pairs = ",".join(f"{d}={template.replace('{domain}', d)}"
                   for d in DOMAINS[:3]) + f",sort={other}"
  result = _merge(base, pairs, tmp_path / "run", data_dir)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: experts: {other} has model.embed_dim = 64, the base 32")
  assert not (tmp_path / "run").exists()


def test_geometry_of_runs_alone(experts, tmp_path):
  base, template = experts
  found = geometry.from_runs(str(base), template, DOMAINS)
  assert set(found["cosine"]) == set(DOMAINS)
  assert 0.2 < found["sparsity"]["sort"] < 0.4
  # The command line: a bad --experts is one line, exit 2.
  bad = python_m("mopd_jax.evaluation.geometry", f"--init={base}",
                 f"--experts=add={base}", f"--out={tmp_path / 'x'}")
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1] == (
      "error: --experts: no run for domain 'chain'")
