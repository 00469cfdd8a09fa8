"""Checkpoints: orbax CheckpointManager over (train state, data iterator state).

Each checkpoint is one step directory holding two items: "state" (step,
params, optimizer state) and "data" (the iterator's small JSON state), so a
resumed run reads exactly the batches an uninterrupted run would have read.

Orbax writes a checkpoint into a temporary directory and renames it into
place only when every item is complete; a process killed mid-save leaves a
temporary directory that is ignored (and cleaned up), never a half-written
checkpoint that would be restored. Saves are synchronous so that a kill after
a save returns can never lose it.
"""
from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
  """Periodic + final saves, keep-last-K, resume from the newest checkpoint.

  Args:
    directory: where step directories go (created if missing).
    every_steps: periodic save interval (0 = only forced saves).
    keep: number of most recent checkpoints kept.
  """

  def __init__(self, directory: str, *, every_steps: int, keep: int):
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=False,
        cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(
        os.path.abspath(directory), options=options,
        item_names=("state", "data"))

  def latest_step(self) -> int | None:
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state, data_state: dict) -> None:
    """Saves (blocking) unless a checkpoint of ``step`` already exists."""
    if step in self._mngr.all_steps():
      return
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state)), force=True)
    self._mngr.wait_until_finished()

  def restore(self, like_state, step: int | None = None):
    """Restores (state, data_state) of ``step`` (default: the newest).

    Args:
      like_state: a state with the target structure, shapes, dtypes and
        shardings (e.g. the freshly initialized one).
      step: which checkpoint.
    """
    step = self._mngr.latest_step() if step is None else step
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        like_state)
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=ocp.args.JsonRestore()))
    return out["state"], out["data"]

  def restore_params(self, step: int | None = None):
    """The params of ``step``'s checkpoint (default: the newest).

    Restored from the checkpoint's own metadata (no target state needed), as
    host arrays.

    Raises:
      FileNotFoundError: the directory holds no checkpoint (or not ``step``).
    """
    steps = self.all_steps()
    step = max(steps, default=None) if step is None else step
    if step is None or step not in steps:
      raise FileNotFoundError(
          f"no checkpoint {'' if step is None else f'of step {step} '}in "
          f"{self._mngr.directory} (steps: {sorted(steps)})")
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore()))
    return jax.tree.map(np.asarray, out["state"]["params"])

  def close(self) -> None:
    self._mngr.close()
