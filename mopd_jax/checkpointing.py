"""Orbax checkpoints of the whole train state: save every N steps, keep K,
resume from the latest on a re-run of the same command."""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from mopd_jax.errors import CheckpointError


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


def load_params(run_dir: str, params_like: Any) -> Any:
  """Parameters of the latest checkpoint of the run in ``run_dir``.

  ``params_like`` (arrays or ``jax.ShapeDtypeStruct``s with shardings) gives
  the expected structure; a checkpoint of another shape is a
  ``CheckpointError`` naming the first mismatching parameter.
  """
  root = os.path.join(os.path.abspath(os.path.expanduser(run_dir)), "ckpt")
  if not os.path.isdir(root):
    raise CheckpointError(f"{run_dir}: no checkpoints (no ckpt/ directory)")
  manager = ocp.CheckpointManager(
      root, item_handlers=ocp.PyTreeCheckpointHandler())
  step = manager.latest_step()
  if step is None:
    raise CheckpointError(f"{run_dir}: no complete checkpoint in {root}")
  stored = manager.item_metadata(step)
  stored = getattr(stored, "tree", stored)["params"]
  flat_stored = dict(_flatten(stored))
  for path, like in _flatten(params_like):
    have = flat_stored.get(path)
    if have is None or tuple(have.shape) != tuple(like.shape):
      found = "missing" if have is None else f"shape {tuple(have.shape)}"
      raise CheckpointError(
          f"{run_dir}: parameter {path} is {found} in the checkpoint of step"
          f" {step}, expected shape {tuple(like.shape)}")
  target = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                   params_like)}
  restored = manager.restore(step, args=ocp.args.PyTreeRestore(
      item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(
          target), partial_restore=True))
  manager.close()
  return restored["params"]


def _flatten(tree) -> list[tuple[str, Any]]:
  """``[("layers/q", leaf), ...]`` for a nested dict of arrays/metadata."""
  out = []
  for key, value in tree.items():
    if isinstance(value, dict):
      out += [(f"{key}/{k}", v) for k, v in _flatten(value)]
    else:
      out.append((key, value))
  return out
