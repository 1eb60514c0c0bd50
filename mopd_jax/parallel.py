"""Device mesh and the logical-axis rules that place parameters and activations.

Every parameter and key activation names its axes logically (``batch``,
``embed``, ``heads``, ...); ``RULES`` maps those names onto the mesh axes
``data`` (pure data parallelism), ``fsdp`` (data parallelism with parameters
sharded over it) and ``tensor`` (tensor parallelism), in that order of
preference. Change the mesh shape in the config, never the model code.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mopd_jax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices=None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh; one size may be -1 (all the rest)."""
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


def logical_sharding(mesh: Mesh, logical_specs: Any) -> Any:
  """NamedShardings for a pytree of logical ``PartitionSpec``s."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading axis over (data, fsdp), the rest replicated (any rank >= 1)."""
  return NamedSharding(mesh, P(("data", "fsdp")))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


@contextlib.contextmanager
def activate(mesh: Mesh) -> Iterator[None]:
  """Mesh and rules in scope, so activation sharding constraints take effect."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    yield
