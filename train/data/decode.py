"""The host decoder: encoded bytes -> uint8 squares on the host's cores.

With config.data.decoder = "host" every example is decoded where it is read
(pipeline.Compact calls ``image.decode_host`` in the reader threads or the
worker processes) and no batch decoder runs. ``HostBatchDecoder`` is the
same decode behind the batch contract that the GPU decoder meets
(train/data/gpu_decode.py), for the batch path (batching.DecodedIterator)
on CPU devices and machines without a GPU, and for tests: it imports
neither the GPU decoder nor the pipeline.

The batch contract: ``decode(encoded, wheres, size)`` -> (uint8 [k, size,
size, 3] of the k members that decode, in order; bool [n]: which did;
[(i, where, reason)] for the others), ``for_device(device)``: the decoder
of one local device's shard, and ``describe()``: one line for the log.
"""
from __future__ import annotations

import copy

import numpy as np

from train.data import image as image_lib
from train.data.sources.contract import BadExample


class HostBatchDecoder:
  """The batch contract on the host (see the module doc). Its images are
  numpy; ``DecodedIterator`` puts each shard on its device, so that on CPU
  devices it runs the GPU path's per-device code."""

  name = "host"

  def __init__(self, library: str = "auto"):
    self.library = library
    self.device = None

  def for_device(self, device) -> "HostBatchDecoder":
    # A shallow copy: a subclass's state (tests record their calls) is
    # shared by the copies of every device.
    bound = copy.copy(self)
    bound.device = device
    return bound

  def describe(self) -> str:
    fast = self.library != "pillow" and image_lib.simplejpeg() is not None
    return f"host ({'simplejpeg' if fast else 'Pillow'})"

  def decode(self, encoded: list, wheres: list, size: int):
    images, ok, bad = [], np.zeros(len(encoded), bool), []
    for i, (data, where) in enumerate(zip(encoded, wheres)):
      try:
        images.append(image_lib.resize_crop(
            image_lib.decode_host(data, where, size, self.library), size))
        ok[i] = True
      except BadExample as e:
        bad.append((i, e.where, e.reason))
    out = (np.stack(images) if images
           else np.zeros((0, size, size, 3), np.uint8))
    return out, ok, bad
