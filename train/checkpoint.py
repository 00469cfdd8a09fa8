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

import functools
import importlib.util
import json
import os
import re

from etils import epath
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp


def gather_json(obj) -> list:
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
# TensorStore, its metadata through etils.epath (fsspec: gcsfs for gs://,
# s3fs for s3://). A checkpoint there is written in place and marked
# complete by a commit_success.txt written last (orbax's COMMIT_FILE
# atomicity: an object store has no atomic rename); one without it is never
# restored.
REMOTE_SCHEMES = ("gs://", "s3://")


def is_remote(directory: str) -> bool:
  return "://" in directory


def check_directory(directory: str, what: str = "config.checkpoint.directory"
                    ) -> None:
  """One-line ValueError unless orbax can hold checkpoints at ``directory``
  (a local or mounted path, gs:// with gcsfs, s3:// with s3fs)."""
  if not directory or not is_remote(directory):
    return
  scheme = directory.split("://", 1)[0]
  if not directory.startswith(REMOTE_SCHEMES):
    raise ValueError(
        f"{what}={directory}: orbax-checkpoint cannot write checkpoints to "
        f"{scheme}:// (it writes to local or mounted directories, gs:// and "
        "s3://)")
  module = {"gs": "gcsfs", "s3": "s3fs"}[scheme]
  if importlib.util.find_spec(module) is None:
    raise ValueError(f"{what}={directory}: {scheme}:// needs {module} (pip "
                     "install 'infcl-jax[cloud]')")
  if scheme == "s3" and _tensorstore_builder() is None:
    raise ValueError(
        f"{what}={directory}: this orbax-checkpoint builds its TensorStore "
        "specs elsewhere than train/checkpoint.py expects (see "
        "_s3_kvstores); use gs:// or a local or mounted directory")


def _tensorstore_builder():
  """orbax's builder of TensorStore kvstore specs (one function every array
  read and write goes through), or None where this orbax has none."""
  try:
    # Lazy: a private module of orbax's, which another version may lack.
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return getattr(tensorstore_utils, "build_kvstore_tspec", None)


def s3_kvstore(bucket: str, path: str) -> dict:
  """TensorStore's S3 kvstore of ``bucket``/``path``, with the endpoint and
  region of the S3 clients' standard environment (AWS_ENDPOINT_URL_S3 or
  AWS_ENDPOINT_URL, AWS_REGION or AWS_DEFAULT_REGION; credentials: AWS_*,
  ~/.aws, the instance's role, as TensorStore reads them)."""
  spec = {"driver": "s3", "bucket": bucket, "path": path}
  endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3")
              or os.environ.get("AWS_ENDPOINT_URL"))
  if endpoint:
    spec["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get(
      "AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID"):
    # The environment's keys: TensorStore's default chain would also try
    # (and log its failure to find) a profile and a web identity.
    spec["context"] = {"aws_credentials": {"type": "environment"}}
  return spec


def _s3_kvstores() -> None:
  """Lets orbax keep arrays on s3:// through TensorStore's S3 driver.

  orbax-checkpoint 0.12 builds the TensorStore kvstore spec of an array
  from its checkpoint directory for local paths and gs:// only
  (``build_kvstore_tspec``; it takes no option and no handler that names
  another kvstore), although TensorStore has an S3 driver. Wrapped here:
  an s3:// directory gets the spec orbax builds for the same bucket and
  path on gs:// (OCDBT, per-process databases, read coalescing), with
  TensorStore's S3 kvstore (``s3_kvstore``) in place of its GCS one;
  every other directory, orbax's own spec. The bytes are written and read
  by TensorStore; nothing of orbax's is copied.
  """
  # Lazy: see _tensorstore_builder (an s3:// directory has checked it).
  from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  build = tensorstore_utils.build_kvstore_tspec
  if getattr(build, "with_s3", False):
    return

  def swap(spec):
    if isinstance(spec, dict):
      if spec.get("driver") in ("gcs", "gcs_grpc") and "bucket" in spec:
        return s3_kvstore(spec["bucket"], spec.get("path", ""))
      return {k: swap(v) for k, v in spec.items()}
    return spec

  @functools.wraps(build)
  def build_with_s3(directory, *args, **kwargs):
    text = os.fspath(directory) if not isinstance(directory, str) else (
        directory)
    if not text.startswith("s3:/"):
      return build(directory, *args, **kwargs)
    return swap(build("gs://" + text[len("s3:/"):].lstrip("/"), *args,
                      **kwargs))

  build_with_s3.with_s3 = True
  tensorstore_utils.build_kvstore_tspec = build_with_s3


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
    # Written in place, complete once commit_success.txt is (see above).
    self._commit_file = self.directory.startswith(REMOTE_SCHEMES)
    extra = {}
    if self.directory.startswith("s3://"):
      _s3_kvstores()
      extra["atomicity_options"] = ocp.options.AtomicityOptions(
          mode=ocp.options.AtomicityMode.COMMIT_FILE)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True,
        enable_async_checkpointing=asynchronous,
        cleanup_tmp_directories=True, **extra)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data"))

  def latest_step(self) -> int | None:
    """The newest step saved, including a save still in flight."""
    return self._mngr.latest_step()

  def finalized_steps(self) -> list[int]:
    """The steps whose checkpoints are complete on disk (orbax renames a
    checkpoint to its plain step number only when it is complete; on an
    object store it writes commit_success.txt last)."""
    path = epath.Path(self.directory)
    if not path.is_dir():
      return []
    return sorted(int(d.name) for d in path.iterdir()
                  if re.fullmatch(r"\d+", d.name) and (
                      not self._commit_file
                      or (d / "commit_success.txt").exists()))

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
    data = {"processes": gather_json(data_state)}
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
