"""Hugging Face checkpoints in and out of run directories.

    python -m mopd_jax.convert import --hf_dir=D --out=RUN \
        [--param_dtype=float32|bfloat16]
    python -m mopd_jax.convert export --run=RUN --out=D [--dtype=bfloat16]

``import`` reads a Llama, Qwen2 or Qwen3 ``config.json`` and its
safetensors (one file, or shards listed in ``model.safetensors.index.json``)
into a run directory like any other: ``config.json`` (the model section
and the fingerprint of the checkpoint's ``tokenizer.json``, which it must
have), a checkpoint of step 0 and ``summary.json`` with the parameters'
sha256; the tokenizer files are copied along, so the run trains,
evaluates and distils with that tokenizer. Each
tensor is read from disk when its leaf is built (``models.hf.from_hf``
walks ``TENSORS`` leaf by leaf) and the leaf goes at once into its FSDP
shards over every local device, so the host holds one stacked leaf at a
time, never the model. ``export`` writes the run's parameters back as one
``model.safetensors`` with the Hugging Face ``config.json`` and the run's
tokenizer as Hugging Face files, loadable by ``transformers`` unchanged.
Anything wrong (an unsupported architecture, a missing, extra or
misshapen tensor, an output that exists) is one line and exit code 2,
with nothing left at the output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from typing import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from mopd_jax import checkpointing, cli, json_files, parallel, runs, training
from mopd_jax.checksum import named_leaves
from mopd_jax.errors import CheckpointError, UserError, reason
from mopd_jax.models import hf
from mopd_jax.models import tokenizer as tokenizer_lib
from mopd_jax.models.config import ModelConfig


FAMILIES = {"llama": {}, "qwen2": {"attention_bias": True},
            "qwen3": {"qk_norm": True}}
INDEX_FILE = "model.safetensors.index.json"


# config.json fields the decoder computes one way only: each must be absent
# or have one of the values given, else the import is refused rather than
# give a model that computes something else.
COMPUTED_AS = {"hidden_act": ("silu", "swish"),
               "hidden_activation": ("silu", "swish"),
               "mlp_bias": (False,), "use_sliding_window": (False,),
               "partial_rotary_factor": (1, 1.0),
               "quantization_config": (None, {}), "pretraining_tp": (1,),
               "attention_dropout": (0, 0.0)}


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false"}


def _typed(fields, name: str, kind: str, path: str, default=None):
  """``fields[name]`` (``default`` when absent or null), which must be of
  ``kind`` as transformers' config classes declare it (``runs.is_a``: 2.9
  is no ``int``, ``"false"`` no ``bool``)."""
  value = fields.get(name)
  if value is None:
    if default is None:
      raise CheckpointError(f"{path}: no {name} field")
    return default
  if not runs.is_a(value, kind):
    raise CheckpointError(f"{path}: {name} = {value!r}: expected"
                          f" {_KINDS[kind]}")
  return float(value) if kind == "float" else value


def model_config(fields, path: str, param_dtype: str = "float32"
                 ) -> ModelConfig:
  """Our ``ModelConfig`` from a Hugging Face ``config.json`` (``path``
  names it in errors), its weights stored as ``param_dtype``. Only what
  the decoder implements is accepted: a field of ``COMPUTED_AS`` with
  another value, rope scaling, a size of the wrong type (``_typed``) or
  not positive, or an impossible head layout is a ``CheckpointError``."""
  if not isinstance(fields, dict):
    raise CheckpointError(f"{path}: expected a JSON object, got"
                          f" {type(fields).__name__}")
  family = fields.get("model_type")
  if family not in FAMILIES:
    raise CheckpointError(f"{path}: model_type {family!r} is not supported"
                          f" (supported: {', '.join(FAMILIES)})")
  for key, accepted in COMPUTED_AS.items():
    if key in fields and fields[key] not in accepted:
      raise CheckpointError(f"{path}: {key} = {fields[key]!r} is not"
                            " supported (the decoder computes"
                            f" {' or '.join(map(repr, accepted))})")
  if family == "llama" and fields.get("attention_bias"):
    raise CheckpointError(f"{path}: attention_bias = true: a Llama with"
                          " projection biases is not supported")
  rope_parameters = fields.get("rope_parameters") or {}
  if not isinstance(rope_parameters, dict):
    raise CheckpointError(f"{path}: rope_parameters: expected an object,"
                          f" got {type(rope_parameters).__name__}")
  scaling = fields.get("rope_scaling") or rope_parameters.get(
      "rope_type", "default")
  if scaling not in (None, "default") and not (
      isinstance(scaling, dict) and scaling.get("rope_type") == "default"):
    raise CheckpointError(f"{path}: rope scaling {scaling!r} is not"
                          " supported")
  heads = _typed(fields, "num_attention_heads", "int", path)
  hidden = _typed(fields, "hidden_size", "int", path)
  rope = (_typed(fields, "rope_theta", "float", path, 0.0) or _typed(
      rope_parameters, "rope_theta", "float", path, 10_000.0))
  try:
    cfg = ModelConfig(
        vocab_size=_typed(fields, "vocab_size", "int", path),
        embed_dim=hidden,
        num_layers=_typed(fields, "num_hidden_layers", "int", path),
        num_heads=heads,
        num_kv_heads=_typed(fields, "num_key_value_heads", "int", path,
                            heads),
        head_dim=_typed(fields, "head_dim", "int", path,
                        hidden // max(heads, 1)),
        mlp_dim=_typed(fields, "intermediate_size", "int", path),
        rope_theta=rope,
        norm_eps=_typed(fields, "rms_norm_eps", "float", path, 1e-6),
        tie_embeddings=_typed(fields, "tie_word_embeddings", "bool", path,
                              False),
        param_dtype=param_dtype,
        max_positions=_typed(fields, "max_position_embeddings", "int", path,
                             0),
        **{k: v for k, v in FAMILIES[family].items()})
  except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
    raise CheckpointError(f"{path}: {reason(e)}") from None
  for name, value in (("vocab_size", cfg.vocab_size),
                      ("hidden_size", cfg.embed_dim),
                      ("num_hidden_layers", cfg.num_layers),
                      ("num_attention_heads", cfg.num_heads),
                      ("num_key_value_heads", cfg.num_kv_heads),
                      ("head_dim", cfg.head_dim),
                      ("intermediate_size", cfg.mlp_dim),
                      # 0: none stated (unbounded), nothing to check
                      ("max_position_embeddings", cfg.max_positions or 1)):
    if value <= 0:
      raise CheckpointError(f"{path}: {name} = {value}: must be > 0")
  if cfg.head_dim % 2 or cfg.num_heads % cfg.num_kv_heads:
    raise CheckpointError(
        f"{path}: head_dim {cfg.head_dim} must be even and"
        f" num_key_value_heads {cfg.num_kv_heads} must divide"
        f" num_attention_heads {cfg.num_heads}")
  if not (0 < cfg.rope_theta < float("inf")) or not (
      0 < cfg.norm_eps < float("inf")):
    raise CheckpointError(f"{path}: rope_theta {cfg.rope_theta} and"
                          f" rms_norm_eps {cfg.norm_eps} must be finite and"
                          " > 0")
  return cfg


def _read_json(path: str):
  try:
    return json_files.read_json(path, CheckpointError)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: not found") from None


class Tensors(Mapping):
  """``{name: array}`` over a checkpoint's safetensors files, each tensor
  read when it is looked up. Files named by the index must lie inside
  ``hf_dir`` (after symlinks); a file safetensors cannot read (truncated,
  a corrupt header, bad offsets) is a ``CheckpointError`` naming it."""

  def __init__(self, hf_dir: str, stack: contextlib.ExitStack):
    from safetensors import safe_open
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(index):
      weight_map = _read_json(index)
      weight_map = weight_map.get("weight_map") if isinstance(
          weight_map, dict) else None
      if not isinstance(weight_map, dict) or not all(
          isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map: expected an object of"
                              " tensor name -> file name")
      files = sorted(set(weight_map.values()))
    else:
      files = ["model.safetensors"]
    root = os.path.realpath(hf_dir)
    self._where = {}
    for name in files:
      path = os.path.join(hf_dir, name)
      if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise CheckpointError(f"{path}: lies outside {hf_dir}")
      json_files.regular_file(path, CheckpointError)
      try:
        handle = stack.enter_context(safe_open(path, framework="flax"))
        keys = list(handle.keys())
      except Exception as e:  # pylint: disable=broad-except
        # SafetensorError (a corrupt or truncated file) is no OSError.
        raise CheckpointError(f"{path}: unreadable ({reason(e)})") from None
      for key in keys:
        self._where[key] = (handle, path)

  def __getitem__(self, name: str) -> np.ndarray:
    handle, path = self._where[name]
    try:
      with warnings.catch_warnings():  # a float64 past float32: said below
        warnings.simplefilter("ignore", RuntimeWarning)
        value = np.asarray(handle.get_tensor(name))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"{path}: tensor {name}: {reason(e)}") from None
    if not np.issubdtype(value.dtype, np.floating) and str(
        value.dtype) != "bfloat16":
      raise CheckpointError(f"{path}: tensor {name} has dtype {value.dtype};"
                            " weights must be floating point")
    if not np.isfinite(value).all():
      raise CheckpointError(f"{path}: tensor {name} holds NaN or inf")
    return value

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


@contextlib.contextmanager
def _output_dir(out: str):
  """A temporary directory beside ``out``, renamed to ``out`` when the
  body succeeds and removed, with the parents it had to create, when it
  fails."""
  out = os.path.abspath(os.path.expanduser(out))
  if os.path.exists(out):
    raise UserError(f"--out: {out} exists; choose a new directory")
  parent = os.path.dirname(out)
  created, up = None, parent  # the topmost directory makedirs creates
  while not os.path.exists(up):
    created, up = up, os.path.dirname(up)
  try:
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
  except OSError as e:
    raise UserError(f"--out: cannot write in {parent} ({reason(e)})"
                    ) from None
  try:
    yield tmp
    os.replace(tmp, out)
  except BaseException:
    shutil.rmtree(created or tmp, ignore_errors=True)
    raise


def import_hf(hf_dir: str, out: str, param_dtype: str = "float32") -> dict:
  """Write the Hugging Face checkpoint in ``hf_dir`` as a run directory at
  ``out``, its weights as ``param_dtype`` (float32 by default: the master
  weights a run trains, whatever the checkpoint stores; a bfloat16 copy
  halves the size of a run that only teaches or is evaluated); returns
  its summary."""
  if param_dtype not in ("float32", "bfloat16"):
    raise UserError(f"--param_dtype: {param_dtype!r} is not float32 or"
                    " bfloat16")
  config_path = os.path.join(hf_dir, "config.json")
  cfg = model_config(_read_json(config_path), config_path, param_dtype)
  tokenizer = tokenizer_lib.of_run(hf_dir)
  if not isinstance(tokenizer, tokenizer_lib.HFTokenizer):
    raise CheckpointError(f"{hf_dir}: no tokenizer.json, so the token ids"
                          " of the checkpoint are unknown")
  if not tokenizer.fits(cfg.vocab_size):
    raise CheckpointError(f"{hf_dir}: the tokenizer has"
                          f" {tokenizer.vocab_size} ids, the model only"
                          f" {cfg.vocab_size} embeddings")
  with contextlib.ExitStack() as stack, _output_dir(out) as tmp:
    tensors = Tensors(hf_dir, stack)
    if cfg.num_layers > len(tensors):  # before names() lists them all
      raise CheckpointError(f"{config_path}: num_hidden_layers ="
                            f" {cfg.num_layers}, but the checkpoint holds"
                            f" {len(tensors)} tensors")
    expected = set(hf.names(cfg))
    extra = sorted(set(tensors) - expected - {"lm_head.weight"}
                   if cfg.tie_embeddings else set(tensors) - expected)
    if extra:
      raise CheckpointError(f"{hf_dir}: tensor {extra[0]} is not part of a"
                            f" {len(expected)}-tensor {cfg.num_layers}-layer"
                            " model of this config")
    # Each leaf goes straight into its FSDP shard over every local device.
    mesh = parallel.make_mesh(data=1, fsdp=-1, tensor=1)
    shardings = dict(named_leaves(runs.param_shardings(cfg, mesh)))
    try:
      params = hf.from_hf(tensors, cfg, lambda path, leaf: jax.device_put(
          leaf, shardings[path]))
    except (KeyError, ValueError) as e:
      raise CheckpointError(f"{hf_dir}: {e.args[0]}") from None
    ckpt = checkpointing.Checkpointer(tmp, every=1, keep=1)
    try:
      ckpt.save(0, {"params": params}, force=True)
    finally:
      ckpt.close()
    tokenizer_lib.copy_files(tokenizer, tmp)
    fingerprint = tokenizer.fingerprint()
    with open(os.path.join(tmp, runs.CONFIG_FILE), "w",
              encoding="utf-8") as f:
      json.dump({"method": "import", "hf_dir": os.path.abspath(hf_dir),
                 "model": dataclasses.asdict(cfg), "tokenizer": fingerprint},
                f, indent=2, sort_keys=True)
    return training.write_summary(tmp, 0, params, hf_dir=hf_dir)


def is_hf_checkpoint(path: str) -> bool:
  """Whether ``path`` is a Hugging Face checkpoint directory (a
  ``config.json`` naming a ``model_type``) rather than a run directory."""
  try:
    fields = json_files.read_object(
        os.path.join(os.path.expanduser(path), "config.json"))
  except (FileNotFoundError, UserError):
    return False
  return "model_type" in fields and "model" not in fields


@contextlib.contextmanager
def as_run(path: str):
  """``path`` as a run directory: itself, or, for a Hugging Face
  checkpoint directory, the run ``import_hf`` makes of it in a temporary
  directory, removed afterwards (nothing is written into ``path``)."""
  if not is_hf_checkpoint(path):
    yield path
    return
  with tempfile.TemporaryDirectory(prefix="mopd_jax-import-") as tmp:
    run_dir = os.path.join(tmp, "run")
    import_hf(os.path.expanduser(path), run_dir)
    try:
      yield run_dir
    except UserError as e:  # name the user's files, not their copies
      raise type(e)(str(e).replace(run_dir, path)) from None


def export_run(run_dir: str, out: str, dtype: str = "") -> None:
  """Write the final parameters of the run in ``run_dir`` as a Hugging Face
  checkpoint at ``out``, in ``dtype`` (default: the run's parameter
  dtype; bfloat16 halves a float32 run's files)."""
  from safetensors.flax import save_file
  if dtype not in ("", "float32", "bfloat16"):
    raise UserError(f"--dtype: {dtype!r} is not float32 or bfloat16")
  cfg, params = runs.final_model(run_dir)
  tokenizer = tokenizer_lib.of_run(run_dir)
  runs.check_same_tokens(run_dir, runs.load_run_config(run_dir), tokenizer,
                         "--run")
  cfg = dataclasses.replace(cfg, param_dtype=dtype or cfg.param_dtype)
  with _output_dir(out) as tmp:
    tensors = {k: jnp.asarray(v, cfg.param_dtype)
               for k, v in hf.to_hf(jax.device_get(params), cfg).items()}
    save_file(tensors, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
      json.dump(hf.hf_config(cfg), f, indent=2)
    tokenizer_lib.export_files(tokenizer, tmp)


def define_flags() -> None:
  """The command's flags (defined when it runs, not when imported)."""
  flags.DEFINE_string("hf_dir", None, "import: a Hugging Face checkpoint"
                      " directory.")
  flags.DEFINE_string("run", None, "export: the run directory.")
  flags.DEFINE_string("out", None, "Where to write (must not exist).")
  flags.DEFINE_string("param_dtype", "float32", "import: the weights' dtype"
                      " in the run (float32: master weights to train).")
  flags.DEFINE_string("dtype", "", "export: the checkpoint's dtype"
                      " (default: the run's parameter dtype).")


def main(command: str) -> None:
  f = flags.FLAGS
  if command == "import":
    if not f.hf_dir or not f.out:
      raise UserError("import needs --hf_dir and --out")
    summary = import_hf(f.hf_dir, f.out, f.param_dtype)
    print(f"imported {f.hf_dir} -> {f.out}"
          f" (params sha256 {summary['params_sha256'][:12]})")
  else:
    if not f.run or not f.out:
      raise UserError("export needs --run and --out")
    export_run(f.run, f.out, f.dtype)
    print(f"exported {f.run} -> {f.out}")


if __name__ == "__main__":
  define_flags()
  cli.run(main, commands=("import", "export"))
