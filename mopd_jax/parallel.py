"""Device mesh, the logical-axis rules that place parameters and activations,
and the multi-host plumbing (distributed start-up, per-host batches).

Every parameter and key activation names its axes logically (``batch``,
``embed``, ``heads``, ...); an ordered rule table maps those names onto the
mesh axes ``data`` (pure data parallelism), ``fsdp`` (data parallelism with
parameters sharded over it) and ``tensor`` (tensor parallelism). Three tables
are named in ``RULE_SETS`` and chosen by ``mesh.rules``:

* ``fsdp_tp`` (default): parameters sharded over ``fsdp`` (embed) and
  ``tensor`` (heads, kv_heads, mlp, vocab); the batch over data x fsdp.
* ``fsdp``: parameters sharded over ``fsdp`` only (ZeRO-3 style).
* ``dp``: parameters replicated; only the batch is split.

The table in force is the one in scope (``use_rules``, which ``train``
enters from the config), so that ``activate``, ``logical_sharding`` and the
model's activation constraints read one source of truth. A mesh axis that
does not divide a dimension is dropped for that dimension (it stays
replicated): 4 kv heads on 8 tensor-parallel devices, a batch of 2 on 4
data-parallel ones. Change the mesh and rules in the config, never the model
code.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mopd_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

_BATCH = (("batch", ("data", "fsdp")), ("length", None))
_UNSHARDED = (("head_dim", None), ("layers", None), ("norm", None))
RULE_SETS = {
    "fsdp_tp": _BATCH + (
        ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
        ("mlp", "tensor"), ("vocab", "tensor")) + _UNSHARDED,
    "fsdp": _BATCH + (
        ("embed", "fsdp"), ("heads", None), ("kv_heads", None),
        ("mlp", None), ("vocab", None)) + _UNSHARDED,
    "dp": _BATCH + (
        ("embed", None), ("heads", None), ("kv_heads", None), ("mlp", None),
        ("vocab", None)) + _UNSHARDED,
}
DEFAULT_RULES = "fsdp_tp"


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices=None, rules: str | None = None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh; one size may be -1 (all the rest).

  ``rules`` (the config's ``mesh.rules``) is only checked here; it takes
  effect through ``use_rules``.
  """
  if rules is not None:
    rule_table(rules)
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"mesh: sizes {sizes} must be positive, at most one -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ConfigError(
          f"mesh: {len(devices)} devices do not divide by {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ConfigError(
        f"mesh: data*fsdp*tensor = {int(np.prod(sizes))} but there are"
        f" {len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def rule_table(name: str) -> tuple:
  if name not in RULE_SETS:
    raise ConfigError(f"mesh.rules: unknown rule set {name!r}; known: "
                      + ", ".join(RULE_SETS))
  return RULE_SETS[name]


def current_rules() -> tuple:
  """The rule table in scope (``use_rules`` / ``activate``), else the
  default one."""
  return tuple(nn.get_logical_axis_rules()) or RULE_SETS[DEFAULT_RULES]


@contextlib.contextmanager
def use_rules(name: str) -> Iterator[None]:
  """The rule set ``name`` in scope for everything inside."""
  with nn.logical_axis_rules(rule_table(name)):
    yield


@contextlib.contextmanager
def activate(mesh: Mesh) -> Iterator[None]:
  """Mesh and the rules in scope, so activation constraints take effect."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(current_rules()):
    yield


def mesh_spec(axis_sizes, names: Sequence[str | None],
              shape: Sequence[int]) -> P:
  """The mesh ``PartitionSpec`` of logical ``names`` for an array of
  ``shape`` under the rules in scope; ``axis_sizes``: ``{mesh axis: size}``.

  Of the mesh axes a rule gives a dimension, the longest prefix whose sizes'
  product divides it is kept (none: the dimension is replicated).
  """
  spec = nn.logical_to_mesh_axes(tuple(names), current_rules())
  out = []
  for dim, axes in zip(shape, tuple(spec) + (None,) * len(shape)):
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    while axes and dim % int(np.prod([axis_sizes[a] for a in axes])):
      axes = axes[:-1]
    out.append(axes[0] if len(axes) == 1 else (axes or None))
  return P(*out)


def logical_sharding(mesh: Mesh, logical_specs: Any, shapes: Any) -> Any:
  """NamedShardings for a pytree of logical ``PartitionSpec``s and the
  matching pytree of arrays or ``ShapeDtypeStruct``s (``mesh_spec``)."""
  return jax.tree.map(
      lambda names, s: NamedSharding(mesh, mesh_spec(mesh.shape, names,
                                                     s.shape)),
      logical_specs, shapes, is_leaf=lambda x: isinstance(x, P))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
  """``x`` constrained to the layout of logical ``names`` on the mesh in
  scope (``activate``); unchanged outside one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(
      x, mesh_spec(dict(mesh.shape), names, x.shape))


def data_parallel(mesh: Mesh) -> int:
  """How many ways ``batch`` is split (``data`` x ``fsdp``; 1 without a
  mesh): a batch's rows must be a multiple of it."""
  return 1 if mesh.empty else mesh.shape["data"] * mesh.shape["fsdp"]


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
  """Leading axis split like ``batch``, the rest replicated."""
  names = ("batch",) + (None,) * (len(shape) - 1)
  return NamedSharding(mesh, mesh_spec(mesh.shape, names, shape))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_batch(mesh: Mesh, tree: Any) -> Any:
  """Host arrays (equal on every process) as global arrays split over the
  batch axis: each process copies only the rows its own devices hold, so
  hosts feed their shards without sending the batch around. On one host,
  the same as ``jax.device_put`` with ``batch_sharding``."""
  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.shape),
                                        lambda index: x[index])

  return jax.tree.map(put, tree)


def to_host(tree: Any) -> Any:
  """NumPy copies of (possibly multi-host) global arrays, on every process."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))

  return jax.tree.map(get, tree)


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0)."""
  return jax.process_index() == 0


def use_cpu_devices(count: int) -> None:
  """Split this host's CPU into ``count`` devices, before anything touches
  a device (``count`` 1: leave it whole). XLA:CPU runs each device's
  program on a thread of its own, while one device runs its small
  element-wise ops on one core; on the 2-core machine 2 devices sample
  1.5x faster (docs/performance.md). The mesh then spans them like any
  other devices. No effect on a host whose default backend is an
  accelerator."""
  if count > 1:
    jax.config.update("jax_num_cpu_devices", count)


def init_distributed(section) -> bool:
  """``jax.distributed.initialize`` for a multi-host run, before anything
  touches a device; returns whether it ran.

  Runs when ``section.enabled`` (TPU pods and SLURM/Open MPI clusters
  detect the coordinator, process count and id themselves; non-empty config
  fields override) or when ``JAX_COORDINATOR_ADDRESS`` is set (then
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` give the rest). A no-op by
  default.
  """
  env = os.environ
  address = section.coordinator_address or env.get(
      "JAX_COORDINATOR_ADDRESS", "")
  if not (section.enabled or address):
    return False
  num = section.num_processes or int(env.get("JAX_NUM_PROCESSES", 0))
  pid = section.process_id if section.process_id >= 0 else int(
      env.get("JAX_PROCESS_ID", -1))
  jax.distributed.initialize(coordinator_address=address or None,
                             num_processes=num or None,
                             process_id=pid if pid >= 0 else None)
  return True
