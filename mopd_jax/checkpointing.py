"""Orbax checkpoints of the whole train state: save every N steps, keep K,
resume from the latest on a re-run of the same command."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp



class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` under ``<workdir>/ckpt``."""

  def __init__(self, workdir: str, every: int, keep: int):
    self.directory = os.path.join(os.path.abspath(workdir), "ckpt")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, force: bool = False) -> bool:
    return self._manager.save(step, args=ocp.args.StandardSave(state),
                              force=force)

  def restore(self, state_like: Any, step: int | None = None) -> Any:
    """Restore ``step`` (default: latest) with the structure and shardings of
    ``state_like`` (arrays or ``jax.ShapeDtypeStruct``s)."""
    step = self.latest_step() if step is None else step
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
    return self._manager.restore(step, args=ocp.args.StandardRestore(target))

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

