"""Checkpoints: orbax CheckpointManager over (train state, data iterator state).

Each checkpoint is one step directory holding two items: "state" (step,
params, optimizer state) and "data" (the iterators' small JSON states), so a
resumed run reads exactly the batches an uninterrupted run would have read.

Multi-process runs: every process calls ``save`` and ``restore`` (orbax
writes each array once and synchronizes the processes). Each process reads
its own data shard, so "data" holds one iterator state per process,
``{"processes": [state_0, state_1, ...]}``, gathered from all processes
before the save; ``restore`` hands each process its own.

Saves are asynchronous: ``save`` returns once the arrays are copied to the
host, and orbax writes them in a background thread while training goes on
(the next save, ``wait_until_finished`` and ``close`` wait for it). Orbax
writes a checkpoint into a temporary directory and renames it into place
(its atomic finalize) only when every item is complete, and deletes the
checkpoints beyond keep-last-K only after that. A process killed mid-save
therefore loses at most the checkpoint in flight: it leaves a temporary
directory that is ignored (and cleaned up on the next run), never a
half-written checkpoint that would be restored, and the previous checkpoints
are still there.
"""
from __future__ import annotations

import json
import os
import re

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp


def _gather_json(obj) -> list:
  """Every process's JSON-serializable ``obj``, in process order."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(
      np.array([data.size], np.int32))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]


# Object stores orbax writes checkpoints to: its arrays go through
# TensorStore, whose spec orbax builds for local paths and gs:// only (an
# s3:// path becomes a relative local path "s3:/..." and is refused); its
# metadata through etils.epath (fsspec: gcsfs for gs://).
REMOTE_SCHEMES = ("gs://",)


def is_remote(directory: str) -> bool:
  return "://" in directory


def check_directory(directory: str, what: str = "config.checkpoint.directory"
                    ) -> None:
  """One-line ValueError unless orbax can hold checkpoints at ``directory``
  (a local or mounted path, or gs:// with gcsfs installed)."""
  if not directory or not is_remote(directory):
    return
  scheme = directory.split("://", 1)[0]
  if scheme == "s3":
    raise ValueError(
        f"{what}={directory}: orbax-checkpoint cannot write checkpoints to "
        "s3:// (it builds TensorStore specs for local paths and gs:// "
        "only); use gs://, or a local or mounted directory (e.g. an S3 "
        "bucket mounted with mountpoint-s3 or s3fs-fuse)")
  if not directory.startswith(REMOTE_SCHEMES):
    raise ValueError(
        f"{what}={directory}: orbax-checkpoint cannot write checkpoints to "
        f"{scheme}:// (it writes to local or mounted directories and gs://)")
  import importlib.util  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("gcsfs") is None:
    raise ValueError(f"{what}={directory}: gs:// needs gcsfs (pip install "
                     "'infcl-jax[cloud]')")


class Checkpointer:
  """Periodic + final saves, keep-last-K, resume from the newest checkpoint.

  Args:
    directory: where step directories go (created if missing).
    every_steps: periodic save interval (0 = only forced saves).
    keep: number of most recent checkpoints kept.
  """

  def __init__(self, directory: str, *, every_steps: int, keep: int,
               asynchronous: bool = True):
    self.every_steps = every_steps
    self.directory = (directory if is_remote(directory)
                      else os.path.abspath(directory))
    self._closed = False
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True,
        enable_async_checkpointing=asynchronous,
        cleanup_tmp_directories=True)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data"))

  def latest_step(self) -> int | None:
    """The newest step saved, including a save still in flight."""
    return self._mngr.latest_step()

  def finalized_steps(self) -> list[int]:
    """The steps whose checkpoints are complete on disk (orbax renames a
    checkpoint to its plain step number only when it is complete)."""
    from etils import epath  # pylint: disable=g-import-not-at-top
    path = epath.Path(self.directory)
    if not path.is_dir():
      return []
    return sorted(int(d.name) for d in path.iterdir()
                  if re.fullmatch(r"\d+", d.name))

  def wait_until_finished(self) -> None:
    """Blocks until the save in flight (if any) is written and finalized."""
    self._mngr.wait_until_finished()

  def all_steps(self) -> list[int]:
    return list(self._mngr.all_steps())

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state, data_state: dict) -> None:
    """Starts saving unless a checkpoint of ``step`` already exists.

    Returns once the arrays are on the host (the caller may then donate or
    overwrite ``state``); writing and finalizing go on in the background.

    Args:
      step: the step number.
      state: the train state (global arrays).
      data_state: this process's data iterator state (JSON-serializable).
    """
    if step in self._mngr.all_steps():
      return
    data = {"processes": _gather_json(data_state)}
    self._mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data)), force=True)

  def restore(self, like_state, step: int | None = None):
    """Restores (state, this process's data_state) of ``step`` (default: the
    newest).

    Args:
      like_state: a state with the target structure, shapes, dtypes and
        shardings (e.g. the freshly initialized one).
      step: which checkpoint.
    """
    step = self._mngr.latest_step() if step is None else step
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        like_state)
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          data=ocp.args.JsonRestore()))
    except ValueError as e:
      if "tree structures do not match" not in str(e):
        raise
      raise ValueError(
          f"the checkpoint of step {step} in {self.directory} does not fit "
          "this config's train state (a key that shapes the towers, the loss "
          "head or the optimizer differs from the run that wrote it): use a "
          "new --workdir, or that run's config") from None
    data = out["data"]
    # A checkpoint without "processes" predates per-process data states.
    per_process = data["processes"] if "processes" in data else [data]
    if len(per_process) != jax.process_count():
      raise ValueError(
          f"the checkpoint of step {step} in {self._mngr.directory} was "
          f"written by {len(per_process)} process(es), this run has "
          f"{jax.process_count()}: resume with the same process count")
    return out["state"], per_process[jax.process_index()]

  def restore_params(self, step: int | None = None):
    """The params of ``step``'s checkpoint (default: the newest).

    Restored from the checkpoint's own metadata (no target state needed), as
    host arrays, whatever devices and processes wrote it.

    Raises:
      FileNotFoundError: the directory holds no checkpoint (or not ``step``).
    """
    steps = self.all_steps()
    step = max(steps, default=None) if step is None else step
    if step is None or step not in steps:
      raise FileNotFoundError(
          f"no checkpoint {'' if step is None else f'of step {step} '}in "
          f"{self._mngr.directory} (steps: {sorted(steps)})")
    # The saved shardings name the training run's devices; a checkpoint of
    # another topology (e.g. a multi-process run) goes to one local device.
    out = self._mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(fallback_sharding=(
            jax.sharding.SingleDeviceSharding(jax.local_devices()[0])))))
    return jax.tree.map(np.asarray, out["state"]["params"])

  def close(self) -> None:
    """Waits for the save in flight, then closes; later calls do nothing (an
    interrupted close leaves the save to finish, or not, in the background:
    an incomplete checkpoint is never restored)."""
    if self._closed:
      return
    self._closed = True
    self._mngr.close()
