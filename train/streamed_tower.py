"""A locked image tower run on the fly, one micro-batch at a time.

The global batch of images never exists at once, on the host or the device:
a step pulls its micro-batches (uint8 images + int32 tokens) from the input
pipeline one after the other; each is put on the devices (``jax.device_put``
through ``make_array_from_process_local_data``, asynchronous) and embedded by
``Tower.embed`` (the resize from ``config.data.decode_size`` when set, the
normalisation and the cast happen on the device). JAX
dispatches asynchronously, so while micro-batch c is embedded the host
decodes and transfers c+1; at most ``depth`` micro-batches are in flight, so
the device holds only their images. What stays is the (B, D) float32 image
embeddings; the step then runs the text tower under GradCache and one exact
loss over the global batch (``make_grad_fn(..., precomputed=True)``).

Layout. Device d keeps its rows of every micro-batch: its shard of the step's
batch is [piece(0, d), piece(1, d), ...], and GradCache's chunk c on device d
is piece(c, d). ``device_major`` puts a host batch in that order, so the
streamed step and the whole-batch step (``make_grad_fn`` with images) see the
same examples on the same devices in the same chunks, and give the same loss.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from train import mesh as mesh_lib
from train import step as step_lib
from train.mesh import AXIS


def device_major(parts: list[np.ndarray], num_local_devices: int) -> np.ndarray:
  """Host micro-batches [k x (m, ...)] -> (k*m, ...) in the order where each
  local device's block is its rows of micro-batch 0, then 1, ...

  Micro-batches that are already global arrays sharded by rows over the
  devices (config.data.decoder="gpu": each device decoded its own rows)
  stay there: each device concatenates its own pieces, and the result is
  the global array in the same sharding."""
  if all(isinstance(p, jax.Array) for p in parts) and _row_sharded(
      parts, num_local_devices):
    return _concat_per_device(parts)
  xp = np if all(isinstance(p, np.ndarray) for p in parts) else jnp
  x = xp.stack(parts)
  k, m = x.shape[:2]
  n = num_local_devices
  if m % n:
    raise ValueError(f"micro-batch of {m} rows does not split over {n} "
                     "local devices")
  x = x.reshape(k, n, m // n, *x.shape[2:]).swapaxes(0, 1)
  return x.reshape(k * m, *x.shape[3:])


def _row_sharded(parts: list, num_local_devices: int) -> bool:
  """Whether the parts share one shape and one sharding that splits their
  rows into disjoint blocks, one per local device."""
  first = parts[0]
  if len(first.sharding.addressable_devices) != num_local_devices or any(
      p.sharding != first.sharding or p.shape != first.shape for p in parts):
    return False
  shards = first.addressable_shards
  spans = {s.index[0].indices(first.shape[0])[:2] for s in shards}
  return len(spans) == len(shards) and all(
      i == slice(None) for s in shards for i in s.index[1:])


def _concat_per_device(arrays: list):
  """Global arrays sharded by rows -> one whose device d block is its
  blocks of arrays[0], arrays[1], ... (nothing crosses devices)."""
  if len(arrays) == 1:
    return arrays[0]
  pieces = collections.defaultdict(list)
  for a in arrays:
    for s in a.addressable_shards:
      pieces[s.device].append(s.data)
  shape = (sum(a.shape[0] for a in arrays), *arrays[0].shape[1:])
  return jax.make_array_from_single_device_arrays(
      shape, arrays[0].sharding,
      [jnp.concatenate(pieces[d]) for d in pieces])


def make_embed(mesh, tower):
  """The jitted data-parallel ``embed(params, uint8 images) -> (m, D)``
  float32 of a streamed micro-batch (each device its rows)."""
  return jax.jit(jax.shard_map(
      tower.embed, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(AXIS),
      check_vma=False))


class StreamedImageTower:
  """Embeds a step's images micro-batch by micro-batch (see module doc).

  Args:
    mesh: the 1-D "data" mesh of the step.
    tower: the locked ``train.towers.Tower``.
    params: its params, replicated on ``mesh`` (a copy the step does not
      donate).
    depth: micro-batches in flight on the device.
    embed: the embedding call (``make_embed``; default: made here).
    progress: a ``StepProgress`` told of each step's micro-batches.
  """

  def __init__(self, mesh, tower, params, depth: int = 2, embed=None,
               progress: "StepProgress | None" = None):
    self.mesh, self.params, self.depth = mesh, params, max(1, depth)
    self._sharding = mesh_lib.rows(mesh)
    self._embed = embed if embed is not None else make_embed(mesh, tower)
    self.progress = progress

  def embed_microbatch(self, images: np.ndarray):
    """Process-local uint8 (m, C, C, 3) -> global float32 (M, D) on "data"
    (C: the host's size, the tower's or data.decode_size). Images already
    global on "data" (config.data.decoder="gpu": each device decoded its
    rows) are embedded where they are."""
    return self._embed(self.params,
                       step_lib.to_global(self._sharding, images))

  def step_inputs(self, iterator, num_microbatches: int) -> dict:
    """Pulls ``num_microbatches`` micro-batches and returns the step's
    {"image_emb": (B, D), "text": (B, L)} global arrays (and "group": (B,)
    when the micro-batches carry group ids)."""
    embs, texts, groups, in_flight = [], [], [], collections.deque()
    if self.progress is not None:
      self.progress.embedding(num_microbatches, embs)
    for _ in range(num_microbatches):
      mb = next(iterator)
      e = self.embed_microbatch(mb["image"])
      if self.progress is not None and not embs:
        self.progress.set_images_per_microbatch(int(e.shape[0]))
      embs.append(e)
      texts.append(mb["text"])
      if "group" in mb:
        groups.append(mb["group"])
      in_flight.append(e)
      if len(in_flight) > self.depth:
        # Bounds the images on the device (and the host's lead).
        in_flight.popleft().block_until_ready()
    n_local = len(self.mesh.local_devices)
    out = {"image_emb": self.assemble(embs),
           "text": jax.make_array_from_process_local_data(
               self._sharding, device_major(texts, n_local))}
    if groups:
      out["group"] = jax.make_array_from_process_local_data(
          self._sharding, device_major(groups, n_local))
    return out

  def assemble(self, embs: list):
    """Micro-batch embeddings -> one (B, D) array, device-major: each
    device concatenates its own pieces (nothing crosses devices)."""
    return _concat_per_device(embs)


class StepProgress:
  """Lines about a long step, at least every ``interval_s``, from a thread.

  The trainer tells it when a step begins and when its program is
  dispatched (with an array of its results); a streamed step also passes
  its list of micro-batch embeddings as they are dispatched
  (``StreamedImageTower``). Once a step has lasted ``interval_s``, a line
  every ``interval_s`` says how far it got: the micro-batches embedded (the
  leading ones whose embeddings are ready), the images per second since
  the step began, and the time left to embed (plus the text tower and loss,
  as long as the previous step's took); then, while the step's program
  runs, for how long it has run. Short steps print nothing. ``say`` None:
  silent (no thread).
  """

  def __init__(self, say: Callable[[str], None] | None,
               interval_s: float = 10.0, clock=time.monotonic,
               tag: str = "[lit]"):
    self.say, self.interval_s, self.clock = say, interval_s, clock
    self.tag = tag
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = None
    self._step = None  # The step in progress (None: none).
    self._t0 = self._last = 0.0
    self._total, self._each, self._embs, self._ready = 0, 0, None, 0
    self._offset = 0  # The micro-batch of self._embs[0].
    self._embedded_at = None  # When its last embedding was seen ready.
    self._out, self._dispatched_at = None, None
    self._prev_out, self._prev_step = None, None
    self._after_s = None  # The last step's time after its embedding.
    self.lines = 0

  def step_begins(self, step: int) -> None:
    if self.say is None:
      return
    with self._lock:
      if self._out is not None and not _ready(self._out):
        self._prev_out, self._prev_step = self._out, self._step
      self._step, self._t0 = step, self.clock()
      self._last = self._t0
      self._total, self._each, self._embs, self._ready = 0, 0, None, 0
      self._offset = 0
      self._embedded_at, self._out, self._dispatched_at = None, None, None
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, daemon=True,
                                      name="step-progress")
      self._thread.start()

  def embedding(self, total: int, embs: list) -> None:
    """The step embeds ``total`` micro-batches into ``embs`` (appended to
    as they are dispatched)."""
    if self.say is None:
      return
    with self._lock:
      self._total, self._embs, self._ready, self._offset = total, embs, 0, 0

  def set_images_per_microbatch(self, n: int) -> None:
    self._each = n

  def step_dispatched(self, out) -> None:
    """The step's program is queued; ``out`` is ready when it has run."""
    if self.say is None:
      return
    with self._lock:
      self._out, self._dispatched_at = out, self.clock()
      if self._embs is not None:
        self._count_ready()
        # Only the embeddings still running are watched from here on: the
        # others' memory is the step's to free.
        self._embs = self._embs[self._ready - self._offset:]
        self._offset = self._ready

  def close(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def _count_ready(self) -> int:
    embs, offset = self._embs, self._offset
    while (self._ready - offset < len(embs)
           and _ready(embs[self._ready - offset])):
      self._ready += 1
      if self._ready == self._total:
        self._embedded_at = self.clock()
    return self._ready

  def _wake_s(self) -> float:
    return min(1.0, max(0.005, self.interval_s / 10))

  def _run(self):
    while not self._stop.wait(self._wake_s()):
      with self._lock:
        line = self._line()
      if line:
        self.say(line)
        self.lines += 1

  def _line(self):
    """The line due now, or None."""
    if self._step is None:
      return None
    now = self.clock()
    if self._out is not None and _ready(self._out):
      if self._dispatched_at is not None and self._embedded_at is not None:
        self._after_s = now - max(self._dispatched_at, self._embedded_at)
      self._step, self._embs = None, None  # Done: nothing more to say.
      return None
    # Due: the step is an interval old, and the last line is (less one
    # wake-up, so that the lines are at most an interval apart).
    due = self.interval_s - self._wake_s()
    if now - self._last < due or now - self._t0 < due:
      return None
    self._last = now
    elapsed = now - self._t0
    head = f"{self.tag} step {self._step}, {elapsed:.0f} s in: "
    if not self._total:
      if self._out is None:
        return head + "building its batch"
      return head + f"running for {now - self._dispatched_at:.0f} s"
    done, total, each = self._count_ready(), self._total, self._each
    rate = done * each / max(1e-9, (self._embedded_at or now) - self._t0)
    head += f"{done}/{total} micro-batches embedded"
    if each:
      head += (f" ({done * each:,} of {total * each:,} images, "
               f"{rate:,.0f} img/s)")
    if done == total:
      since = now - self._embedded_at
      left = (f", ~{max(0.0, self._after_s - since):.0f} s left"
              if self._after_s is not None else "")
      return head + f"; text tower and loss running for {since:.0f} s{left}"
    if rate > 0:
      after = (f" + ~{self._after_s:.0f} s of text tower and loss"
               if self._after_s is not None else "")
      head += f", ~{(total - done) * each / rate:.0f} s left to embed{after}"
    if not done and self._prev_out is not None and not _ready(self._prev_out):
      head += (f"; the device is still on step {self._prev_step}'s text "
               "tower and loss")
    elif not self._embs and self._out is None:
      head += "; waiting for its first micro-batch from the input"
    return head


def _ready(x) -> bool:
  """Whether a jax array (or anything else: yes) has been computed."""
  is_ready = getattr(x, "is_ready", None)
  return True if is_ready is None else bool(is_ready())
