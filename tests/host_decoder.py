"""The batch contract on the host, for tests: ``HostBatchDecoder``.

The product decodes on the host per example, where it is read
(config.data.decoder = "host": train/data/decode/host.py), and runs a batch
decoder only for the GPU (train/data/decode/gpu.py). This is the same host
decode behind the batch contract (train/data/decode/__init__.py), so that
the batch path (train/data/batching.py ``DecodedIterator``) and the GPU
decoder's results can be tested on CPU devices: its images are numpy, which
``DecodedIterator`` puts on each shard's device.
"""
from __future__ import annotations

import copy

import numpy as np

from train.data.decode import host as host_lib
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
    fast = self.library != "pillow" and host_lib.simplejpeg() is not None
    return f"host ({'simplejpeg' if fast else 'Pillow'})"

  def decode(self, encoded: list, wheres: list, size: int):
    images, ok, bad = [], np.zeros(len(encoded), bool), []
    for i, (data, where) in enumerate(zip(encoded, wheres)):
      try:
        images.append(host_lib.resize_crop(
            host_lib.decode_host(data, where, size, self.library), size))
        ok[i] = True
      except BadExample as e:
        bad.append((i, e.where, e.reason))
    out = (np.stack(images) if images
           else np.zeros((0, size, size, 3), np.uint8))
    return out, ok, bad
