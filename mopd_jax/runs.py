"""Run directories and what every run sets up: the files a run leaves
(``config.json``, ``eval.json``, checkpoints), the checks that let a later
run start from, resume, or read an earlier one, and parameter loading.

Below the stages: stages, fusion and evaluation code read runs through
this module, never through a stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Sequence

import jax
import ml_collections

from mopd_jax import checkpointing, checksum, json_files, parallel
from mopd_jax.atomic import write_json_atomic
from mopd_jax.data import files
from mopd_jax.training import SUMMARY_FILE
from mopd_jax.errors import CheckpointError, ConfigError
from mopd_jax.models import decoder
from mopd_jax.models.config import EXECUTION_FIELDS, ModelConfig
from mopd_jax.models import tokenizer as tokenizer_lib

CONFIG_FILE = "config.json"

EVAL_FILE = "eval.json"


def save_run_config(config, workdir: str) -> None:
  """``<workdir>/config.json``: how the run was configured (model included)
  and the fingerprint of its tokenizer, read back by later stages that start
  from this run or use it as a teacher; a Hugging Face tokenizer's files
  are copied beside it, so the run carries its tokenizer."""
  tokenizer = tokenizer_lib.for_config(config)
  tokenizer_lib.copy_files(tokenizer, workdir)
  write_json_atomic(
      os.path.join(workdir, CONFIG_FILE),
      dict(config.to_dict(), tokenizer=tokenizer.fingerprint()))


def _read_json_object(path: str, run_dir: str = "") -> dict:
  try:
    return json_files.read_object(path, CheckpointError)
  except FileNotFoundError:
    raise CheckpointError(f"{run_dir or path}: not a mopd_jax run directory"
                          f" (no {CONFIG_FILE})") from None


def load_run_config(run_dir: str) -> ml_collections.ConfigDict:
  path = os.path.join(os.path.abspath(os.path.expanduser(run_dir)),
                      CONFIG_FILE)
  saved = _read_json_object(path, run_dir)
  if not isinstance(saved.get("model"), dict):
    raise CheckpointError(f"{path}: not a run config (no model section)")
  unknown = sorted(set(saved["model"]) - {
      f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise CheckpointError(f"{path}: model.{unknown[0]}: unknown field")
  for field in dataclasses.fields(ModelConfig):
    if field.name in saved["model"] and not is_a(saved["model"][field.name],
                                                   field.type):
      raise CheckpointError(
          f"{path}: model.{field.name}: expected {field.type}, got"
          f" {saved['model'][field.name]!r}")
  return ml_collections.ConfigDict(saved)


def model_fields(section: dict) -> dict:
  """A run's ``model`` section (a plain dict, unchecked) with every
  ``ModelConfig`` field, those it lacks (written by a version before the
  field existed) at their defaults, as ``ModelConfig.of`` reads it: the
  two runs' sections compare field by field."""
  return {**dataclasses.asdict(ModelConfig()), **section}


def is_a(value, kind: str) -> bool:
  """Whether a JSON ``value`` fits a field annotated ``kind`` (``int``,
  ``float``, ``bool``, ``str``; an int is a float, a bool is no number):
  the run configs' model sections and Hugging Face ``config.json``."""
  if isinstance(value, bool):
    return kind == "bool"
  return {"int": isinstance(value, int),
          "float": isinstance(value, (int, float)),
          "str": isinstance(value, str)}.get(kind, False)


def check_same_tokens(run_dir: str, run_config, tokenizer, field: str) -> None:
  """The run in ``run_dir`` (its ``run_config``) must share ``tokenizer``'s
  token ids: the same vocabulary size and the same tokenizer fingerprint
  (a run that recorded none cannot be checked, and is refused). ``field``
  names the config field that points to the run."""
  vocab = run_config.model.get("vocab_size")
  if not isinstance(vocab, int) or not tokenizer.fits(vocab):
    raise CheckpointError(
        f"{field}: {run_dir} has a vocabulary of {vocab} tokens, this run's"
        f" tokenizer {tokenizer.vocab_size}")
  recorded = run_config.get("tokenizer", "")
  if not recorded:
    raise CheckpointError(
        f"{field}: {run_dir} records no tokenizer in its {CONFIG_FILE}, so"
        " its token ids cannot be checked (if it was trained with this"
        f' tokenizer, add "tokenizer": "{tokenizer.fingerprint()}" there)')
  if recorded != tokenizer.fingerprint():
    raise CheckpointError(f"{field}: {run_dir} was trained with another"
                          f" tokenizer ({recorded} != "
                          f"{tokenizer.fingerprint()})")


def check_same_vocabulary(run_dir: str, run_config, vocab_size: int,
                          field: str) -> None:
  """The run in ``run_dir`` has ``vocab_size`` embeddings, as the run it is
  compared with token by token (a teacher of a student, a model of the
  scored lines)."""
  if run_config.model.get("vocab_size") != vocab_size:
    raise CheckpointError(
        f"{field}: {run_dir} has {run_config.model.get('vocab_size')}"
        f" embeddings, this run {vocab_size}; their distributions cannot be"
        " compared token by token")


def resolve_model(config) -> None:
  """Give a stage that starts from ``config.init`` that run's architecture
  (the ``model`` section comes with the weights), so its own config.json
  names the model too; how it is computed (``EXECUTION_FIELDS``: bfloat16,
  remat, blocked attention, the attention kernel, the layer loop) stays
  this run's choice.
  The run must share this run's token ids."""
  if "init" in config and config.init:
    run_config = load_run_config(config.init)
    check_same_tokens(config.init, run_config,
                      tokenizer_lib.of_run(config.init), "init")
    config.model = with_execution_fields(run_config.model, config.model)


def with_execution_fields(model, like):
  """The ``model`` config section with ``like``'s ``EXECUTION_FIELDS``
  (the section form of ``models.config.with_execution``)."""
  model.update({key: like[key] for key in EXECUTION_FIELDS})
  return model


def check_resumable(config, workdir: str) -> None:
  """A workdir that holds checkpoints resumes only a run of the same method,
  model and tokenizer; anything else is a ``CheckpointError`` naming the
  first difference, raised before config.json or a checkpoint is touched."""
  ckpt = os.path.join(workdir, "ckpt")
  # A study keeps no checkpoints: its state is the runs of its steps, made
  # under the settings its config.json records.
  started = (os.path.isdir(ckpt) and os.listdir(ckpt)) or (
      config.method == "study"
      and os.path.exists(os.path.join(workdir, CONFIG_FILE)))
  if not started:
    return
  if not os.path.exists(os.path.join(workdir, CONFIG_FILE)):
    # config.json comes before any checkpoint: these are not a run of ours.
    raise CheckpointError(
        f"{workdir} holds checkpoints but no {CONFIG_FILE}, so they cannot"
        " be checked against this run; use a new workdir")
  saved = (load_run_config(workdir).to_dict() if config.method != "study"
           else _read_json_object(os.path.join(workdir, CONFIG_FILE)))
  # Compared as JSON, the form config.json holds (tuples become lists).
  ours = json.loads(json.dumps(
      dict(config.to_dict(),
           tokenizer=tokenizer_lib.for_config(config).fingerprint())))
  for run in (saved, ours):
    if isinstance(run.get("model"), dict):
      run["model"] = model_fields(run["model"])
      for key in EXECUTION_FIELDS:
        run["model"].pop(key)
  for key in ("method", "model", "tokenizer"):
    found = key in saved and _first_difference(saved[key], ours.get(key),
                                               key)
    if found:
      field, theirs, mine = found
      raise CheckpointError(
          f"{field}: {workdir} holds checkpoints of a run with {theirs!r},"
          f" this run has {mine!r}; resume with the same setting or use a new"
          " workdir")
  # Every other setting too (a resumed run with other hyperparameters would
  # leave a config.json describing a run that never happened), but for the
  # ones that may change on resume; fields one side lacks (added or dropped
  # by another version) are not compared.
  theirs, mine = _flat(saved), _flat(ours)
  changed = [k for k in sorted(set(theirs) & set(mine))
             if theirs[k] != mine[k] and not k.startswith(RESUMABLE_CHANGES)]
  if changed:
    raise CheckpointError(
        f"{workdir} holds a run configured otherwise: "
        + ", ".join(f"{k} ({theirs[k]!r} -> {mine[k]!r})"
                    for k in changed[:3])
        + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        + "; resume with the same settings or use a new workdir")


# Settings a resumed run may change: how long it runs, how often it logs,
# evaluates and checkpoints, where its data and devices are.
# A study's ``steps`` (which of its steps to run) and ``seeds`` (each seed
# its own sub-study) may change too.
RESUMABLE_CHANGES = ("train.steps", "train.log_every", "train.eval_every",
                     "train.max_consecutive_skips", "checkpoint.",
                     "eval.batch_size", "data.data_dir", "mesh.",
                     "distributed.", "ops.", "steps", "seeds",
                     "seed_processes")


def _flat(tree, prefix: str = "") -> dict:
  """``{"a.b": leaf}`` of a nested dict."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def _first_difference(theirs, mine, field: str):
  """``(dotted field, their value, my value)`` where two JSON values first
  differ (nested dicts key by key), or None."""
  if isinstance(theirs, dict) and isinstance(mine, dict):
    for key in sorted(set(theirs) | set(mine)):
      found = _first_difference(theirs.get(key), mine.get(key),
                                f"{field}.{key}")
      if found:
        return found
    return None
  return None if theirs == mine else (field, theirs, mine)


def setup(config, tokenizer=None):
  """``(tokenizer, model_cfg, mesh)`` for ``config``, checked together; the
  tokenizer is ``config``'s (its init run's) unless given."""
  tokenizer = tokenizer or tokenizer_lib.for_config(config)
  model_cfg = ModelConfig.of(config.model)
  if not tokenizer.fits(model_cfg.vocab_size):
    raise ConfigError(f"model.vocab_size: {model_cfg.vocab_size} does not"
                      f" fit the tokenizer's {tokenizer.vocab_size} ids")
  if model_cfg.max_positions and "data" in config and "sampling" in config:
    length = config.data.max_prompt_len + config.sampling.max_new_tokens
    if length > model_cfg.max_positions:
      raise ConfigError(
          f"data.max_prompt_len + sampling.max_new_tokens: {length}"
          " positions, more than the model's max_position_embeddings"
          f" {model_cfg.max_positions}")
  mesh = parallel.make_mesh(config.mesh.data, config.mesh.fsdp,
                            config.mesh.tensor, rules=config.mesh.get("rules"))
  count = config.mesh.get("cpu_devices", 1)
  if (count > 1 and jax.default_backend() == "cpu"
      and jax.device_count() != count):
    raise ConfigError(f"mesh.cpu_devices: {count} takes effect when a"
                      " process starts (python -m mopd_jax.train or"
                      f" evaluate); this one has {jax.device_count()}")
  return tokenizer, model_cfg, mesh


def check_divisible(mesh, batch: int, field: str) -> None:
  data_parallel = parallel.data_parallel(mesh)
  if batch % data_parallel:
    raise ConfigError(f"{field}: a batch of {batch} sequences is not a"
                      f" multiple of the {data_parallel} data-parallel devices")


def param_shapes(model_cfg):
  """``ShapeDtypeStruct``s of the parameters (nothing allocated)."""
  return jax.eval_shape(
      lambda: decoder.init_params(model_cfg, jax.random.key(0)))


def param_shardings(model_cfg, mesh):
  """NamedShardings of every parameter, from its logical axes and the rules
  in scope (``parallel.use_rules``)."""
  return parallel.logical_sharding(mesh, decoder.logical_axes(model_cfg),
                                   param_shapes(model_cfg))


def init_params(model_cfg, mesh, seed: int):
  """Random parameters, created already sharded over ``mesh``."""
  init = jax.jit(decoder.init_params, static_argnums=0,
                 out_shardings=param_shardings(model_cfg, mesh))
  with parallel.activate(mesh):
    return init(model_cfg, jax.random.key(seed))


def load_params(run_dir: str, model_cfg, mesh):
  """The final parameters of an earlier run, sharded over ``mesh``; a run
  that has not finished (no summary.json) gives its newest checkpoint,
  with a warning line naming the step."""
  like = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                         sharding=sh),
                      param_shapes(model_cfg),
                      param_shardings(model_cfg, mesh))
  params = checkpointing.load_params(run_dir, like)
  _warn_unfinished(run_dir)
  check_finite(run_dir, params)
  return params


def _warn_unfinished(run_dir: str) -> None:
  if not finished(run_dir):
    print(f"warning: {run_dir} has not finished (no {SUMMARY_FILE}); using"
          f" its newest checkpoint, step {checkpointing.newest_step(run_dir)}",
          file=sys.stderr)


def check_finite(run_dir: str, params) -> None:
  """A ``CheckpointError`` naming the first parameter of the run in
  ``run_dir`` that holds NaN or inf (a diverged or poisoned run, whose
  checksum is valid): it would spread into every run built from it."""
  named = checksum.named_leaves(params)
  finite = jax.device_get(_all_finite([leaf for _, leaf in named]))
  for (name, _), ok in zip(named, finite):
    if not ok:
      raise CheckpointError(f"{run_dir}: parameter {name} holds NaN or inf")


@jax.jit
def _all_finite(leaves):
  """Per leaf, whether every element is finite: one program for a whole
  model (a check per leaf compiled one per shape, 16 for the smoke
  model)."""
  return [jax.numpy.isfinite(leaf).all() for leaf in leaves]


def final_model(run_dir: str, mesh=None):
  """``(model_cfg, params)``: a run's architecture and final parameters,
  sharded over ``mesh`` (one device when None: the tools that read a run
  outside training)."""
  cfg = ModelConfig.of(load_run_config(run_dir).model)
  mesh = mesh or parallel.make_mesh(data=1, fsdp=1, tensor=1,
                                    devices=jax.devices()[:1])
  return cfg, load_params(run_dir, cfg, mesh)


def finished(run_dir: str) -> bool:
  """Whether the run in ``run_dir`` ended (its summary is written last)."""
  return os.path.exists(os.path.join(os.path.expanduser(run_dir),
                                     SUMMARY_FILE))


def check_same_model(run_dir: str, run_config, model_cfg, field: str) -> None:
  """The run in ``run_dir`` must have ``model_cfg``'s architecture (its
  parameters are combined entry by entry with this run's)."""
  theirs = model_fields(run_config.model.to_dict())
  for key, mine in dataclasses.asdict(model_cfg).items():
    if key not in EXECUTION_FIELDS and theirs.get(key) != mine:
      raise CheckpointError(f"{field}: {run_dir} has model.{key} ="
                            f" {theirs.get(key)!r}, the base {mine!r}")


class LeafLoader:
  """``loader(name) -> [leaf of each run]``: one parameter leaf
  (``layers/q``) of each run's final checkpoint, read only when asked for,
  sharded as the parameter is on ``mesh``; each checkpoint opened once
  (``checkpointing.ParamReader``) until ``close`` (or the ``with`` block's
  end)."""

  def __init__(self, run_dirs: Sequence[str], model_cfg, mesh):
    self._like = dict(checksum.named_leaves(jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        param_shapes(model_cfg), param_shardings(model_cfg, mesh))))
    for run_dir in run_dirs:
      _warn_unfinished(run_dir)
    self._readers = []
    try:
      for run_dir in run_dirs:
        self._readers.append(checkpointing.ParamReader(run_dir))
    except BaseException:
      self.close()
      raise

  def __call__(self, name: str) -> list:
    subtree = self._like[name]
    for part in reversed(name.split("/")):
      subtree = {part: subtree}
    out = []
    for reader in self._readers:
      tree = reader.read(subtree)
      check_finite(reader.run_dir, tree)
      out.append(dict(checksum.named_leaves(tree))[name])
    return out

  def close(self) -> None:
    for reader in self._readers:
      reader.close()

  def __enter__(self) -> "LeafLoader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


@contextlib.contextmanager
def locked(workdir: str):
  """Hold ``<workdir>/.lock`` (an OS file lock, released when the process
  ends, even killed) while the body writes the workdir; a second writer is
  a ``CheckpointError`` naming the holder's PID. One lock per process of a
  multi-host run, whose hosts share the workdir."""
  import fcntl
  path = os.path.join(workdir, f".lock.{jax.process_index()}")
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # unbuffered
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
    os.close(fd)
    raise CheckpointError(f"{workdir} is being written by process"
                          f" {holder or '(unknown)'}; wait for it to end or"
                          " use another workdir") from None
  try:
    _rewrite(fd, str(os.getpid()))
    yield
  finally:
    # Emptied before it is released: a run refused after taking the lock
    # leaves the workdir as it found it.
    _rewrite(fd, "")
    os.close(fd)


def _rewrite(fd: int, text: str) -> None:
  """The lock file's text (the holder's PID): best effort, since the lock
  itself needs no space and a full disk is reported by the first real
  write."""
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
  except OSError:
    pass


def write_eval(workdir: str, step: int):
  """An ``on_final`` callback writing ``<workdir>/eval.json`` atomically."""
  def write(scalars):
    write_json_atomic(os.path.join(workdir, EVAL_FILE),
                               {"step": step, **scalars})
  return write


def runs_by_domain(spec: str, domains, field: str = "teachers"
                   ) -> dict[str, str]:
  """``{domain: run directory}`` from ``teachers`` (or Merge's ``experts``,
  named by ``field``): a template with ``{domain}``
  (``runs/expert_{domain}``; a file domain fills in ``files.label``'s
  ``<kind>_<file stem>``) or ``domain=dir`` pairs separated by commas.
  Every domain needs a run (oracle routing, one task vector each)."""
  if "{domain}" in spec:
    dirs = {d: spec.replace("{domain}", files.label(d)) for d in domains}
  else:
    dirs = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
      domain, sep, path = item.partition("=")
      if not sep or not path:
        raise ConfigError(f"{field}: {item!r} is not domain=run_dir (or use"
                          " a template with {domain})")
      dirs[domain.strip()] = path.strip()
  for d in domains:
    if d not in dirs:
      raise ConfigError(f"{field}: no run for domain {d!r}")
  unknown = sorted(set(dirs) - set(domains))
  if unknown:
    raise ConfigError(f"{field}: {unknown[0]!r} is not one of the domains"
                      f" {', '.join(domains)}")
  return {d: dirs[d] for d in domains}


def is_run_list(spec: str) -> bool:
  """Whether Merge's ``experts`` is a plain comma-separated list of runs
  (no ``{domain}`` template, no ``domain=dir`` pairs): a merge of runs
  that need no data."""
  return "{domain}" not in spec and "=" not in spec and bool(spec.strip())


def run_list(spec: str) -> dict[str, str]:
  """``{name: run directory}`` of a plain list of runs, each named by its
  folder's name (``expert_2`` where two share one)."""
  dirs = [s.strip() for s in spec.split(",") if s.strip()]
  names = [os.path.basename(os.path.normpath(d)) or "expert" for d in dirs]
  return {(n if names.count(n) == 1 else f"{n}_{i}"): d
          for i, (n, d) in enumerate(zip(names, dirs))}
