"""Per-tile math of the fused vocabulary ops, shared by the XLA and Pallas paths.

A tile is a block of rows (tokens) times a block of vocabulary columns,
``z = scale * h @ w_tile`` in float32, with columns outside the tile's own
range set to ``-inf`` (``valid`` is False there). Row statistics are carried
as ``[rows, 1]`` float32 arrays and updated tile by tile with an online
log-sum-exp: for a running max ``m`` and a sum ``l = sum_v exp(z_v - m)``, a
new tile with max ``m'`` rescales the old sum by ``exp(m - m')``. Every
function here is plain ``jax.numpy``, so the same code runs inside
``lax.fori_loop`` and inside a Pallas kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LseStats = tuple  # (m, l, t): running max, sum exp(z - m), sum exp(z - m) z
KlStats = tuple  # (m_s, l_s, m_t, l_t, a, b, c), see ``kl_update``


def logits(h: jax.Array, w: jax.Array, scale: float,
           valid: jax.Array) -> jax.Array:
  """``scale * h @ w`` accumulated in float32, ``-inf`` where not ``valid``."""
  z = scale * jnp.dot(h, w, preferred_element_type=jnp.float32)
  return jnp.where(valid, z, -jnp.inf)


def _row_sum(x):
  return jnp.sum(x, axis=1, keepdims=True)


def _online_max(m, z):
  """New running max and the factor ``exp(m_old - m_new)`` rescaling sums."""
  m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
  return m_new, jnp.exp(m - m_new)


def lse_init(rows: int) -> LseStats:
  return (jnp.full((rows, 1), -jnp.inf, jnp.float32),
          jnp.zeros((rows, 1), jnp.float32), jnp.zeros((rows, 1), jnp.float32))


def lse_update(stats: LseStats, z: jax.Array, valid: jax.Array) -> LseStats:
  """Folds a tile into ``(m, l, t)``: ``l = sum e^(z-m)``, ``t = sum e^(z-m) z``.

  Every tile has at least one valid column, so ``m`` is finite after the first
  tile and ``exp(-inf - m) = 0`` drops the masked columns; ``z`` is zeroed there
  before the product so that ``0 * -inf`` never makes a NaN.
  """
  m, l, t = stats
  m, decay = _online_max(m, z)
  e = jnp.exp(z - m)
  return (m, l * decay + _row_sum(e),
          t * decay + _row_sum(e * jnp.where(valid, z, 0.0)))


def lse_finish(stats: LseStats):
  """``lse = m + log l`` and the entropy ``H = lse - E_p[z] = lse - t / l``."""
  m, l, t = stats
  lse = m + jnp.log(l)
  return lse, lse - t / l


def lse_cotangent(z, valid, lse, entropy, g_lse, g_entropy):
  """Cotangent of the tile's logits from those of ``lse`` and ``H``.

  ``d lse / d z_v = p_v`` and ``d H / d z_v = -p_v (log p_v + H)``, with
  ``p_v = exp(z_v - lse)``; ``entropy``/``g_entropy`` may be None (no entropy
  output). Masked columns get 0.
  """
  p = jnp.exp(z - lse)
  g = p * g_lse
  if g_entropy is not None:
    g = g - g_entropy * p * (jnp.where(valid, z - lse, 0.0) + entropy)
  return g


def kl_init(rows: int) -> KlStats:
  neg = jnp.full((rows, 1), -jnp.inf, jnp.float32)
  zero = jnp.zeros((rows, 1), jnp.float32)
  return neg, zero, neg, zero, zero, zero, zero


def kl_update(stats: KlStats, zs: jax.Array, zt: jax.Array,
              valid: jax.Array) -> KlStats:
  """Folds a tile of student ``zs`` and teacher ``zt`` logits into the stats.

  ``m_s, l_s`` and ``m_t, l_t`` are the two online log-sum-exps;
  ``a = sum e^(zs-m_s) (zs - zt)``, ``b = sum e^(zt-m_t) (zt - zs)`` and
  ``c = sum e^(zt-m_t) zt`` are the unnormalised expectations ``kl_finish``
  turns into both KLs and the teacher's entropy.
  """
  ms, ls, mt, lt, a, b, c = stats
  ms, decay_s = _online_max(ms, zs)
  mt, decay_t = _online_max(mt, zt)
  es, et = jnp.exp(zs - ms), jnp.exp(zt - mt)
  diff = jnp.where(valid, zs - zt, 0.0)
  return (ms, ls * decay_s + _row_sum(es), mt, lt * decay_t + _row_sum(et),
          a * decay_s + _row_sum(es * diff), b * decay_t - _row_sum(et * diff),
          c * decay_t + _row_sum(et * jnp.where(valid, zt, 0.0)))


def kl_finish(stats: KlStats):
  """``(lse_s, lse_t, KL(pi||T), KL(T||pi), H(T))`` per row.

  ``KL(pi||T) = E_pi[zs - zt] - lse_s + lse_t``,
  ``KL(T||pi) = E_T[zt - zs] - lse_t + lse_s``, ``H(T) = lse_t - E_T[zt]``.
  """
  ms, ls, mt, lt, a, b, c = stats
  lse_s, lse_t = ms + jnp.log(ls), mt + jnp.log(lt)
  return (lse_s, lse_t, a / ls - lse_s + lse_t, b / lt - lse_t + lse_s,
          lse_t - c / lt)


def kl_cotangent(zs, zt, valid, lse_s, lse_t, reverse, g_reverse, g_forward):
  """Cotangent of the student's tile logits from those of both KLs.

  With ``p = softmax(zs)``, ``q = softmax(zt)``:
  ``d KL(p||q) / d zs_v = p_v (log p_v - log q_v - KL(p||q))`` and
  ``d KL(q||p) / d zs_v = p_v - q_v``. Masked columns get 0.
  """
  p, q = jnp.exp(zs - lse_s), jnp.exp(zt - lse_t)
  log_ratio = jnp.where(valid, (zs - lse_s) - (zt - lse_t), 0.0)
  return g_reverse * p * (log_ratio - reverse) + g_forward * (p - q)
