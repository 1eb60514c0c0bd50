"""Merge: expert models combined into one through their task vectors, with
no training (the parameterisation and defaults of mergekit).

Every method here is a pure function of one tensor: the base's ``b``
[...], the experts' ``x`` [E, ...] and the per-tensor ``Settings``; task
vectors are ``tau_d = x_d - b``. A stacked leaf (the decoder's ``layers/*``,
one slice per layer) is merged slice by slice, as mergekit merges each
layer's tensor on its own: top-k, norms and cosines are per layer.
``merge_params`` walks the parameter tree leaf by leaf, jitted per shape.

Where mergekit draws random masks (DARE) the masks here come from
``jax.random`` and the ``seed``: the same command gives the same model,
but not mergekit's draw.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.checksum import named_leaves
from mopd_jax.errors import ConfigError

# mergekit's generalised task arithmetic: (sparsification, sign consensus,
# normalise by default, rescale DARE's survivors by 1/density by default)
_GTA = {
    "task_arithmetic": (None, False, False),
    "ties": ("magnitude", True, True),
    "dare_linear": ("random", False, False),
    "dare_ties": ("random", True, False),
    "breadcrumbs": ("band", False, False),
    "breadcrumbs_ties": ("band", True, False),
}
METHODS = ("linear", *_GTA, "model_stock", "slerp", "karcher",
           "sparse_union")
# The methods that scale the mixed task vector by lambda, and those that
# sparsify the task vectors to a density (what a sweep can tune).
SCALED = (*_GTA, "sparse_union")
SPARSIFIED = tuple(m for m, (how, _, _) in _GTA.items() if how)
NORMALIZE = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class Parameter:
  """A numeric merge parameter, declared once: its mergekit name (the
  config field ``merge.<name>`` and the key of a name-pattern override),
  default, valid values (``valid``, described by ``must_be``) and what it
  does. Every one can be set per tensor by ``merge.overrides``."""
  name: str
  default: float
  valid: Callable[[float], bool]
  must_be: str
  help: str


PARAMETERS = {p.name: p for p in (
    Parameter("lambda", 1.0, math.isfinite, "a finite number",
              "factor on the mixed task vector"),
    Parameter("density", 1.0, lambda v: 0 < v <= 1, "in (0, 1]",
              "fraction of each task vector kept (sparsifying methods)"),
    Parameter("gamma", 0.01, lambda v: 0 <= v < 1, "in [0, 1)",
              "breadcrumbs: fraction of the largest entries dropped"),
    Parameter("t", 0.5, lambda v: 0 <= v <= 1, "in [0, 1]",
              "slerp: from the first expert (0) to the second (1)"),
    Parameter("tolerance", 0.0, lambda v: v >= 0, ">= 0",
              "sparse_union: |tau| above it counts as changed"),
)}


def check_parameter(name: str, value: float, where: str) -> None:
  """A ``ConfigError`` naming ``where`` unless ``value`` is valid for
  ``PARAMETERS[name]``."""
  p = PARAMETERS[name]
  if not p.valid(value):
    raise ConfigError(f"{where}: {name}={value!r} must be {p.must_be}")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The merge of one tensor. ``weights``: one per expert; ``density``:
  the fraction of each task vector kept (sparsifying methods); ``gamma``:
  breadcrumbs' fraction of largest entries dropped; ``lam``: the factor on
  the mixed task vector; ``t``: SLERP's position from the first expert to
  the second; ``tolerance``: below it an entry counts as unchanged
  (sparse_union); ``normalize``: divide the mixed task vector by the
  weights that contributed (None: the method's mergekit default);
  ``rescale``: DARE's survivors divided by ``density``."""
  method: str
  weights: tuple[float, ...]
  density: float = PARAMETERS["density"].default
  gamma: float = PARAMETERS["gamma"].default
  lam: float = PARAMETERS["lambda"].default
  t: float = PARAMETERS["t"].default
  tolerance: float = PARAMETERS["tolerance"].default
  normalize: bool | None = None
  rescale: bool = True


# ---------------------------------------------------------------- masks


def magnitude_mask(tau: jax.Array, density: float) -> jax.Array:
  """1 on the ``k = max(1, floor(density * n))`` entries of largest
  ``|tau|`` (TIES's trim; a positive density keeps at least one entry, as
  in mergekit); all ones when ``density >= 1``."""
  n, k = tau.size, max(1, int(density * tau.size))
  if density >= 1:
    return jnp.ones(tau.shape, bool)
  _, idx = jax.lax.top_k(jnp.abs(tau).reshape(-1), k)
  return jnp.zeros(n, bool).at[idx].set(True).reshape(tau.shape)


def band_mask(tau: jax.Array, density: float, gamma: float) -> jax.Array:
  """Model Breadcrumbs: with entries sorted by ``|tau|``, drop the top
  ``n_top = floor(gamma n)`` and the bottom ``n_bot = n - floor(density n)
  - n_top`` (when ``n_bot < 0``, fewer from the top: ``n_top += n_bot``,
  ``n_bot = 0``), keeping ``floor(density n)`` in the band between; all
  ones when ``density >= 1``."""
  n = tau.size
  if density >= 1:
    return jnp.ones(tau.shape, bool)
  target, n_top = int(density * n), int(gamma * n)
  n_bot = n - target - n_top
  if n_bot < 0:
    n_top, n_bot = n_top + n_bot, 0
  rank = jnp.argsort(jnp.argsort(jnp.abs(tau).reshape(-1), stable=True),
                     stable=True)  # 0 = smallest
  keep = (rank >= n_bot) & (rank < n - n_top)
  return keep.reshape(tau.shape)


def random_mask(tau: jax.Array, density: float, key: jax.Array) -> jax.Array:
  """DARE: each entry kept with probability ``density`` (all ones when
  ``density >= 1``)."""
  if density >= 1:
    return jnp.ones(tau.shape, bool)
  return jax.random.bernoulli(key, density, tau.shape)


def sign_consensus(weighted: jax.Array) -> jax.Array:
  """TIES's election over [E, ...] weighted task vectors ``w_d tau_d``:
  ``s = +1 if sum_d w_d tau_d >= 0 else -1`` per entry; 1 where
  ``sign(w_d tau_d) == s`` (a zero entry never agrees)."""
  elected = jnp.where(weighted.sum(0) >= 0, 1.0, -1.0)
  return jnp.sign(weighted) == elected


# ------------------------------------------------------------- methods


def _expand(w: jax.Array, like: jax.Array) -> jax.Array:
  return w.reshape(w.shape + (1,) * (like.ndim - 1))


def linear(b, x, s: Settings, key=None):
  """Weighted average of the experts: ``sum_d w_d x_d / sum_d w_d``."""
  del b, key
  w = jnp.asarray(s.weights, jnp.float32)
  return (_expand(w, x) * x).sum(0) / w.sum()


def task_arithmetic_family(b, x, s: Settings, key=None):
  """mergekit's generalised task arithmetic.

  ``tau_d <- sparsify(tau_d)`` (none; magnitude top-``density``; random
  keep-``density``, times ``1/density`` when ``rescale``; or the
  breadcrumbs band), ``v_d = w_d tau_d``, then with the sign-consensus
  mask ``m_d`` (TIES methods, else 1)::

      delta = sum_d m_d v_d,   D = sum_d m_d w_d  (1 where 0)
      theta = b + lam * (delta / D if normalize else delta)
  """
  sparsify, consensus, normalize_default = _GTA[s.method]
  tau = x - b[None]
  masks = []
  for d in range(x.shape[0]):
    if sparsify == "magnitude":
      masks.append(magnitude_mask(tau[d], s.density))
    elif sparsify == "band":
      masks.append(band_mask(tau[d], s.density, s.gamma))
    elif sparsify == "random":
      masks.append(random_mask(tau[d], s.density,
                               jax.random.fold_in(key, d)))
  if masks:
    tau = tau * jnp.stack(masks)
    if sparsify == "random" and s.rescale and s.density < 1:
      tau = tau / s.density
  w = _expand(jnp.asarray(s.weights, jnp.float32), tau)
  weighted = tau * w
  if consensus:
    agree = sign_consensus(weighted)
    delta = (weighted * agree).sum(0)
    divisor = (w * agree).sum(0)
    divisor = jnp.where(divisor == 0, 1.0, divisor)
  else:
    delta = weighted.sum(0)
    divisor = w.sum(0)
    divisor = jnp.where(jnp.abs(divisor) < 1e-8, 1.0, divisor)
  normalize = normalize_default if s.normalize is None else s.normalize
  if normalize:
    delta = delta / divisor
  return b + s.lam * delta


def model_stock(b, x, s: Settings, key=None):
  """Model Stock: with ``cos`` the mean pairwise cosine of the task vectors
  (each norm product clamped at 1e-6, each cosine to [-1, 1]) and ``N``
  experts, ``t = N cos / (1 + (N - 1) cos)`` and
  ``theta = t * mean_d x_d + (1 - t) * b``."""
  del s, key
  n = x.shape[0]
  tau = (x - b[None]).reshape(n, -1)
  norms = jnp.linalg.norm(tau, axis=1)
  cosines = [jnp.clip(tau[i] @ tau[j] / jnp.maximum(norms[i] * norms[j],
                                                    1e-6), -1.0, 1.0)
             for i in range(n) for j in range(i + 1, n)]
  cos = jnp.mean(jnp.stack(cosines))
  t = n * cos / (1 + (n - 1) * cos)
  return t * x.mean(0) + (1 - t) * b


def slerp(b, x, s: Settings, key=None, dot_threshold=0.9995, eps=1e-8):
  """Spherical interpolation from the first expert ``v0`` to the second
  ``v1``: with ``u_i = v_i / ||v_i||`` (when ``||v_i|| > eps``),
  ``dot = u0 . u1`` and ``theta = arccos(dot)``,
  ``sin((1-t) theta) / sin theta * v0 + sin(t theta) / sin theta * v1``;
  the straight line ``(1 - t) v0 + t v1`` when ``|dot| > 0.9995``."""
  del b, key
  v0, v1 = x[0], x[1]

  def unit(v):
    norm = jnp.linalg.norm(v)
    return jnp.where(norm > eps, v / jnp.where(norm > eps, norm, 1.0), v)

  dot = jnp.sum(unit(v0) * unit(v1))
  theta = jnp.arccos(jnp.clip(dot, -1.0, 1.0))
  sin = jnp.where(jnp.abs(dot) > dot_threshold, 1.0, jnp.sin(theta))
  spherical = (jnp.sin(theta - s.t * theta) / sin * v0
               + jnp.sin(s.t * theta) / sin * v1)
  straight = (1 - s.t) * v0 + s.t * v1
  return jnp.where(jnp.abs(dot) > dot_threshold, straight, spherical)


def karcher(b, x, s: Settings, key=None, max_iter=10, tol=1e-5):
  """The weighted Karcher (Riemannian) mean of the experts on the unit
  sphere, times ``sum_d a_d ||x_d||`` (``a = w / sum w``): from the
  normalised weighted mean ``mu`` of the unit vectors ``u_d``, up to 10
  steps ``mu <- cos|g| mu + sin|g| g / |g|`` along the tangent
  ``g = sum_d a_d theta_d / sin(theta_d) (u_d - cos(theta_d) mu)``,
  ``theta_d = arccos(mu . u_d)``; stops when ``|g| < tol``. Experts whose
  norm is under ``tol`` are left out of the direction."""
  del b, key
  n = x.shape[0]
  flat = x.reshape(n, -1)
  a = jnp.asarray(s.weights, jnp.float32)
  a = a / a.sum()
  norms = jnp.linalg.norm(flat, axis=1)
  valid = norms > tol
  units = flat / jnp.where(norms > 0, norms, 1.0)[:, None]
  alpha = jnp.where(valid, a, 0.0)
  alpha = alpha / jnp.where(alpha.sum() > 0, alpha.sum(), 1.0)
  mean = (alpha[:, None] * units).sum(0)
  mean_norm = jnp.linalg.norm(mean)
  first = units[jnp.argmax(valid)]
  mean = jnp.where(mean_norm < tol, first,
                   mean / jnp.where(mean_norm < tol, 1.0, mean_norm))

  def step(mean_done, _):
    mean, done = mean_done
    dot = jnp.clip(units @ mean, -1.0, 1.0)
    theta = jnp.arccos(dot)
    factor = jnp.where(theta < tol, 0.0,
                       theta / jnp.where(theta < tol, 1.0, jnp.sin(theta)))
    tangent = ((alpha * factor)[:, None] * (units - dot[:, None] * mean)
               ).sum(0)
    norm = jnp.linalg.norm(tangent)
    stop = done | (norm < tol)
    moved = (jnp.cos(norm) * mean
             + jnp.sin(norm) * tangent / jnp.where(norm > 0, norm, 1.0))
    moved_norm = jnp.linalg.norm(moved)
    moved = jnp.where(moved_norm > tol, moved / moved_norm, moved)
    return (jnp.where(stop, mean, moved), stop), None

  (mean, _), _ = jax.lax.scan(step, (mean, jnp.array(False)), None,
                              length=max_iter)
  scale = (a * norms).sum()
  out = jnp.where(valid.any(), scale * mean, jnp.zeros_like(mean))
  return out.reshape(x.shape[1:])


def sparse_union(b, x, s: Settings, key=None):
  """For RL experts, whose updates are sparse and partly overlapping: with
  ``m_d = |tau_d| > tolerance``, an entry changed by one expert takes that
  change, one changed by several the weighted mean of their changes::

      theta = b + lam * sum_d w_d m_d tau_d / max(sum_d w_d m_d, .)

  (entries changed by none stay at the base)."""
  del key
  tau = x - b[None]
  changed = jnp.abs(tau) > s.tolerance
  w = _expand(jnp.asarray(s.weights, jnp.float32), tau) * changed
  total = w.sum(0)
  delta = (w * tau).sum(0) / jnp.where(total == 0, 1.0, total)
  return b + s.lam * delta


MERGES: dict[str, Callable] = {
    "linear": linear, "model_stock": model_stock, "slerp": slerp,
    "karcher": karcher, "sparse_union": sparse_union,
    **{name: task_arithmetic_family for name in _GTA},
}


# ------------------------------------------------ settings per tensor


@dataclasses.dataclass(frozen=True)
class Override:
  """Settings for the leaves whose name matches ``pattern``
  (``re.search``); values are floats or ``(start, end)`` ramps."""
  pattern: str
  values: tuple[tuple[str, Any], ...]


def parse_overrides(spec: str) -> tuple[Override, ...]:
  """``merge.overrides``: rules ``pattern:key=value[,key=value]`` separated
  by ``;``, first match wins; a value ``a..b`` ramps over the layers of a
  stacked leaf. E.g. ``attn|q|k|v|o:density=0.7;gate|up|down:density=0.3``
  or ``layers/:lambda=0.5..1.0``."""
  rules = []
  for rule in filter(None, (r.strip() for r in spec.split(";"))):
    pattern, sep, body = rule.rpartition(":")
    if not sep or not pattern:
      raise ConfigError(f"merge.overrides: {rule!r} is not"
                        " pattern:key=value[,key=value]")
    try:
      re.compile(pattern)
    except re.error as e:
      raise ConfigError(f"merge.overrides: bad pattern {pattern!r} ({e})"
                        ) from None
    values = []
    for item in filter(None, (i.strip() for i in body.split(","))):
      key, sep, value = item.partition("=")
      key = key.strip()
      if not sep or key not in PARAMETERS:
        raise ConfigError(f"merge.overrides: {item!r} in rule {rule!r}: the"
                          " key must be one of " + ", ".join(PARAMETERS))
      try:
        parsed = (tuple(float(v) for v in value.split(".."))
                  if ".." in value else float(value))
      except ValueError:
        raise ConfigError(f"merge.overrides: {item!r}: not a number or a"
                          " ramp a..b") from None
      if isinstance(parsed, tuple) and len(parsed) != 2:
        raise ConfigError(f"merge.overrides: {item!r}: a ramp is a..b")
      for v in parsed if isinstance(parsed, tuple) else (parsed,):
        check_parameter(key, v, f"merge.overrides: rule {rule!r}")
      values.append((key, parsed))
    rules.append(Override(pattern, tuple(values)))
  return tuple(rules)


def leaf_settings(name: str, layers: int | None, base: Settings,
                  rules: Sequence[Override]) -> dict[str, Any]:
  """The settings of leaf ``name`` (``layers``: its number of stacked
  layers, None if not stacked) as keyword values: the first matching
  rule's values over ``base``; a ramp becomes a per-layer array."""
  values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
  for rule in rules:
    if re.search(rule.pattern, name):
      for key, value in rule.values:
        if isinstance(value, tuple):
          if layers is None:
            raise ConfigError(f"merge.overrides: a ramp of {key} needs"
                              f" stacked layers, {name!r} has none")
          value = np.linspace(value[0], value[1], layers).astype(np.float32)
        values["lam" if key == "lambda" else key] = value
      break
  return values


def check_settings(values: Mapping[str, Any], name: str) -> None:
  """Every ``PARAMETERS`` value of the tensor ``name`` (a number, or one
  per layer) valid: a ConfigError naming the field otherwise."""
  for key, p in PARAMETERS.items():
    value = values["lam" if key == "lambda" else key]
    if not all(p.valid(float(v)) for v in np.ravel(value)):
      raise ConfigError(f"merge.{key}: must be {p.must_be}, got"
                        f" {value!r} for {name}")


# ------------------------------------------------------- the tree walk


@functools.lru_cache(maxsize=None)
def _merge_fn(settings: Settings, stacked: bool, per_layer: tuple[str, ...]):
  """A jitted ``(b, x, key, *per-layer values) -> merged`` for one leaf
  shape; a stacked leaf is merged slice by slice (vmap over the layer
  axis), each slice with its own key and per-layer values."""
  fn = MERGES[settings.method]

  def one(b, x, key, *values):
    s = dataclasses.replace(settings, **dict(zip(per_layer, values)))
    return fn(b.astype(jnp.float32), x.astype(jnp.float32), s,
              key).astype(b.dtype)

  if stacked:
    return jax.jit(jax.vmap(one, in_axes=(0, 1, 0) + (0,) * len(per_layer)))
  return jax.jit(one)


def merge_leaf(name: str, base_leaf, expert_leaves: Sequence, settings:
               Settings, rules: Sequence[Override], key: jax.Array,
               stacked: bool):
  """One leaf merged (``stacked``: its axis 0 holds the layers)."""
  layers = base_leaf.shape[0] if stacked else None
  values = leaf_settings(name, layers, settings, rules)
  check_settings(values, name)
  per_layer = tuple(k for k, v in values.items() if isinstance(v, np.ndarray))
  static = dataclasses.replace(settings, **{
      k: v for k, v in values.items() if k not in per_layer})
  x = jnp.stack(list(expert_leaves))
  keys = jax.random.split(key, layers) if stacked else key
  fn = _merge_fn(static, stacked, per_layer)
  return fn(base_leaf, x, keys, *(jnp.asarray(values[k]) for k in per_layer))


def merge_params(base: Any, expert_leaves: Callable[[str], Sequence],
                 settings: Settings, rules: Sequence[Override] = (),
                 seed: int = 0,
                 is_stacked: Callable[[str], bool] = lambda name: False
                 ) -> Any:
  """The merged parameter tree, one leaf at a time: leaf ``i``, named
  ``n``, merged from ``expert_leaves(n)`` (the experts' leaves, read only
  then, so that memory holds one model and one leaf per expert) with key
  ``fold_in(key(seed), i)``."""
  flat_base, treedef = jax.tree_util.tree_flatten(base)
  root = jax.random.key(seed)
  merged = [merge_leaf(name, leaf, expert_leaves(name), settings, rules,
                       jax.random.fold_in(root, i), is_stacked(name))
            for i, (name, leaf) in enumerate(
                zip([n for n, _ in named_leaves(base)], flat_base))]
  return jax.tree_util.tree_unflatten(treedef, merged)


def in_memory(experts: Sequence[Any]) -> Callable[[str], list]:
  """``expert_leaves`` for experts already in memory."""
  by_name = [dict(named_leaves(e)) for e in experts]
  return lambda name: [e[name] for e in by_name]


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


def check_experts(method: str, count: int) -> None:
  """How many experts each method takes: SLERP two, Model Stock at least
  two, the rest at least one."""
  if method == "slerp" and count != 2:
    raise ConfigError(f"merge.method: slerp interpolates two experts, got"
                      f" {count}")
  if method == "model_stock" and count < 2:
    raise ConfigError(f"merge.method: model_stock needs at least two"
                      f" experts, got {count}")
