"""Micro-batches decoded in batches, placed on their devices, prefetched.

The batch path of the pipeline (config.data.decoder = "gpu", or any batch
decoder): the reader threads or worker processes only read each example's
bytes and check that each JPEG is whole (``host.jpeg_problem``: a truncated
JPEG decodes silently into an image on the GPU, so it is caught on the
host, for both decoders). ``DecodedIterator`` then takes the micro-batch's
encoded images from the stream and has each local device decode its own
contiguous shard of them (``decoder.for_device(device).decode``: the GPU
decoder in train/data/decode/gpu.py, one per GPU; a decoder that answers
numpy on the host has its shards put on their devices, as the tests'
tests/host_decoder.py on CPU devices); the
micro-batch's images are one global array made from the devices' shards, in
the trainer's batch sharding. Each one that fails is replaced by the next
example of the stream, the rows after it moving up (the devices whose rows
changed decode their new members themselves). The stream of kept examples,
their order, the rows each device holds and the iterator state are then
those of the host path, so a run can resume on either decoder. ``Prefetch``
runs that on a thread with a bounded queue, so a micro-batch is decoded
while the previous one's tower step runs.

Any object with the batch contract is a decoder here (the module doc of
train/data/decode/): this module imports no decoder.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import functools
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np

from train import mesh as mesh_lib
from train.data.ledger import BadDataLedger
from train.data.ledger import CountsBadData
from train.data.stopwatch import Stopwatch


def data_sharding():
  """The trainer's batch sharding (train/mesh.py): rows over every device
  of every process, in ``jax.devices()`` order, on the "data" axis."""
  return mesh_lib.rows(mesh_lib.make_mesh())


def shard_plan(sharding, rows: int, tail: tuple):
  """Where a process-local micro-batch of ``rows`` lies in ``sharding``:
  ([(device, start, stop)] in row order, each local device's contiguous
  rows of the micro-batch; the global array's shape). ValueError in one
  line when the rows do not split into equal contiguous shards."""
  local = sharding.addressable_devices
  n_local, n_all = len(local), len(sharding.device_set)
  if rows % n_local:
    raise ValueError(
        f"a micro-batch of {rows} examples does not split over {n_local} "
        "local devices (a batch decoder decodes each device's equal shard "
        f"on that device: make the per-process micro-batch a multiple of "
        f"{n_local})")
  shape = (rows // n_local * n_all, *tail)
  spans = []
  for device, index in sharding.addressable_devices_indices_map(
      shape).items():
    start, stop, _ = index[0].indices(shape[0])
    spans.append((start, stop, device))
  spans.sort(key=lambda x: x[0])
  base, per = spans[0][0], rows // n_local
  plan = [(d, a - base, b - base) for a, b, d in spans]
  if [(a, b) for _, a, b in plan] != [(k * per, (k + 1) * per)
                                      for k in range(n_local)]:
    raise ValueError(
        f"the batch sharding {sharding} does not give each local device a "
        "contiguous, disjoint shard of the process's rows")
  return plan, shape


def _on_device(images, device):
  """A shard's decoded images on ``device``: numpy ones (the host decoder)
  are put there; a device decoder's must already be there."""
  if isinstance(images, jax.Array):
    if images.devices() != {device}:
      raise RuntimeError(
          f"the batch decoder of {device} returned images on "
          f"{', '.join(sorted(map(str, images.devices())))}")
    return images
  return jax.device_put(np.asarray(images), device)


class DecodedIterator:
  """Micro-batches of images decoded in batches, each local device
  decoding its own shard (see the module doc).

  ``inner`` is a pipeline.TrainIterator whose elements carry the encoded
  image ("encoded", bytes) and its "key" instead of "image". Each
  micro-batch is the next ``microbatch_size`` examples of that stream that
  decode. In ``sharding`` (default: the trainer's, ``data_sharding``) each
  local device holds a contiguous shard of the micro-batch's rows; the
  shard's encoded images go to that device's decoder
  (``decoder.for_device``: nvImageCodec on that GPU; on CPU devices the
  host decoder, its images put on the device), the shards are decoded side
  by side on threads, and the micro-batch's "image" is one global
  ``jax.Array`` in ``sharding`` made from the devices' own arrays
  (``jax.make_array_from_single_device_arrays``): no image crosses devices
  or comes back to the host. (It is global: with several processes it has
  every process's rows; the other fields are this process's, on the host.)

  A member that fails to decode is counted and named in the ledger, and the
  rows after it move up one, as on the host path: each device whose rows
  changed decodes the members it now holds (the next shard's first ones,
  then the next examples of the stream) from their bytes, still on the
  host, until every row is one decoded on its own device. So a bad image
  never costs the good ones of its micro-batch, and the kept examples, their
  order and the rows of each device are the host path's. The state is the
  inner iterator's, taken between micro-batches.
  """

  def __init__(self, inner, decoder, size: int, sharding=None):
    self.inner, self.decoder, self.size = inner, decoder, size
    self.microbatch_size = inner.microbatch_size
    self.sharding = data_sharding() if sharding is None else sharding
    self._plan, self._global_shape = shard_plan(
        self.sharding, self.microbatch_size, (size, size, 3))
    self._per = self.microbatch_size // len(self._plan)
    self._decoders = {}  # device -> its bound decoder
    self._pool = None
    self.clock = Stopwatch()

  @property
  def ledger(self) -> BadDataLedger:
    return self.inner.ledger

  @property
  def bad(self) -> int:
    return self.inner.ledger.bad

  @property
  def seen(self) -> int:
    return self.inner.ledger.seen

  @property
  def devices(self) -> list:
    """The local devices in the order of their shards."""
    return [d for d, _, _ in self._plan]

  def timing(self) -> dict:
    """{stage: {"wall_s", "cpu_s"}} so far: this iterator's (read: taking
    the bytes from the stream; decode: the devices' decode calls; assemble:
    the global array) and its decoders' (the GPU decoder's nvimgcodec,
    to_jax and resize, within decode; with several decoders per device,
    nvimgcodec and to_jax summed over their threads and parts their wall
    time together), summed over the devices."""
    totals = self.clock.add_to({})
    for d in {id(d): d for d in self._decoders.values()}.values():
      if hasattr(d, "clock"):
        d.clock.add_to(totals)
    return totals

  def describe(self) -> str:
    n = len(self._plan)
    return self.decoder.describe() + (
        f", one per local device ({n}), each decoding its shard"
        if n > 1 else "")

  def decoder_for(self, device):
    """The decoder of ``device``'s shards (made once)."""
    if device not in self._decoders:
      self._decoders[device] = self.decoder.for_device(device)
    return self._decoders[device]

  def _decode_shard(self, device, encoded: list, wheres: list):
    images, ok, bad = self.decoder_for(device).decode(encoded, wheres,
                                                      self.size)
    ok = np.asarray(ok, bool)
    if images.shape[0] != int(np.count_nonzero(ok)):
      raise RuntimeError(
          f"the batch decoder of {device} returned {images.shape[0]} "
          f"images for {int(np.count_nonzero(ok))} decoded members")
    return _on_device(images, device), ok, bad

  def _decode(self, todo: list, encoded: list, keys: list) -> list:
    """[(device, member ids)] -> [(images on device, ok, bad)], the devices
    side by side."""
    jobs = [(d, [encoded[j] for j in js], [keys[j] for j in js])
            for d, js in todo]
    if len(jobs) == 1:
      return [self._decode_shard(*jobs[0])]
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          len(self._plan), thread_name_prefix="decode-shard")
    futures = [self._pool.submit(self._decode_shard, *job) for job in jobs]
    return [f.result() for f in futures]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    m, per, ledger = self.microbatch_size, self._per, self.inner.ledger
    # The members read so far (stream order): their host fields (chunks of
    # ``take``), bytes and keys; good[j]: None until decoded, then whether
    # it decoded; done[(j, device)]: (images, row) where it did there.
    chunks, encoded, keys, good, done = [], [], [], [], {}

    def read(n):
      with self.clock("read"):
        raw = self.inner.take(n)
      encoded.extend(raw.pop("encoded"))
      keys.extend(raw.pop("key"))
      chunks.append(raw)
      good.extend([None] * n)

    read(m)
    # The common case first: every device decodes its whole shard. Then the
    # micro-batch is the devices' arrays as they are, with no per-member
    # bookkeeping in Python (the general loop below gives the same).
    todo = [(d, list(range(a, b))) for d, a, b in self._plan]
    with self.clock("decode"):
      results = self._decode(todo, encoded, keys)
    if all(not bad for _, _, bad in results):
      ledger.check()
      ledger.add_good(m)
      with self.clock("assemble"):
        return self._whole(results, chunks[0])
    for (device, js), (images, ok, _) in zip(todo, results):
      for row, j in enumerate(np.asarray(js)[ok]):
        done[(int(j), device)] = (images, row)
        good[j] = True
    failed = []
    for (device, js), (_, _, bad) in zip(todo, results):
      for i, where, reason in bad:
        good[js[i]] = False
        failed.append((js[i], where, reason))
    for _, where, reason in sorted(failed, key=lambda x: x[0]):
      ledger.add_bad(where, reason)
    ledger.check()
    while True:
      rows = [j for j, g in enumerate(good) if g is not False]
      if len(rows) < m:
        read(m - len(rows))
        continue
      rows = rows[:m]  # rows[r]: the member at row r of the micro-batch
      todo = {}
      for r, j in enumerate(rows):
        device = self._plan[r // per][0]
        if (j, device) not in done:
          todo.setdefault(device, []).append(j)
      if not todo:
        break
      todo = [(d, todo[d]) for d in self.devices if d in todo]
      failed = []
      with self.clock("decode"):
        results = self._decode(todo, encoded, keys)
      for (device, js), (images, ok, bad) in zip(todo, results):
        for row, j in enumerate(np.asarray(js)[ok]):
          done[(int(j), device)] = (images, row)
          good[j] = True
        for i, where, reason in bad:
          if good[js[i]] is not False:  # counted once, wherever it failed
            good[js[i]] = False
            failed.append((js[i], where, reason))
      for _, where, reason in sorted(failed, key=lambda x: x[0]):
        ledger.add_bad(where, reason)
      ledger.check()
    ledger.add_good(m)
    with self.clock("assemble"):
      return self._assemble(rows, done, chunks)

  def _whole(self, results: list, fields: dict) -> dict:
    """The micro-batch when every device decoded its whole shard: the host
    fields of the one ``take``, the images the devices' own arrays."""
    out = dict(fields)
    out["image"] = jax.make_array_from_single_device_arrays(
        self._global_shape, self.sharding, [images for images, _, _ in results])
    return out

  def _assemble(self, rows: list, done: dict, chunks: list) -> dict:
    arrays = []
    for device, start, stop in self._plan:
      runs = []  # [images, first row, end row] taken whole from one call
      for j in rows[start:stop]:
        images, row = done[(j, device)]
        if runs and runs[-1][0] is images and runs[-1][2] == row:
          runs[-1][2] += 1
        else:
          runs.append([images, row, row + 1])
      if len(runs) == 1 and runs[0][1] == 0 and (
          runs[0][2] == runs[0][0].shape[0]):
        arrays.append(runs[0][0])  # the common case: one call, no failure
      else:
        arrays.append(jnp.concatenate([x[a:b] for x, a, b in runs]))
    out = {k: np.concatenate([c[k] for c in chunks])[rows]
           for k in chunks[0]}
    out["image"] = jax.make_array_from_single_device_arrays(
        self._global_shape, self.sharding, arrays)
    return out

  def next_batch(self, num_microbatches: int) -> dict:
    return _next_batch(self, num_microbatches)

  def get_state(self) -> dict:
    return self.inner.get_state()

  def set_state(self, state: dict) -> None:
    self.inner.set_state(state)

  def close(self):
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None
    for d in {id(d): d for d in self._decoders.values()}.values():
      if hasattr(d, "close"):
        d.close()  # its own threads (the GPU decoder's)
    self.inner.close()


def _next_batch(it, num_microbatches: int) -> dict:
  """``num_microbatches`` micro-batches of ``it`` as one batch: the host
  fields concatenated by numpy, the device images by ``_concatenate``."""
  parts = [next(it) for _ in range(num_microbatches)]
  out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
         if k != "image"}
  out["image"] = _concatenate([p["image"] for p in parts])
  return out


def _concatenate(arrays):
  if isinstance(arrays[0], np.ndarray):
    return np.concatenate(arrays)
  return jnp.concatenate(arrays)


class _Raised:
  def __init__(self, error):
    self.error = error


def _stop_thread(stop, thread):
  stop.set()
  thread.join(timeout=10)


class Prefetch(CountsBadData):
  """An iterator run ``depth`` micro-batches ahead on a thread.

  The queue is bounded, so the images held ahead (on the device, for the
  GPU decoder) are at most ``depth`` micro-batches. Each micro-batch
  travels with the iterator state taken just after it, so ``get_state``
  is the state after the last micro-batch handed out (what a checkpoint
  must hold), and ``ledger`` counts the bad examples up to there, not the
  ones the thread has passed ahead. An error of the iterator (too much bad
  data) is raised where its micro-batch would have been.
  """

  def __init__(self, iterator, depth: int = 2):
    self.iterator, self.depth = iterator, max(1, depth)
    self.microbatch_size = iterator.microbatch_size
    self._thread, self._queue, self._stop = None, None, None
    # The state after the last micro-batch handed out (while the thread
    # runs; the iterator's own is ahead of it), and its ledger.
    self._state, self._ledger = None, None
    self.clock = Stopwatch()

  def _start(self):
    self._state, self._ledger = self.iterator.get_state(), None
    self._queue = queue.Queue(maxsize=self.depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(
        self._queue, self._stop), daemon=True, name="decode-prefetch")
    self._thread.start()
    # A run that ends without closing the iterator (the trainer's does)
    # stops the thread before the interpreter abandons it mid-decode.
    self._at_exit = functools.partial(_stop_thread, self._stop, self._thread)
    atexit.register(self._at_exit)

  def _run(self, q, stop):
    while not stop.is_set():
      try:
        item = (next(self.iterator), self.iterator.get_state())
      except Exception as e:  # pylint: disable=broad-except
        item = _Raised(e)
      with self.clock("queue_full"):  # ahead by depth: the consumer is behind
        while not stop.is_set():
          try:
            q.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
      if isinstance(item, _Raised):
        return

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._thread is None:
      self._start()
    item = self._queue.get()
    if isinstance(item, _Raised):
      self.close()
      raise item.error
    batch, self._state = item
    self._ledger = None
    return batch

  def next_batch(self, num_microbatches: int) -> dict:
    return _next_batch(self, num_microbatches)

  @property
  def ledger(self) -> BadDataLedger:
    if self._thread is None:
      return self.iterator.ledger
    if self._ledger is None:
      inner = self.iterator.ledger
      self._ledger = BadDataLedger(inner.max_fraction, inner.min_seen,
                                   inner.log_first, inner.what)
      self._ledger.set_state(self._state["bad_data"])
    return self._ledger

  def describe(self) -> str:
    return self.iterator.describe()

  def timing(self) -> dict:
    """The thread's time per stage: the iterator's
    (``DecodedIterator.timing``) and queue_full, waiting for room."""
    inner = self.iterator.timing() if hasattr(self.iterator, "timing") else {}
    return self.clock.add_to(inner)

  def get_state(self) -> dict:
    return self._state if self._thread is not None else (
        self.iterator.get_state())

  def set_state(self, state: dict) -> None:
    self.close()
    self.iterator.set_state(state)

  def close(self):
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      atexit.unregister(self._at_exit)
      self._thread = None
      # The thread ran ahead: continue from the consumer's position.
      self.iterator.set_state(self._state)
      self._state, self._ledger = None, None
    self.iterator.close()
