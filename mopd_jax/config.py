"""The config sections every method shares, and how a config is checked.

A method's own section, its checks and its variants live in its stage
module (``stages/<method>.py``); ``stages.defaults``, ``stages.validate`` and
``stages.recipe`` read them from the one table ``stages.METHODS``. Here: the
shared sections (model, data, sampling, eval, mesh; the training sections
train, optim, checkpoint and ops), each beside its checks, and the
mechanism: ``check(schema, config, checks, *cross)`` rejects an unknown
field, a wrong type or an impossible value with a ``ConfigError`` naming the
dotted field, which the entry point prints as one line (exit code 2).

A check table is ``((dotted field, predicate, what it must be), ...)``;
enumerations come from the modules that own them (``ATTENTION_IMPLS``,
``parallel.RULE_SETS``, ``vocab.IMPLS``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable

import ml_collections

from mopd_jax import parallel
from mopd_jax.data.domains import DOMAINS, EXTRA_DOMAINS, is_domain
from mopd_jax.errors import ConfigError, unknown_field
from mopd_jax.models.config import (ATTENTION_IMPLS, EXECUTION_FIELDS,
                                    ModelConfig)
from mopd_jax.ops import vocab
from mopd_jax.rollout.sampler import SamplingConfig

Checks = tuple[tuple[str, Callable[[Any], bool], str], ...]

ALL_DOMAINS = tuple(DOMAINS)
DOMAIN_NAMES = (", ".join((*ALL_DOMAINS, *EXTRA_DOMAINS))
                + " or <kind>:<path> (data/files.py)")
# The check of a tuple of domains (data.domains, eval.domains).
DOMAIN_TUPLE = (lambda v: len(v) > 0 and all(map(is_domain, v)),
                "a non-empty tuple of " + DOMAIN_NAMES)


def positive(v) -> bool:
  return v > 0


def non_negative(v) -> bool:
  return v >= 0


def is_fraction(v) -> bool:
  return 0 <= v <= 1


# --- model ---------------------------------------------------------------

def model(fields=None) -> ml_collections.ConfigDict:
  """``ModelConfig``'s defaults (only ``fields`` when given)."""
  values = dataclasses.asdict(ModelConfig())
  return ml_collections.ConfigDict(
      {k: v for k, v in values.items() if fields is None or k in fields})


_PRECISIONS = ("float32", "bfloat16")
MODEL_CHECKS: Checks = (
    ("model.vocab_size", positive, "> 0"),
    ("model.embed_dim", positive, "> 0"),
    ("model.num_layers", positive, "> 0"),
    ("model.num_heads", positive, "> 0"),
    ("model.num_kv_heads", positive, "> 0"),
    ("model.head_dim", lambda v: v > 0 and v % 2 == 0, "positive and even"),
    ("model.mlp_dim", positive, "> 0"),
    ("model.rope_theta", positive, "> 0"),
    ("model.dtype", lambda v: v in _PRECISIONS, " or ".join(_PRECISIONS)),
    ("model.param_dtype", lambda v: v in _PRECISIONS,
     " or ".join(_PRECISIONS)),
    ("model.attention_chunk", non_negative, ">= 0 (0: dense attention)"),
    ("model.attention_impl", lambda v: v in ATTENTION_IMPLS,
     " or ".join(ATTENTION_IMPLS)),
    ("model.max_positions", non_negative, ">= 0 (0: no stated bound)"),
)


def check_model(full) -> None:
  if "num_heads" in full.model and (
      full.model.num_heads % full.model.num_kv_heads):
    raise ConfigError("model.num_kv_heads: must divide model.num_heads"
                      f" ({full.model.num_heads}), got"
                      f" {full.model.num_kv_heads}")
  if full.model.attention_impl == "cudnn" and full.model.dtype != "bfloat16":
    raise ConfigError("model.attention_impl: cudnn needs model.dtype="
                      "bfloat16 (cuDNN's flash attention has no float32)")


# --- data ----------------------------------------------------------------

def data() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      data_dir=os.path.join("~", ".cache", "mopd_jax", "tfds"),
      train_examples=20_000,
      test_examples=256,  # of each held-out split: test and validation
      max_prompt_len=24,
      # A JSONL file of {"prompt", "answer", "domain"} lines to evaluate on
      # instead of the built-in test splits; empty: the built-in ones.
      eval_jsonl="",
  ))


DATA_CHECKS: Checks = (
    ("data.domains", *DOMAIN_TUPLE),
    ("data.weights", lambda v: all(w >= 0 for w in v) and (
        not v or sum(v) > 0), "empty or non-negative with a positive sum"),
    ("data.train_examples", positive, "> 0"),
    ("data.test_examples", lambda v: 0 < v <= 10_000,
     "in [1, 10000] (prompts per held-out split)"),
    ("data.max_prompt_len", positive, "> 0"),
)


def check_data(full) -> None:
  if full.data.get("weights") and len(full.data.weights) != len(
      full.data.domains):
    raise ConfigError(
        f"data.weights: {len(full.data.weights)} weights for"
        f" {len(full.data.domains)} domains")


# --- sampling and evaluation ---------------------------------------------

def sampling(**overrides) -> ml_collections.ConfigDict:
  fields = dataclasses.asdict(SamplingConfig())
  for special in ("stop_ids", "pad_id"):  # taken from the tokenizer
    fields.pop(special)
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


SAMPLING_CHECKS: Checks = (
    ("sampling.max_new_tokens", positive, "> 0"),
    ("sampling.temperature", non_negative, ">= 0 (0: greedy)"),
    ("sampling.top_k", non_negative, ">= 0 (0 disables)"),
    ("sampling.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
)


def evaluation() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      num_prompts=256, batch_size=128, temperature=1.0, greedy=True))


EVAL_CHECKS: Checks = (
    ("eval.num_prompts", positive, "> 0"),
    ("eval.batch_size", positive, "> 0"),
    ("eval.temperature", non_negative, ">= 0"),
    ("eval.domains", *DOMAIN_TUPLE),
)


# --- devices -------------------------------------------------------------

def mesh() -> ml_collections.ConfigDict:
  """Device mesh (one size may be -1: the rest of the devices), the
  logical-axis rule set (fsdp_tp | fsdp | dp, see mopd_jax/parallel.py) and
  how many devices a host without an accelerator is split into at the
  start of ``train`` (``parallel.use_cpu_devices``; 1 leaves the host as
  it is)."""
  return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1,
                                        rules="fsdp_tp", cpu_devices=1))


def distributed() -> ml_collections.ConfigDict:
  """Multi-host runs: jax.distributed.initialize when enabled (or when the
  JAX_COORDINATOR_ADDRESS environment variable is set); empty or negative
  fields are detected (TPU pods, SLURM) or read from JAX_NUM_PROCESSES and
  JAX_PROCESS_ID."""
  return ml_collections.ConfigDict(dict(
      enabled=False, coordinator_address="", num_processes=0, process_id=-1))


DEVICE_CHECKS: Checks = (
    ("mesh.cpu_devices", positive, "> 0"),
    ("mesh.rules", lambda v: v in parallel.RULE_SETS,
     " or ".join(parallel.RULE_SETS)),
    ("distributed.num_processes", non_negative, ">= 0 (0: detected)"),
)


# --- what every run has --------------------------------------------------

def common(method: str, init: bool) -> ml_collections.ConfigDict:
  """What every method that runs a model has: its name, the seed, the data,
  sampling and evaluation settings, the mesh; ``init``: it starts from an
  earlier run (whose architecture it takes) instead of building a
  ``model``, and ``model`` holds only how to compute it."""
  c = ml_collections.ConfigDict()
  c.method = method
  c.seed = 0
  if init:
    c.init = ""  # workdir of the run to start from (the base model)
    # How that run's architecture is computed here (bfloat16, remat,
    # blocked attention, the layer loop); the rest of ``model`` comes with
    # its weights.
    c.model = model(EXECUTION_FIELDS)
  else:
    c.model = model()
  c.data = data()
  c.sampling = sampling()
  c.eval = evaluation()
  c.mesh = mesh()
  c.distributed = distributed()
  return c


COMMON_CHECKS: Checks = (
    ("seed", lambda v: 0 <= v < 2**31, "in [0, 2^31)"),
    ("init", bool, "the workdir of the run to start from"),
    *MODEL_CHECKS, *DATA_CHECKS, *SAMPLING_CHECKS, *EVAL_CHECKS,
    *DEVICE_CHECKS,
)


def check_common(full) -> None:
  check_model(full)
  check_data(full)


# --- what every method that trains has -----------------------------------

def training(c: ml_collections.ConfigDict, steps: int, rl: bool) -> None:
  """The sections of a method that trains: the step loop, the optimiser,
  checkpoints and the fused vocabulary ops of its loss."""
  c.train = ml_collections.ConfigDict(dict(
      steps=steps, log_every=5 if rl else 25, eval_every=100 if rl else 0,
      # Steps in a row whose update was skipped (non-finite loss or
      # gradient) before the run stops with exit code 2.
      max_consecutive_skips=5))
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=2e-4 if rl else 3e-3, warmup_steps=5 if rl else 100,
      end_lr_fraction=1.0 if rl else 0.1,
      # 0: the decay spans the run after warm-up; N > 0: constant until the
      # last N steps (warmup-stable-decay; see training.learning_rate_schedule)
      decay_steps=0,
      weight_decay=0.0 if rl else 0.01,
      b1=0.9, b2=0.99 if rl else 0.95, grad_clip=1.0))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25 if rl else 250,
                                                keep=2))
  # The fused vocabulary ops of every loss: auto (Pallas on TPU, XLA
  # elsewhere) | xla | pallas; block_v: vocabulary tile (0: the op's default);
  # keep_logits_mib: logits a call keeps for its backward pass instead of
  # recomputing them (XLA only; 0: never; -1: the backend's default, 1024
  # on CPU, 0 on accelerators; see ops/vocab.py).
  c.ops = ml_collections.ConfigDict(dict(impl="auto", block_v=0,
                                         keep_logits_mib=-1))


TRAINING_CHECKS: Checks = (
    ("train.steps", positive, "> 0"),
    ("train.log_every", positive, "> 0"),
    ("train.eval_every", non_negative, ">= 0 (0: only at the end)"),
    ("train.max_consecutive_skips", positive, "> 0"),
    # float32 holds the rate: above its range it is inf on the device
    ("optim.learning_rate", lambda v: 0 < v < 3.4e38,
     "finite, > 0 and within float32"),
    ("optim.warmup_steps", non_negative, ">= 0"),
    ("optim.end_lr_fraction", is_fraction, "in [0, 1]"),
    ("optim.decay_steps", non_negative, ">= 0 (0: the whole run)"),
    ("optim.weight_decay", non_negative, ">= 0"),
    ("optim.b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.grad_clip", non_negative, ">= 0 (0 disables)"),
    ("checkpoint.every", positive, "> 0"),
    ("checkpoint.keep", positive, "> 0"),
    ("ops.impl", lambda v: v in vocab.IMPLS, ", ".join(vocab.IMPLS)),
    ("ops.block_v", non_negative, ">= 0 (0: the op's default)"),
    ("ops.keep_logits_mib", lambda v: v >= -1,
     ">= -1 (-1: the backend's default, 0: never)"),
)


# --- the variants every method shares ------------------------------------

def shrink_for_smoke(config: ml_collections.ConfigDict) -> None:
  """The sizes every ``:smoke`` variant shares: 4 steps, tiny data, a
  checkpoint every 2 steps and one evaluation, the last step's (seconds on
  a CPU, for tests; an evaluation at step 2 as well cost a 4-domain MOPD
  smoke run about 0.4 of its 10 s with no persistent cache, and the tests
  of periodic evaluation ask for it)."""
  config.data.update(train_examples=64, test_examples=16)
  config.train.update(steps=4, log_every=2, eval_every=4)
  config.checkpoint.update(every=2, keep=2)
  config.eval.update(num_prompts=8, batch_size=8)


def for_real_models(config: ml_collections.ConfigDict) -> None:
  """What every ``:hf`` variant shares: a Hugging Face checkpoint
  (imported with ``mopd_jax.convert``) on accelerators. bfloat16 matmuls
  over float32 master weights, per-layer remat and blocked attention (the
  memory plan's 7B rows), prompts of up to 512 tokens and completions of up
  to 1,024, parameters sharded over every device (FSDP), a learning rate
  of 1e-6 (a pretrained model's RL rate, not the tiny model's 2e-4) and
  train minibatches of 32 sequences (a rollout batch of 256 in 8; the
  memory plan's rows). The checkpoint and the data come from flags
  (``--config.init``, ``--config.base``, ``--config.data.domains``,
  ``--config.domain``)."""
  if "optim" in config:
    config.optim.learning_rate = 1e-6
  if "rl" in config:
    config.rl.minibatches = (config.rl.prompts_per_step
                             * config.rl.group_size) // 32
  if "model" in config:
    config.model.update(dtype="bfloat16", remat=True, attention_chunk=512)
  if "data" in config:
    config.data.max_prompt_len = 512
  if "sampling" in config:
    config.sampling.max_new_tokens = 1024
  config.mesh.update(data=1, fsdp=-1)
  if "batch_size" in config.eval:
    config.eval.update(num_prompts=256, batch_size=64)


# --- the mechanism -------------------------------------------------------

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
      raise ConfigError(unknown_field(prefix.split(".")[:-1], key,
                                      schema.keys()))
    default, value = schema[key], config[key]
    if isinstance(default, ml_collections.ConfigDict):
      if not isinstance(value, ml_collections.ConfigDict):
        raise ConfigError(f"{path}: must be a section, got {value!r}")
      _compare(default, value, path + ".")
    elif not _type_ok(default, value):
      raise ConfigError(f"{path}: expected {type(default).__name__}, got"
                        f" {type(value).__name__} {value!r}")


def _lookup(config, path: str):
  """The value at ``path``, or a marker when the config lacks it (a run
  started from ``init`` has no ``model.vocab_size`` to check)."""
  for part in path.split("."):
    if not isinstance(config, ml_collections.ConfigDict) or part not in config:
      return _MISSING
    config = config[part]
  return config


_MISSING = object()


def check(schema: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
          checks: Checks, cross: Iterable[Callable[[Any], None]] = ()
          ) -> ml_collections.ConfigDict:
  """``config`` against ``schema`` (a method's defaults): no unknown field,
  each value of its default's type, every check of ``checks`` whose field
  the config has, then the cross-field checks ``cross(full)``. Returns the
  complete config (the defaults of any field ``config`` left out)."""
  _compare(schema, config, "")
  full = schema
  full.update(config)
  for path, ok, what in checks:
    value = _lookup(full, path)
    if value is not _MISSING and not ok(value):
      raise ConfigError(f"{path}: must be {what}, got {value!r}")
  for fn in cross:
    fn(full)
  return full
