"""Teachers of on-policy distillation: one expert run per domain, checked
against the student's token ids at start-up; routing (``OracleRouter``:
every sample to the teacher of its domain; ``DeltaRouter``: every sample
to the delta teacher over all experts, ``delta_models``; ``TokenRouter``:
every token to the teacher a label-free rule picks from every teacher's
scores); and scoring
(``score``: each teacher runs one forward pass over only the samples
routed to it, one teacher at a time, its per-token log-probs, entropies
and hidden states scattered back into batch order; ``score_every``: every
teacher every row, one pass each or one ``vmap``-ped pass over their
stacked parameters, ``stack_teachers``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import parallel, runs
from mopd_jax.data import batching
from mopd_jax.errors import CheckpointError, ConfigError
from mopd_jax.models import decoder
from mopd_jax.models.config import ModelConfig, with_execution
from mopd_jax.ops import vocab
from mopd_jax.rollout import sampler


@dataclasses.dataclass(frozen=True)
class Model:
  """Parameters with the architecture that reads them."""
  cfg: ModelConfig
  params: Any


@dataclasses.dataclass(frozen=True)
class Teacher:
  domain: str
  run_dir: str
  model: Model
  init: Model | None  # the expert's own starting point (proxy, delta)
  init_dir: str = ""  # its run directory


def load_model(run_dir: str, tokenizer, mesh, execution: ModelConfig
               ) -> tuple[Model, Any]:
  """The final parameters of the run in ``run_dir``, computed as
  ``execution`` (the student's config) says (held in bfloat16 when it
  computes in bfloat16), and its run config; the run must share the
  student's token ids."""
  run_config = runs.load_run_config(run_dir)
  runs.check_same_tokens(run_dir, run_config, tokenizer, "teachers")
  cfg = with_execution(ModelConfig.of(run_config.model), execution)
  params = runs.load_params(run_dir, cfg, mesh)
  if cfg.dtype == "bfloat16" and cfg.param_dtype == "float32":
    # Frozen, so kept in the precision they compute in: half the memory.
    cfg = dataclasses.replace(cfg, param_dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  return Model(cfg, params), run_config


def load_teachers(dirs: dict[str, str], tokenizer, mesh, with_init: bool,
                  execution: ModelConfig) -> list[Teacher]:
  """One teacher per domain, computed as ``execution`` says; ``with_init``
  also loads each expert's own ``init`` run (needed by the proxy and the
  delta teachers)."""
  teachers = []
  for domain, run_dir in dirs.items():
    model, run_config = load_model(run_dir, tokenizer, mesh, execution)
    init = None
    if with_init:
      init_dir = run_config.get("init", "")
      if not init_dir or not os.path.isdir(os.path.expanduser(init_dir)):
        raise CheckpointError(f"teachers: {run_dir} names no readable init"
                              f" run ({init_dir!r}) for the proxy or"
                              " delta teacher")
      init = load_model(init_dir, tokenizer, mesh, execution)[0]
    teachers.append(Teacher(domain, run_dir, model, init,
                            run_config.get("init", "")))
  return teachers


def teacher_mesh(mesh, devices: int):
  """Where the teachers live: the student's ``mesh`` (``devices=0``) or a
  sub-mesh of its last ``devices`` devices, parameters sharded over them
  (``fsdp``) and scoring batches split across them."""
  if not devices:
    return mesh
  pool = list(mesh.devices.flat)
  if devices > len(pool):
    raise ConfigError(f"opd.teacher_devices: {devices} exceeds the"
                      f" {len(pool)} devices of the mesh")
  return parallel.make_mesh(data=1, fsdp=devices, tensor=1,
                            devices=pool[-devices:])


class Router(Protocol):
  """Assigns every sample (``per_token`` False: before scoring, so each
  teacher scores only its rows) or every token (``per_token`` True: from
  every teacher's scores of every token) to one teacher."""

  per_token: bool
  needs_align: bool  # reads ``align_kl``, the student's KL to each teacher

  def route(self, domain_ids: np.ndarray) -> np.ndarray:
    """[B] teacher indices from [B] domain indices (a token router has
    ``choose(every) -> [B, T]`` instead)."""


class OracleRouter:
  """Each sample is scored by the teacher of its own domain."""

  per_token = needs_align = False

  def __init__(self, domains, teachers: list[Teacher]):
    index = {t.domain: j for j, t in enumerate(teachers)}
    self._table = np.array([index[d] for d in domains], np.int32)

  def route(self, domain_ids: np.ndarray) -> np.ndarray:
    return self._table[np.asarray(domain_ids)]


class DeltaRouter:
  """Every sample is scored by the one delta teacher (``delta_models``)."""

  per_token = needs_align = False

  def __init__(self, domains, teachers: list[Teacher]):
    del domains, teachers

  def route(self, domain_ids: np.ndarray) -> np.ndarray:
    return np.zeros(np.shape(domain_ids), np.int32)


def lowest_entropy(every: dict) -> np.ndarray:
  """``j*_t = argmin_j H(T_j(. | x, y_<t))``: the most certain teacher."""
  return np.argmin(every["teacher_entropy"], axis=0).astype(np.int32)


def highest_novelty(every: dict) -> np.ndarray:
  """``j*_t = argmax_j log T_j(y_t) - log base(y_t)``: the teacher that
  learned the sampled token most over the shared base. The base term is
  the same for every ``j`` at a position, so this is ``argmax_j log
  T_j(y_t)`` and needs no base forward pass."""
  return np.argmax(every["teacher_logp"], axis=0).astype(np.int32)


def closest_to_student(every: dict) -> np.ndarray:
  """``j*_t = argmin_j KL(pi(. | x, y_<t) || T_j(. | x, y_<t))``, over the
  vocabulary under the rollout-time student: the teacher whose
  distribution agrees most with the student's (``align_kl`` [J, B, T])."""
  return np.argmin(every["align_kl"], axis=0).astype(np.int32)


class TokenRouter:
  """Label-free routing per token (MOPD-Router): every teacher scores every
  token, and a rule over those scores ([J, B, T] arrays) picks each token's
  teacher; the domain labels are not read."""

  per_token = True

  def __init__(self, rule, needs_align: bool = False):
    self.choose, self.needs_align = rule, needs_align


# a token router's name -> (its rule, whether it reads ``align_kl``)
TOKEN_RULES = {"entropy": (lowest_entropy, False),
               "novelty": (highest_novelty, False),
               "expert_align": (closest_to_student, True)}
TOKEN_ROUTERS = tuple(TOKEN_RULES)
ROUTERS = {"oracle": OracleRouter, "delta": DeltaRouter,
           **{name: (lambda domains, teachers, r=rule: TokenRouter(*r))
              for name, rule in TOKEN_RULES.items()}}


def pick(every: dict, choice: np.ndarray) -> dict:
  """Each token's chosen teacher's arrays from every teacher's ([J, B, T]
  or [J, B, T, D]; ``choice`` [B, T]): [B, T] (or [B, T, D])."""
  out = {}
  for key, value in every.items():
    index = choice[None].reshape(choice[None].shape + (1,) * (value.ndim - 3))
    out[key] = np.take_along_axis(value, index, axis=0)[0]
  return out


def confusion(choice: np.ndarray, mask: np.ndarray, seq_ids: np.ndarray,
              domains, teacher_names) -> dict:
  """``{route/<domain>/<teacher>: (tokens of the domain sent to the
  teacher, tokens of the domain)}``: the routing's confusion matrix
  against the oracle (each domain to its own teacher)."""
  mask = mask.astype(bool)
  token_domain = np.broadcast_to(seq_ids[:, None], mask.shape)[mask]
  token_teacher = choice[mask]
  counts = np.zeros((len(domains), len(teacher_names)))
  np.add.at(counts, (token_domain, token_teacher), 1.0)
  return {f"route/{d}/{t}": (counts[i, j], counts[i].sum())
          for i, d in enumerate(domains)
          for j, t in enumerate(teacher_names)}


def delta_models(teachers: list[Teacher], scale: float
                 ) -> tuple[tuple[Model, ...], tuple[float, ...]]:
  """The delta teacher over all experts, ``z = z_base + lambda sum_i
  (z_T_i - z_base) = (1 - n lambda) z_base + lambda sum_i z_T_i`` (every
  expert trained from the one base, its own ``init``): the models and
  their signs for ``make_scorer``."""
  inits = {os.path.realpath(os.path.expanduser(t.init_dir))
           for t in teachers}
  if len(inits) != 1:
    raise ConfigError("opd.router: the delta teacher needs experts trained"
                      " from one base; theirs start from "
                      + ", ".join(sorted(map(str, inits))))
  n = len(teachers)
  return ((teachers[0].init, *(t.model for t in teachers)),
          (1.0 - n * scale, *(scale,) * n))


def combined_unembedding(cfgs, params_list) -> jax.Array:
  """``[W_1; ...; W_n]`` [sum_i D_i, V] in float32: with the hidden states
  concatenated as ``[s_1 h_1, ..., s_n h_n]`` the logits are
  ``sum_i s_i h_i W_i`` (for the proxy teacher ``z_student_base + (z_expert -
  z_expert_init)``, signs ``(+1, +1, -1)``)."""
  return jnp.concatenate([decoder.output_weight(p, c).astype(jnp.float32)
                          for c, p in zip(cfgs, params_list)], axis=0)


@functools.lru_cache(maxsize=None)
def make_scorer(cfgs: tuple[ModelConfig, ...], signs: tuple[float, ...],
                want_entropy: bool, want_hidden: bool,
                ops: vocab.VocabOps = vocab.DEFAULT_OPS):
  """A jitted ``(params_list, prompt, prompt_mask, completion, mask) ->
  dict`` for a teacher made of models of architectures ``cfgs`` whose logits
  are ``sum_i sign_i z_i`` (one model for an expert, three for the proxy
  teacher): the log-prob of every sampled token (``teacher_logp``), and as
  asked its entropy and the concatenated hidden states that, with
  ``combined_unembedding``, give the full distribution later. ``ops``: the
  fused op's options. Teachers of one
  architecture share one compiled scorer."""

  @jax.jit
  def score(params_list, prompt, prompt_mask, completion, mask):
    h = jnp.concatenate([
        sign * sampler.completion_hidden(p, cfg, prompt, prompt_mask,
                                         completion, mask).astype(jnp.float32)
        for cfg, p, sign in zip(cfgs, params_list, signs)], axis=-1)
    w = combined_unembedding(cfgs, params_list)
    logp = vocab.token_logprobs(h, w, completion, mask=mask,
                                with_entropy=want_entropy, ops=ops)
    out = {}
    if want_entropy:
      out["teacher_logp"], out["teacher_entropy"] = logp
    else:
      out["teacher_logp"] = logp
    if want_hidden:
      out["teacher_hidden"] = h
    return out

  return score


def teacher_models(teacher: Teacher, student_init: Model | None
                   ) -> tuple[tuple[Model, ...], tuple[float, ...]]:
  """The models whose logits make ``teacher``'s, with their signs: the expert
  alone, or the proxy ``student_base + (expert - expert_init)``."""
  if student_init is None:
    return (teacher.model,), (1.0,)
  return (student_init, teacher.model, teacher.init), (1.0, 1.0, -1.0)


def padded_rows(rows: np.ndarray, mesh) -> np.ndarray:
  """``rows`` padded with copies of the first to a power of two of at
  least 8, and to a multiple of ``mesh``'s data-parallel size, so that few
  shapes compile."""
  data_parallel = parallel.data_parallel(mesh)
  padded = max(8, 1 << int(rows.size - 1).bit_length())
  padded = -(-padded // data_parallel) * data_parallel
  return np.concatenate([rows, np.full(padded - rows.size, rows[0])])


def sample_routed(student: Model, teachers: list[Teacher],
                  teacher_ids: np.ndarray, prompt, prompt_mask, key,
                  sampling, delta: float | None) -> sampler.Rollout:
  """Each teacher's rows (``teacher_ids``) sampled by that teacher alone
  (``delta`` None: teacher prefixes) or from ``sampler.trust_region_blend``
  of the student and it at ``delta`` (TRB), one pass per teacher over its
  rows (``padded_rows``), gathered back into batch order on the host."""
  prompt, prompt_mask = np.asarray(prompt), np.asarray(prompt_mask)
  batch, n = len(prompt), sampling.max_new_tokens
  out = sampler.Rollout(np.full((batch, n), sampling.pad_id, np.int32),
                        np.zeros((batch, n), np.float32),
                        np.zeros((batch, n), np.int32))
  mesh = jax.sharding.get_mesh()
  pending = []
  for j, teacher in enumerate(teachers):
    rows = np.flatnonzero(teacher_ids == j)
    if not rows.size:
      continue
    idx = padded_rows(rows, mesh)
    model = teacher.model
    args = (prompt[idx], prompt_mask[idx], jax.random.fold_in(key, j),
            sampling)
    # dispatched, not waited for, as in ``score``
    pending.append((rows, sampler.sample(model.params, model.cfg, *args)
                    if delta is None else
                    sampler.sample(student.params, student.cfg, *args,
                                   guide=(model.params, model.cfg, delta))))
  for rows, rollout in pending:
    for whole, part in zip(out, parallel.to_host(rollout)):
      whole[rows] = np.asarray(part)[:rows.size]
  return out


def _dispatch(scorers, params, rows_per_teacher, arrays: dict, mesh,
              cut_columns: bool) -> list:
  """``(j, rows, result)``: teacher ``j`` scores the rows
  ``rows_per_teacher[j]`` (padded, ``padded_rows``), every pass dispatched
  before any result is read (the next teacher's batch is prepared while
  this one scores). With ``cut_columns``, only on the completion columns
  they reach (``batching.bucket_width``: a concise domain's teacher does
  not score a long one's padding; attention is causal, so the cut changes
  the scores only by float rounding: a shorter key axis sums in another
  order); without, on the columns the student's loss reads, so that a
  teacher equal to the student gives its log-probs bit for bit."""
  pending = []
  width = arrays["mask"].shape[1]
  for j, (scorer, p, rows) in enumerate(zip(scorers, params,
                                            rows_per_teacher)):
    if not rows.size:
      continue
    idx = padded_rows(rows, mesh)
    cut = (batching.bucket_width(int(arrays["mask"][rows].sum(1).max()),
                                 width) if cut_columns else width)
    with parallel.activate(mesh):
      batch_in = parallel.shard_batch(mesh, dict(
          prompt=arrays["prompt"][idx], prompt_mask=arrays["prompt_mask"][idx],
          completion=arrays["completion"][idx, :cut],
          mask=arrays["mask"][idx, :cut]))
      pending.append((j, rows, scorer(p, **batch_in)))
  return pending


def _gather(pending, shape, hidden_width: int, teachers: int | None
            ) -> dict:
  """The results of ``_dispatch`` as float32 [B, T] arrays, each row its
  own teacher's (``teachers`` J: [J, B, T], teacher ``j``'s at ``[j]``),
  zero past the columns a teacher scored, and ``teacher_hidden`` with a
  last axis of ``hidden_width``, zero-padded."""
  lead = (teachers,) if teachers else ()
  out: dict = {}
  for j, rows, result in pending:
    at = (j, rows) if teachers else (rows,)
    for key, value in parallel.to_host(result).items():
      value = np.asarray(value)[:rows.size]
      if key not in out:
        tail = (hidden_width,) if value.ndim == 3 else ()
        out[key] = np.zeros(lead + shape + tail, np.float32)
      cut = (slice(0, value.shape[1]),)
      if value.ndim == 3:
        cut += (slice(0, value.shape[-1]),)
      out[key][at + cut] = value
  return out


def score(scorers, params, teacher_ids: np.ndarray, arrays: dict, mesh,
          hidden_width: int = 0, cut_columns: bool = False) -> dict:
  """Route, score and gather back: for each teacher ``j``, one forward pass
  over exactly the rows with ``teacher_ids == j`` (padded to a power of two
  of at least 8, and to the data-parallel size, so that few shapes
  compile); every teacher's pass is dispatched before the first result is
  moved to host; ``cut_columns`` as in ``_dispatch``. Returns [B, T]
  arrays (and ``teacher_hidden`` [B, T, hidden_width], zero-padded in the
  last axis)."""
  pending = _dispatch(scorers, params, [np.flatnonzero(teacher_ids == j)
                                       for j in range(len(scorers))],
                      arrays, mesh, cut_columns)
  return _gather(pending, arrays["completion"].shape, hidden_width, None)


def room_to_stack(params) -> bool:
  """Whether stacking the teachers' ``params`` is worth it and fits: on
  an accelerator (on the CPU one pass at a time already fills the cores)
  whose every device has free memory for its share of a second copy of
  them (the stack is built before the separate copies are dropped). The
  one pass also holds every teacher's activations at once; where those
  do not fit, ``opd.teacher_vmap=off``."""
  leaves = jax.tree.leaves(params)
  if not leaves or jax.default_backend() == "cpu":
    return False
  need: dict = {}
  for leaf in leaves:
    for shard in leaf.addressable_shards:
      need[shard.device] = need.get(shard.device, 0) + shard.data.nbytes
  for device, extra in need.items():
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats or (
        stats["bytes_limit"] - stats.get("bytes_in_use", 0) < extra):
      return False
  return True


def stack_teachers(scorers, params) -> tuple | None:
  """``(scorer, params)``: one scorer ``vmap``-ped over a leading teacher
  axis and every teacher's parameters stacked on that axis (each leaf's
  sharding kept for the rest of its axes), so that every teacher scores
  every token in one pass; None unless every teacher is of one
  architecture (one compiled scorer: ``make_scorer`` is cached)."""
  if len(set(scorers)) != 1:
    return None
  scorer = scorers[0]

  def stacked_sharding(leaf):
    sharding = leaf.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
      return None
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec))

  stacked = jax.jit(lambda *ps: jax.tree.map(lambda *xs: jnp.stack(xs), *ps),
                    out_shardings=jax.tree.map(stacked_sharding, params[0])
                    )(*params)

  @jax.jit
  def every(stacked_params, prompt, prompt_mask, completion, mask):
    return jax.vmap(lambda p: scorer(p, prompt, prompt_mask, completion,
                                     mask))(stacked_params)

  return every, stacked


def score_every(scorers, params, arrays: dict, mesh, hidden_width: int = 0,
                stacked: tuple | None = None, cut_columns: bool = False
                ) -> dict:
  """Every teacher scores every row (a token router's input): [J, B, T]
  arrays (and ``teacher_hidden`` [J, B, T, hidden_width]); one pass per
  teacher, every pass dispatched before the first is read, or with
  ``stacked`` (``stack_teachers``) one pass over all of them;
  ``cut_columns`` as in ``_dispatch``."""
  rows = np.arange(len(arrays["completion"]))
  if stacked is None:
    pending = _dispatch(scorers, params, [rows] * len(scorers), arrays, mesh,
                        cut_columns)
  else:
    scorer, stacked_params = stacked
    (_, _, result), = _dispatch([scorer], [stacked_params], [rows], arrays,
                                mesh, cut_columns)
    result = parallel.to_host(result)
    pending = [(j, rows, {k: np.asarray(v)[j] for k, v in result.items()})
               for j in range(len(scorers))]
  return _gather(pending, arrays["completion"].shape, hidden_width,
                 len(scorers))
