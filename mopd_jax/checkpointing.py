"""Orbax checkpoints of the whole train state: save every N steps, keep K,
resume from the newest readable one on a re-run of the same command.

Layout: ``<workdir>/ckpt/<step>/default`` holds the train-state pytree and
``<step>/loop`` a small JSON dict of the step loop's own state (see
``training.run_loop``). What holds:

* A half-written checkpoint never appears under its step's name: Orbax writes
  into a temporary directory and renames it once complete; the next run
  ignores the leftovers of a killed save and removes them (in the
  background, before its first save).
* Steps beyond ``keep`` are deleted only after a newer step is complete.
* Every checkpoint records the sha256 of its parameters (``loop`` item,
  ``params_sha256``), verified on restore, so that silent damage (a
  flipped bit) is caught like a read error.
* Restoring takes the newest step that reads back. An unreadable one
  (truncated, garbled or missing files, or parameters that do not match
  their checksum) is reported in one warning line, moved to
  ``<workdir>/ckpt_corrupt/`` (so that its step can be saved again) and the
  step before it is tried. Another run reading this one's parameters
  (``load_params``: init, teacher, expert, evaluation) takes only the final
  checkpoint, and a damaged one is a ``CheckpointError``.
* A readable checkpoint of another shape (another model or method) is a
  ``CheckpointError`` naming the first mismatching array, never a fallback.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from mopd_jax.checksum import named_leaves, tree_checksum
from mopd_jax.errors import CheckpointError, reason

# Item names; "default" is where single-item checkpoints of earlier versions
# kept the state, so those stay readable.
STATE, LOOP = "default", "loop"
CORRUPT_DIR = "ckpt_corrupt"

CHECKSUM = "params_sha256"


def _manager(directory: str, state_handler, **options):
  return ocp.CheckpointManager(
      directory,
      item_handlers={STATE: state_handler, LOOP: ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(**options))


class Checkpointer:
  """The checkpoints of one run, under ``<workdir>/ckpt``."""

  def __init__(self, workdir: str, every: int, keep: int):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, "ckpt")
    self._keep = keep
    self._manager = _manager(self.directory, ocp.StandardCheckpointHandler(),
                             save_interval_steps=every,
                             max_to_keep=keep, create=True,
                             cleanup_tmp_directories=True)

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def due(self, step: int) -> bool:
    """Whether ``save`` would save ``step`` (every N steps; Orbax also saves
    the first step of a run)."""
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, force: bool = False,
           loop: dict | None = None) -> bool:
    """Start saving ``state`` and the JSON-able ``loop`` dict (with the
    checksum of ``state["params"]``) at ``step`` (asynchronously) if
    ``step`` is due or ``force``; True if it started."""
    if not (force or self.due(step)):
      return False
    loop = dict(loop or {}, **{CHECKSUM: tree_checksum(state["params"])})
    try:
      return self._manager.save(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardSave(state),
          LOOP: ocp.args.JsonSave(loop)}), force=force)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(self._save_failed(step, e)) from None

  def restore_latest(self, state_like: Any) -> tuple[int, Any, dict] | None:
    """``(step, state, loop)`` of the newest readable checkpoint, with the
    structure and shardings of ``state_like`` (arrays or
    ``jax.ShapeDtypeStruct``s); None when there is no checkpoint at all."""
    if not self._manager.all_steps():
      return None
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)

    def read(step):
      check_shapes(stored_shapes(_state_metadata(self._manager, step)),
                   state_like, f"{self.workdir}: array", step, exact=True)
      items = {STATE: ocp.args.StandardRestore(target)}
      if os.path.isdir(os.path.join(self.directory, str(step), LOOP)):
        items[LOOP] = ocp.args.JsonRestore()
      restored = self._manager.restore(step,
                                       args=ocp.args.Composite(**items))
      loop = dict(restored[LOOP] if LOOP in items else {})
      verify(restored[STATE]["params"], loop)
      loop.pop(CHECKSUM, None)  # the checkpointer's own entry
      return restored[STATE], loop

    step, (state, loop) = _newest_readable(self._manager, read,
                                           self._set_aside)
    # A run killed between a save and the deletion it allows left too many.
    for old in self.all_steps()[:-self._keep]:
      self._manager.delete(old)
    return step, state, loop

  def _set_aside(self, step: int) -> str:
    """Move the unreadable ``step`` to ``<workdir>/ckpt_corrupt/``."""
    target = os.path.join(self.workdir, CORRUPT_DIR,
                          f"{step}-{time.time_ns()}")
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.replace(os.path.join(self.directory, str(step)), target)
    self._manager.reload()
    return f"moved to {target}"

  def _save_failed(self, step: int | None, error: Exception) -> str:
    # From the folder: the manager's own list is not reliable after a
    # failed save.
    kept = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
    by = f" by step {step}" if step is not None else ""
    return (f"{self.directory}: a checkpoint save failed{by}"
            f" ({reason(error)}); " + (
                f"the checkpoint of step {kept[-1]} is intact" if kept
                else "no checkpoint was written") +
            "; free space or fix the permissions, then run the same command")

  def close(self) -> None:
    """Wait for saves in flight to complete; a failed one is a
    ``CheckpointError``."""
    try:
      self._manager.wait_until_finished()
      self._manager.close()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(self._save_failed(None, e)) from None


class ParamReader:
  """The final checkpoint of the run in ``run_dir``, read-only, opened once
  for many reads (a merge reads each expert leaf by leaf, once per point
  of its sweep): one manager, the stored shapes read once. A damaged final
  checkpoint is a ``CheckpointError`` naming the run (re-running that run
  repairs it), not a silent fallback to an earlier step."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self._root = _checkpoints_of(run_dir)
    self._manager = _read_only_manager(self._root)
    if self._manager is None:
      raise CheckpointError(f"{run_dir}: no checkpoints (no ckpt/ directory)")
    try:
      if not self._manager.all_steps():
        raise CheckpointError(f"{run_dir}: no complete checkpoint in"
                              f" {self._root}")
      self.step = max(self._manager.all_steps())
      self._shapes = self._unreadable_is_named(lambda: stored_shapes(
          _state_metadata(self._manager, self.step)["params"]))
    except BaseException:
      self.close()
      raise

  def _unreadable_is_named(self, read: Callable[[], Any]) -> Any:
    try:
      with _quiet_absl():
        return read()
    except CheckpointError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f"{self.run_dir}: its final checkpoint (step {self.step}) is"
          f" unreadable ({reason(e)}); re-run that run to repair it"
      ) from None

  def read(self, params_like: Any) -> Any:
    """The parameters of ``params_like``'s structure (arrays or
    ``jax.ShapeDtypeStruct``s with shardings; a subtree reads only its
    leaves); a checkpoint of another shape is a ``CheckpointError`` naming
    the first mismatching parameter. When it names every parameter, they
    are verified against the recorded checksum."""
    check_shapes(self._shapes, params_like, f"{self.run_dir}: parameter",
                 self.step, exact=False)

    def restore():
      target = {"params": jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                       params_like)}
      items = {STATE: ocp.args.PyTreeRestore(
          item=target, partial_restore=True,
          restore_args=ocp.checkpoint_utils.construct_restore_args(target))}
      whole = len(self._shapes) == len(named_leaves(params_like))
      if whole and os.path.isdir(os.path.join(self._root, str(self.step),
                                              LOOP)):
        items[LOOP] = ocp.args.JsonRestore()
      restored = self._manager.restore(self.step,
                                       args=ocp.args.Composite(**items))
      if LOOP in items:
        verify(restored[STATE]["params"], dict(restored[LOOP] or {}))
      return restored[STATE]["params"]

    return self._unreadable_is_named(restore)

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "ParamReader":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def load_params(run_dir: str, params_like: Any) -> Any:
  """``ParamReader(run_dir).read(params_like)``, once."""
  with ParamReader(run_dir) as reader:
    return reader.read(params_like)


def newest_step(run_dir: str) -> int | None:
  """The step of the newest complete checkpoint of the run in ``run_dir``
  (the one ``load_params`` reads); None without one."""
  manager = _read_only_manager(_checkpoints_of(run_dir))
  if manager is None:
    return None
  try:
    return max(manager.all_steps(), default=None)
  finally:
    manager.close()


def _checkpoints_of(run_dir: str) -> str:
  return os.path.join(os.path.abspath(os.path.expanduser(run_dir)), "ckpt")


def _read_only_manager(root: str) -> ocp.CheckpointManager | None:
  """A read-only manager of the checkpoints in ``root``; None when there
  is no such folder."""
  if not os.path.isdir(root):
    return None
  with _quiet_absl():  # its notes on read-only directories, once per read
    # The PyTree handler, unlike the standard one, restores a subtree.
    return _manager(root, ocp.PyTreeCheckpointHandler(), read_only=True)


def verify(params: Any, loop: dict) -> None:
  """A ``ValueError`` when ``params`` do not match the checksum recorded in
  the checkpoint's ``loop`` item (checkpoints older than the checksum
  record none and pass)."""
  recorded = loop.get(CHECKSUM)
  if recorded and tree_checksum(params) != recorded:
    raise ValueError("the parameters do not match their recorded sha256")


def _state_metadata(manager: ocp.CheckpointManager, step: int):
  """The train-state tree of ``step``'s metadata (array shapes, dtypes)."""
  metadata = manager.item_metadata(step)[STATE]
  if metadata is None:
    raise KeyError(f"no {STATE!r} item")
  return getattr(metadata, "tree", metadata)


def _newest_readable(manager: ocp.CheckpointManager,
                     read: Callable[[int], Any],
                     set_aside: Callable[[int], str]) -> tuple[int, Any]:
  """``(step, read(step))`` for the newest step that ``read`` can read.

  A step whose reading raises (a damaged file: Orbax and tensorstore raise
  many kinds, down to a bare ``Exception``; or a checksum mismatch) is
  reported on stderr in one line, handed to ``set_aside`` (which says what
  it did) and the next older step is tried; a ``CheckpointError``
  (incompatible, not damaged) propagates at once.
  """
  steps = sorted(manager.all_steps(), reverse=True)
  for step in steps:
    try:
      with _quiet_absl():
        return step, read(step)
    except CheckpointError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      action = set_aside(step)
      print(f"warning: checkpoint of step {step} in {manager.directory} is"
            f" unreadable ({reason(e)}); {action}, trying the previous one",
            file=sys.stderr)
  raise CheckpointError(f"{manager.directory}: none of the {len(steps)}"
                        " checkpoints is readable")


@contextlib.contextmanager
def _quiet_absl():
  """Mute Orbax's own log lines about a damaged checkpoint while reading
  one: the caller reports it in one line."""
  level = logging.get_verbosity()
  logging.set_verbosity(logging.FATAL)
  try:
    yield
  finally:
    logging.set_verbosity(level)


def stored_shapes(stored: Any) -> dict[str, tuple[int, ...]]:
  """Each array's shape in the checkpoint metadata ``stored``, by name."""
  return {name: tuple(leaf.shape) for name, leaf in named_leaves(stored)}


def check_shapes(have: dict[str, tuple[int, ...]], like: Any, where: str,
                 step: int, exact: bool) -> None:
  """Raise a ``CheckpointError`` for the first array of ``like`` that the
  checkpoint's ``have`` (``stored_shapes``) lacks or holds in another
  shape (and, when ``exact``, for the first stored array that ``like``
  lacks)."""
  want = {name: tuple(leaf.shape if hasattr(leaf, "shape")
                      else np.shape(leaf))
          for name, leaf in named_leaves(like)}
  for name, shape in want.items():
    if have.get(name) != shape:
      found = "missing" if name not in have else f"shape {have[name]}"
      raise CheckpointError(
          f"{where} {name} is {found} in the checkpoint of step {step},"
          f" expected shape {shape}")
  extra = sorted(set(have) - set(want)) if exact else []
  if extra:
    raise CheckpointError(f"{where} {extra[0]} is in the checkpoint of step"
                          f" {step} but not in this run's state")
