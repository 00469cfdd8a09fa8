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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import step as step_lib


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


class StreamedImageTower:
  """Embeds a step's images micro-batch by micro-batch (see module doc).

  Args:
    mesh: the 1-D "data" mesh of the step.
    tower: the locked ``train.towers.Tower``.
    params: its params, replicated on ``mesh`` (a copy the step does not
      donate).
    depth: micro-batches in flight on the device.
  """

  def __init__(self, mesh, tower, params, depth: int = 2):
    self.mesh, self.params, self.depth = mesh, params, max(1, depth)
    self._sharding = NamedSharding(mesh, P(step_lib.AXIS))
    self._embed = jax.jit(jax.shard_map(
        tower.embed, mesh=mesh, in_specs=(P(), P(step_lib.AXIS)),
        out_specs=P(step_lib.AXIS), check_vma=False))

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
    for _ in range(num_microbatches):
      mb = next(iterator)
      e = self.embed_microbatch(mb["image"])
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
