"""The merge methods (mergekit's parameterisation and defaults), each a
pure function of one tensor: the base's ``b`` [...], the experts' ``x``
[E, ...] and the tensor's ``Settings``; task vectors are
``tau_d = x_d - b``. ``METHODS`` declares, for each, the parameters it
reads (from which the sweep's axes follow) and how many experts it
takes.

Where mergekit draws random masks (DARE) the masks here come from
``jax.random`` and the ``seed``: the same command gives the same model,
but not mergekit's draw.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mopd_jax.errors import ConfigError
from mopd_jax.merge.parameters import Settings

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


@dataclasses.dataclass(frozen=True)
class Method:
  """A merge method: its function, the ``PARAMETERS`` it reads and the
  number of experts it takes (``max_experts`` None: any)."""
  fn: Callable
  reads: tuple[str, ...] = ()
  min_experts: int = 1
  max_experts: int | None = None


_SPARSIFY_READS = {None: (), "magnitude": ("density",),
                   "random": ("density",), "band": ("density", "gamma")}
METHODS: dict[str, Method] = {
    "linear": Method(linear),
    **{name: Method(task_arithmetic_family,
                    _SPARSIFY_READS[how] + ("lambda",))
       for name, (how, _, _) in _GTA.items()},
    "model_stock": Method(model_stock, min_experts=2),
    "slerp": Method(slerp, ("t",), min_experts=2, max_experts=2),
    "karcher": Method(karcher),
    "sparse_union": Method(sparse_union, ("lambda", "tolerance")),
}
# The parameters a validation sweep can tune, in the order of its grid.
SWEPT = ("lambda", "density")


def sweep_axes(method: str) -> tuple[str, ...]:
  """The ``SWEPT`` parameters ``method`` reads: a sweep's axes."""
  return tuple(p for p in SWEPT if p in METHODS[method].reads)


def check_experts(method: str, count: int) -> None:
  """As many experts as ``METHODS[method]`` takes (SLERP two, Model Stock
  at least two, the rest at least one)."""
  m = METHODS[method]
  if count < m.min_experts or (m.max_experts and count > m.max_experts):
    want = (f"{m.min_experts}" if m.max_experts == m.min_experts
            else f"at least {m.min_experts}")
    raise ConfigError(f"merge.method: {method} takes {want} experts, got"
                      f" {count}")


