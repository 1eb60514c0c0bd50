"""Hugging Face checkpoints in and out: tiny random models of each family
saved by transformers itself, imported into run directories and exported
back, compared with transformers' own logits."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import python_m  # noqa: E402
from mopd_jax import convert, parallel, runs  # noqa: E402
from mopd_jax.errors import CheckpointError  # noqa: E402
from mopd_jax.checksum import named_leaves  # noqa: E402
from mopd_jax.models import decoder, hf  # noqa: E402
from mopd_jax.models.tokenizer import CharTokenizer  # noqa: E402
from mopd_jax.models.config import ModelConfig  # noqa: E402

FAMILIES = {
    "llama": transformers.LlamaConfig(
        vocab_size=61, hidden_size=40, intermediate_size=56,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, rope_theta=50_000.0, tie_word_embeddings=False),
    "qwen2": transformers.Qwen2Config(
        vocab_size=61, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=True),
    "qwen3": transformers.Qwen3Config(
        vocab_size=61, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=24, tie_word_embeddings=False),
}


def _saved(tmp_path, family, shard=False):
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      FAMILIES[family], dtype=torch.float32).eval()
  with torch.no_grad():  # every tensor away from its init, biases included
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  path = tmp_path / f"hf_{family}"
  model.save_pretrained(path, max_shard_size="20KB" if shard else "5GB")
  # A one-token-per-character Hugging Face tokenizer of 40 ids.
  CharTokenizer("0123456789abcdefghijklmnopqrstuvwxyz+").save_hf(str(path))
  return model, str(path)


def _convert(*args):
  return python_m("mopd_jax.convert", *args)


TOKENS = np.random.default_rng(0).integers(0, 61, (2, 40))


def _our_logits(run_dir):
  cfg = ModelConfig(**runs.load_run_config(run_dir).model.to_dict())
  params = runs.load_params(run_dir, cfg, parallel.make_mesh(
      data=1, fsdp=1, tensor=1, devices=jax.devices()[:1]))
  logits, _ = decoder.apply(params, cfg, jnp.asarray(TOKENS, jnp.int32),
                            jnp.ones(TOKENS.shape, jnp.int32))
  return np.asarray(logits)


@pytest.mark.parametrize("family,shard", [("llama", True), ("qwen2", False),
                                          ("qwen3", False)])
def test_import_then_export_matches_transformers(tmp_path, family, shard):
  model, path = _saved(tmp_path, family, shard)
  if shard:
    assert os.path.exists(os.path.join(path, convert.INDEX_FILE))
  run_dir = str(tmp_path / "run")
  summary = convert.import_hf(path, run_dir)
  assert runs.finished(run_dir) and summary["params_sha256"]
  with torch.no_grad():
    theirs = model(torch.from_numpy(TOKENS)).logits.numpy()
  np.testing.assert_allclose(_our_logits(run_dir), theirs, atol=2e-5)
  out = str(tmp_path / "exported")
  convert.export_run(run_dir, out)
  exported = json.load(open(os.path.join(out, "config.json")))
  assert exported["max_position_embeddings"] == (
      FAMILIES[family].max_position_embeddings)
  again = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32).eval()
  with torch.no_grad():
    np.testing.assert_array_equal(
        again(torch.from_numpy(TOKENS)).logits.numpy(), theirs)


def test_import_places_each_leaf_in_its_shards_as_it_is_built(
    tmp_path, monkeypatch):
  """Import hands every leaf, as soon as ``from_hf`` builds it from host
  arrays, to the FSDP shards over all 8 devices (the host never holds the
  model), and the run loads back with the checkpoint's values."""
  _, path = _saved(tmp_path, "llama")
  placed = []
  real = hf.from_hf

  def spying(tensors, cfg, place):
    def recorded(name, leaf):
      assert isinstance(leaf, np.ndarray)
      out = place(name, leaf)
      placed.append((name, len(out.sharding.device_set),
                     out.addressable_shards[0].data.shape, leaf.shape))
      return out
    return real(tensors, cfg, recorded)

  monkeypatch.setattr(hf, "from_hf", spying)
  convert.import_hf(path, str(tmp_path / "run"))
  cfg = ModelConfig(**runs.load_run_config(str(tmp_path / "run")
                                           ).model.to_dict())
  assert sorted(n for n, *_ in placed) == sorted(
      n for n, _ in named_leaves(runs.param_shapes(cfg)))
  assert all(devices == 8 for _, devices, _, _ in placed)
  # layers/q [2, 40, 4, 12]: its embed axis split over the 8-way fsdp axis.
  q = next(p for p in placed if p[0] == "layers/q")
  assert q[2] == (2, 5, 4, 12) and q[3] == (2, 40, 4, 12)


def test_a_bfloat16_checkpoint_imports_as_float32_master_weights(tmp_path):
  """A checkpoint stored in bfloat16 (as Qwen3's are) becomes float32
  weights to train, exactly the stored values; ``param_dtype=bfloat16``
  keeps them as they are; export writes bfloat16 when asked."""
  model, path = _saved(tmp_path, "qwen3")
  model.to(torch.bfloat16).save_pretrained(path)
  stored = model.model.embed_tokens.weight.float().detach().numpy()
  for dtype in ("float32", "bfloat16"):
    run_dir = str(tmp_path / dtype)
    convert.import_hf(path, run_dir, param_dtype=dtype)
    cfg, params = runs.final_model(run_dir)
    assert cfg.param_dtype == dtype
    assert {leaf.dtype.name for leaf in jax.tree.leaves(params)} == {dtype}
    np.testing.assert_array_equal(
        np.asarray(params["embed"], np.float32), stored)
  # Exported back as bfloat16 from the float32 run: the same bits as the
  # original checkpoint, which transformers reads as bfloat16.
  out = str(tmp_path / "exported")
  convert.export_run(str(tmp_path / "float32"), out, dtype="bfloat16")
  again = transformers.AutoModelForCausalLM.from_pretrained(out)
  assert json.load(open(os.path.join(out, "config.json")))[
      "torch_dtype"] == "bfloat16"
  assert again.model.embed_tokens.weight.dtype == torch.bfloat16
  np.testing.assert_array_equal(
      again.model.embed_tokens.weight.float().detach().numpy(), stored)


def test_cli_round_trip_and_one_line_errors(tmp_path):
  _, path = _saved(tmp_path, "qwen3")
  run_dir, out = str(tmp_path / "run"), str(tmp_path / "out")
  result = _convert("import", f"--hf_dir={path}", f"--out={run_dir}")
  assert result.returncode == 0, result.stderr[-2000:]
  result = _convert("export", f"--run={run_dir}", f"--out={out}")
  assert result.returncode == 0, result.stderr[-2000:]
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                     "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"]

  def one_line(result, *words):
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for w in words:
      assert w in lines[0], lines[0]

  one_line(_convert("import", f"--hf_dir={path}", f"--out={run_dir}"),
           "exists")
  one_line(_convert("convert", f"--out={tmp_path / 'x'}"), "import", "export")


@pytest.mark.parametrize("change,words", [
    (dict(model_type="gpt2"), ("gpt2", "supported")),
    (dict(num_hidden_layers=3), ("model.layers.2", "missing")),
    (dict(num_hidden_layers=1), ("model.layers.1", "not part")),
    (dict(vocab_size=30), ("40 ids", "30")),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ("yarn",)),
    # what the decoder does not compute is refused, not run as SiLU
    (dict(hidden_act="gelu"), ("hidden_act", "gelu")),
    (dict(quantization_config={"quant_method": "gguf"}),
     ("quantization_config",)),
    (dict(num_attention_heads=0), ("must be > 0",)),
    (dict(num_hidden_layers=-1), ("num_hidden_layers = -1",)),
    (dict(rope_theta=-5), ("rope_theta",)),
    (dict(max_position_embeddings=-3), ("max_position_embeddings = -3",)),
    (dict(max_position_embeddings="8k"), ("max_position_embeddings = '8k'",
                                          "integer")),
    (dict(rope_parameters=[1, 2], rope_theta=None), ("rope_parameters",)),
    ([], ("expected a JSON object",)),
    (None, ("expected a JSON object",)),
    # a value of the wrong type is refused, not coerced (bool("false"))
    (dict(tie_word_embeddings="false"), ("tie_word_embeddings", "true or")),
    (dict(num_hidden_layers=2.9), ("num_hidden_layers = 2.9", "integer")),
    (dict(hidden_size="32"), ("hidden_size = '32'", "integer")),
    (dict(rms_norm_eps="abc"), ("rms_norm_eps", "a number")),
    # sizes no memory holds: refused from the tensors' headers, at once
    (dict(vocab_size=10**12), ("embed_tokens", "1000000000000")),
    (dict(num_hidden_layers=10**9), ("num_hidden_layers = 1000000000",
                                     "holds")),
])
def test_a_bad_checkpoint_is_one_error_and_leaves_nothing(tmp_path, change,
                                                          words):
  _, path = _saved(tmp_path, "qwen3")
  config = json.loads(open(os.path.join(path, "config.json")).read())
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(config, **change) if isinstance(change, dict) else change,
              f)
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert.import_hf(path, str(out))
  for w in words:
    assert w in str(e.value), str(e.value)
  assert not out.exists()
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".convert")]


def _corrupt(path, how):
  """The checkpoint at ``path`` damaged in one of the ways a download or a
  hostile upload damages it."""
  model = os.path.join(path, "model.safetensors")
  data = open(model, "rb").read()
  if how == "truncated":
    open(model, "wb").write(data[:len(data) // 2])
  elif how == "empty":
    open(model, "wb").write(b"")
  elif how == "huge_header":
    open(model, "wb").write((2**62).to_bytes(8, "little") + data[8:])
  elif how == "bad_header":
    open(model, "wb").write(data[:8] + b"{not json" + data[17:])
  elif how == "outside":
    os.rename(model, os.path.join(os.path.dirname(path), "x.safetensors"))
    json.dump({"weight_map": {"model.embed_tokens.weight":
                              "../x.safetensors"}},
              open(os.path.join(path, convert.INDEX_FILE), "w"))
  elif how == "index_list":
    json.dump([], open(os.path.join(path, convert.INDEX_FILE), "w"))
  elif how in ("fifo", "device"):  # reading either would never end
    os.remove(model)
    if how == "fifo":
      os.mkfifo(model)
    else:
      os.symlink("/dev/zero", model)
  else:  # a tensor of another dtype, holding NaN, or past float32
    from safetensors.numpy import load_file, save_file
    tensors = load_file(model)
    name = "model.norm.weight"
    tensors[name] = {"int": lambda x: x.astype(np.int32),
                     "nan": lambda x: x * np.nan,
                     "f64": lambda x: x.astype(np.float64) * 1e300,
                     }[how](tensors[name])
    save_file(tensors, model)


@pytest.mark.parametrize("how,words", [
    ("truncated", "unreadable"), ("empty", "unreadable"),
    ("huge_header", "unreadable"), ("bad_header", "unreadable"),
    ("outside", "lies outside"), ("index_list", "weight_map"),
    ("int", "dtype int32"), ("nan", "NaN"), ("f64", "NaN or inf"),
    ("fifo", "model.safetensors: not a regular file"),
    ("device", "model.safetensors: lies outside"),
])
def test_a_damaged_or_hostile_checkpoint_is_refused(tmp_path, how, words,
                                                    recwarn):
  _, path = _saved(tmp_path, "llama")
  _corrupt(path, how)
  out = tmp_path / "new" / "out"
  with pytest.raises(CheckpointError, match=words):
    convert.import_hf(path, str(out))
  # nothing at the output, not even the parent it had to create
  assert not (tmp_path / "new").exists()
  assert not [w for w in recwarn if "overflow" in str(w.message)]


def test_weights_past_the_runs_dtype_are_refused(tmp_path):
  """A float32 weight no bfloat16 holds: refused at import, not written
  as inf into a run that fails later."""
  from safetensors.numpy import load_file, save_file
  _, path = _saved(tmp_path, "llama")
  model = os.path.join(path, "model.safetensors")
  tensors = load_file(model)
  tensors["model.norm.weight"][0] = 3.4e38
  save_file(tensors, model)
  with pytest.raises(CheckpointError,
                     match="model.norm.weight overflows bfloat16"):
    convert.import_hf(path, str(tmp_path / "out"), "bfloat16")
  convert.import_hf(path, str(tmp_path / "out"))  # float32 holds it


def test_export_refuses_a_run_whose_tokenizer_is_gone(tmp_path):
  """Without its tokenizer.json a run would fall back to the built-in
  character tokenizer: exported beside the model, another vocabulary."""
  _, path = _saved(tmp_path, "qwen2")
  run_dir = str(tmp_path / "run")
  convert.import_hf(path, run_dir)
  os.remove(os.path.join(run_dir, "tokenizer.json"))
  with pytest.raises(CheckpointError, match="tokenizer"):
    convert.export_run(run_dir, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_errors_inside_an_imported_checkpoint_name_the_users_files(
    tmp_path):
  """A Hugging Face directory read as a run is imported to a temporary
  copy; an error about a copied file names the user's."""
  from mopd_jax.errors import DataError
  _, path = _saved(tmp_path, "qwen2")
  with pytest.raises(DataError) as e:
    with convert.as_run(path) as run_dir:
      raise DataError(f"{run_dir}/chat_template.jinja: the template failed")
  assert str(e.value) == f"{path}/chat_template.jinja: the template failed"


def test_score_refuses_lines_past_a_checkpoints_positions(tmp_path):
  """``score`` on a Hugging Face directory whose config.json states 8
  positions: a longer line is one error naming it, nothing written."""
  _, path = _saved(tmp_path, "llama")
  config = json.load(open(os.path.join(path, "config.json")))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(config, max_position_embeddings=8), f)
  lines = tmp_path / "in.jsonl"
  lines.write_text('{"text": "1+1"}\n{"text": "abcdefghijkl"}\n')
  out = tmp_path / "out.jsonl"
  result = python_m("mopd_jax.score", f"--model={path}", f"--input={lines}",
                    f"--output={out}")
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip() == (
      f"error: {lines}:2: 12 tokens, more than the model's"
      " max_position_embeddings 8")
  assert not out.exists()
