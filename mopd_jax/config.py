"""Every knob of every method, with its default, and the checks on them.

``defaults(method)`` is the single source of the fields a method accepts; the
files under ``configs/`` start from it and change what differs. ``validate``
rejects an unknown field, a wrong type or an impossible value with a
``ConfigError`` naming the dotted field, which the entry point prints as one
line (exit code 2).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Callable

import ml_collections

from mopd_jax.errors import ConfigError
from mopd_jax.models.config import ModelConfig
from mopd_jax.rollout.sampler import SamplingConfig

METHODS = ("pretrain",)


def _model() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))


def _sampling(**overrides) -> ml_collections.ConfigDict:
  fields = dataclasses.asdict(SamplingConfig())
  for special in ("eos_id", "pad_id"):  # taken from the tokenizer
    fields.pop(special)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def defaults(method: str) -> ml_collections.ConfigDict:
  """The complete default config of ``method``."""
  if method not in METHODS:
    raise ConfigError(f"method: unknown method {method!r}; known: "
                      + ", ".join(METHODS))
  c = ml_collections.ConfigDict()
  c.method = method
  c.seed = 0
  c.model = _model()
  c.data = ml_collections.ConfigDict(dict(
      domains=("add", "chain", "instruct", "sort", "reverse"),
      weights=(),  # empty: uniform over domains
      data_dir=os.path.join("~", ".cache", "mopd_jax", "tfds"),
      train_examples=20_000,
      test_examples=256,
      max_prompt_len=24,
  ))
  c.train = ml_collections.ConfigDict(dict(
      steps=1500, batch_size=32, log_every=25, eval_every=0))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, warmup_steps=100, end_lr_fraction=0.1,
      weight_decay=0.01, b1=0.9, b2=0.95, grad_clip=1.0))
  c.checkpoint = ml_collections.ConfigDict(dict(every=250, keep=2))
  c.sampling = _sampling()
  c.eval = ml_collections.ConfigDict(dict(
      num_prompts=256, batch_size=128, temperature=1.0, greedy=True))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  return c


def _positive(v):
  return v > 0


def _non_negative(v):
  return v >= 0


# (dotted field, predicate, what it must be)
_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("seed", _non_negative, ">= 0"),
    ("model.vocab_size", _positive, "> 0"),
    ("model.embed_dim", _positive, "> 0"),
    ("model.num_layers", _positive, "> 0"),
    ("model.num_heads", _positive, "> 0"),
    ("model.num_kv_heads", _positive, "> 0"),
    ("model.head_dim", lambda v: v > 0 and v % 2 == 0, "positive and even"),
    ("model.mlp_dim", _positive, "> 0"),
    ("model.rope_theta", _positive, "> 0"),
    ("model.dtype", lambda v: v in ("float32", "bfloat16"),
     "float32 or bfloat16"),
    ("model.param_dtype", lambda v: v in ("float32", "bfloat16"),
     "float32 or bfloat16"),
    ("data.domains", lambda v: len(v) > 0, "a non-empty tuple of domains"),
    ("data.weights", lambda v: all(w >= 0 for w in v) and (
        not v or sum(v) > 0), "empty or non-negative with a positive sum"),
    ("data.train_examples", _positive, "> 0"),
    ("data.test_examples", _positive, "> 0"),
    ("data.max_prompt_len", _positive, "> 0"),
    ("train.steps", _positive, "> 0"),
    ("train.batch_size", _positive, "> 0"),
    ("train.log_every", _positive, "> 0"),
    ("train.eval_every", _non_negative, ">= 0 (0: only at the end)"),
    ("optim.learning_rate", _positive, "> 0"),
    ("optim.warmup_steps", _non_negative, ">= 0"),
    ("optim.end_lr_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.weight_decay", _non_negative, ">= 0"),
    ("optim.b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.grad_clip", _non_negative, ">= 0 (0 disables)"),
    ("checkpoint.every", _positive, "> 0"),
    ("checkpoint.keep", _positive, "> 0"),
    ("sampling.max_new_tokens", _positive, "> 0"),
    ("sampling.temperature", _non_negative, ">= 0 (0: greedy)"),
    ("sampling.top_k", _non_negative, ">= 0 (0 disables)"),
    ("sampling.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.num_prompts", _positive, "> 0"),
    ("eval.batch_size", _positive, "> 0"),
    ("eval.temperature", _non_negative, ">= 0"),
)


def _type_ok(default, value) -> bool:
  if isinstance(default, bool) or isinstance(value, bool):
    return type(default) is type(value)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  if isinstance(default, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(default))


def _compare(schema, config, prefix: str) -> None:
  for key in config.keys():
    path = prefix + key
    if key not in schema:
      close = difflib.get_close_matches(key, list(schema.keys()), n=1)
      hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
      raise ConfigError(f"{path}: unknown field{hint}")
    default, value = schema[key], config[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: must be a section, got {value!r}")
      _compare(default, value, path + ".")
    elif not _type_ok(default, value):
      raise ConfigError(f"{path}: expected {type(default).__name__}, got"
                        f" {type(value).__name__} {value!r}")


def _get(config, path: str):
  for part in path.split("."):
    config = config[part]
  return config


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Check ``config`` against ``defaults(config.method)``; fill missing fields.

  Returns the complete config (defaults for any field the file left out).
  """
  if "method" not in config:
    raise ConfigError("method: missing; known: " + ", ".join(METHODS))
  schema = defaults(config.method)
  _compare(schema, config, "")
  full = schema
  full.update(config)
  for path, ok, what in _CHECKS:
    if path.split(".")[0] in full and not ok(_get(full, path)):
      raise ConfigError(f"{path}: must be {what}, got {_get(full, path)!r}")
  if full.model.num_heads % full.model.num_kv_heads:
    raise ConfigError("model.num_kv_heads: must divide model.num_heads"
                      f" ({full.model.num_heads}), got"
                      f" {full.model.num_kv_heads}")
  if full.data.weights and len(full.data.weights) != len(full.data.domains):
    raise ConfigError(
        f"data.weights: {len(full.data.weights)} weights for"
        f" {len(full.data.domains)} domains")
  return full


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict())


def sampling_config(section: ml_collections.ConfigDict, tokenizer,
                    **overrides) -> SamplingConfig:
  fields = dict(section.to_dict(), eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id)
  fields.update(overrides)
  return SamplingConfig(**fields)
