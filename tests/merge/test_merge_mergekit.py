"""Each merge method against mergekit's own implementation (the peer whose
parameterisation ``mopd_jax/merge/`` follows), on the same tensors: the
merged tensor must agree to float32 rounding.

DARE is left out (its random masks come from ``jax.random``, not torch's
draw); its keep count and rescale are tested by hand in test_merge.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("mergekit")
from mergekit.merge_methods import registry  # noqa: E402
from mergekit.merge_methods.base import TensorGroup  # noqa: E402
from mergekit.merge_methods.slerp import slerp as mk_slerp  # noqa: E402

from mopd_jax.merge import methods, parameters  # noqa: E402

WEIGHTS = (1.0, 0.5, 2.0)


def _tensors(shape=(12, 10), seed=0):
  rng = np.random.default_rng(seed)
  base = rng.normal(size=shape).astype(np.float32)
  # Task vectors of mixed sign and scale, partly shared between experts.
  shared = rng.normal(size=shape).astype(np.float32)
  experts = np.stack([base + 0.3 * shared * (d - 1)
                      + 0.2 * rng.normal(size=shape).astype(np.float32)
                      for d in range(len(WEIGHTS))])
  return base, experts


def _ours(method, base, experts, **settings):
  s = parameters.Settings(method=method, weights=WEIGHTS, **settings)
  return np.asarray(methods.METHODS[method].fn(jnp.asarray(base),
                                         jnp.asarray(experts), s))


def _theirs(method, base, experts, **shared):
  group = TensorGroup.from_tensors(
      [torch.from_numpy(base)] + [torch.from_numpy(e) for e in experts],
      base_index=0)
  ids = range(1, len(experts) + 1)
  per_expert = {k: dict.fromkeys(ids, shared.pop(k))
                for k in ("density", "gamma") if k in shared}
  params = dict(int8_mask=False, rescale=False,
                weight=dict(zip(ids, WEIGHTS)), **per_expert, **shared)
  method_ = registry.get(method)
  normalize = [p.default for p in method_.spec.parameters
               if p.name == "normalize"]
  params.setdefault("normalize", normalize[0] if normalize else None)
  params.setdefault("lambda", 1.0)
  return method_.merge_group(group, **params).numpy()


@pytest.mark.parametrize("method,settings", [
    ("task_arithmetic", dict(lam=0.7)),
    ("ties", dict(density=0.4, lam=1.0)),
    ("ties", dict(density=0.7, lam=0.5)),
    ("ties", dict(density=0.005, lam=1.0)),  # under one entry: keeps one
    ("breadcrumbs", dict(density=0.6, gamma=0.05, lam=0.8)),
    ("breadcrumbs_ties", dict(density=0.5, gamma=0.1, lam=1.0)),
])
def test_task_arithmetic_family_matches_mergekit(method, settings):
  base, experts = _tensors()
  theirs = _theirs(method, base, experts, **{
      {"lam": "lambda"}.get(k, k): v for k, v in settings.items()})
  np.testing.assert_allclose(_ours(method, base, experts, **settings),
                             theirs, rtol=1e-5, atol=1e-6)


def test_ties_normalize_off_matches_mergekit():
  base, experts = _tensors(seed=1)
  theirs = _theirs("ties", base, experts, density=0.5, normalize=False)
  np.testing.assert_allclose(
      _ours("ties", base, experts, density=0.5, normalize=False), theirs,
      rtol=1e-5, atol=1e-6)


def test_model_stock_matches_mergekit():
  base, experts = _tensors(seed=2)
  group = TensorGroup.from_tensors(
      [torch.from_numpy(base)] + [torch.from_numpy(e) for e in experts],
      base_index=0)
  theirs = registry.get("model_stock").merge_group(group).numpy()
  np.testing.assert_allclose(_ours("model_stock", base, experts), theirs,
                             rtol=1e-5, atol=1e-6)


def test_karcher_matches_mergekit():
  from mergekit.merge_methods.karcher import karcher_merge_tensors
  base, experts = _tensors(seed=3)
  alphas = [w / sum(WEIGHTS) for w in WEIGHTS]
  theirs = karcher_merge_tensors([torch.from_numpy(e) for e in experts],
                                 alphas).numpy()
  np.testing.assert_allclose(_ours("karcher", base, experts), theirs,
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_slerp_of_one_tensor_matches_mergekit(t):
  """mergekit slerps each leading-axis row of a tensor; one row is the
  whole tensor, which is what ``methods.slerp`` interpolates."""
  _, experts = _tensors(seed=4)
  v0, v1 = (torch.from_numpy(e.reshape(1, -1)) for e in experts[:2])
  theirs = mk_slerp(torch.tensor([t]), v0, v1).numpy().reshape(
      experts.shape[1:])
  ours = methods.slerp(None, jnp.asarray(experts[:2]),
                     parameters.Settings(method="slerp", weights=(1.0, 1.0), t=t))
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-6)


def test_the_data_free_merge_command_matches_mergekit_yaml(tmp_path):
  """``train --config=configs/merge.py --config.init=BASE
  --config.experts=A,B`` (no data) then ``convert export``, against
  ``mergekit-yaml`` on the same checkpoints and the same YAML: every
  tensor of the two outputs agrees."""
  import json
  import subprocess
  import sys
  import transformers
  from safetensors.numpy import load_file
  from conftest import ROOT, train_cli
  from mopd_jax import convert
  from mopd_jax.models.tokenizer import CharTokenizer
  config = transformers.LlamaConfig(
      vocab_size=40, hidden_size=16, intermediate_size=24,
      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
      head_dim=8, tie_word_embeddings=False)
  torch.manual_seed(0)
  base = transformers.LlamaForCausalLM(config)
  dirs = {}
  for name, scale in (("base", 0.0), ("e1", 0.02), ("e2", 0.03)):
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(base.state_dict())
    with torch.no_grad():
      for p in model.parameters():
        p.add_(scale * torch.randn_like(p))
    model.save_pretrained(tmp_path / name)
    CharTokenizer("0123456789abcdefghijklmnopqrstuvwxyz+").save_hf(
        str(tmp_path / name))
    dirs[name] = str(tmp_path / f"run_{name}")
    convert.import_hf(str(tmp_path / name), dirs[name])
  result = train_cli(f"--config={ROOT}/configs/merge.py",
                     f"--workdir={tmp_path / 'merged'}",
                     f"--config.init={dirs['base']}",
                     f"--config.experts={dirs['e1']},{dirs['e2']}",
                     "--config.merge.method=ties",
                     "--config.merge.weights=(1.0,0.5)",
                     "--config.merge.density=0.5",
                     "--config.merge.lambda=0.8")
  assert result.returncode == 0, result.stderr[-2000:]
  convert.export_run(str(tmp_path / "merged"), str(tmp_path / "ours"))
  (tmp_path / "merge.yml").write_text(json.dumps({  # YAML is a JSON superset
      "merge_method": "ties", "base_model": str(tmp_path / "base"),
      "models": [{"model": str(tmp_path / "e1"),
                  "parameters": {"weight": 1.0, "density": 0.5}},
                 {"model": str(tmp_path / "e2"),
                  "parameters": {"weight": 0.5, "density": 0.5}}],
      "parameters": {"lambda": 0.8}, "dtype": "float32"}))
  result = subprocess.run(
      [sys.executable, "-m", "mergekit.scripts.run_yaml",
       str(tmp_path / "merge.yml"), str(tmp_path / "theirs")],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
  theirs = {}
  for f in (tmp_path / "theirs").glob("*.safetensors"):
    theirs.update(load_file(str(f)))
  assert sorted(ours) == sorted(theirs)
  for name in ours:
    np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5,
                               atol=1e-6, err_msg=name)
