"""The host memory of the input path is bounded by the micro-batch, not the
batch: what the trainer streams must not pile up on the host.

- A micro-batch's images go into a reused buffer, but never into one the
  caller (or a zero-copy device array) still holds.
- A streamed step's peak host memory does not grow with its number of
  micro-batches.
- Worker processes read ahead by about prefetch_batches micro-batches in
  all, whatever their number (each reading ahead by the whole prefetch
  buffer held num_workers times that: 61 GiB with 16 workers at 8192 x 256
  px on an H200 host).
"""
import os
import time
import tracemalloc

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh

from train import step as step_lib
from train import streamed_tower
from train.data import config as data_config
from train.data import pipeline
from tests.test_stream import _parts

S = 16  # _parts' image size.


class PixelSource:
  """Examples whose images are uint8 arrays already (nothing to decode);
  with ``log_dir``, each read appends its index to a file of the reading
  process, so a test can count what the workers read."""

  def __init__(self, num, size=S, log_dir=None):
    self.spec = f"pixels:{num}x{size}"
    self.bad_at_open = []
    self._num, self._size, self._log_dir = num, size, log_dir

  def __len__(self):
    return self._num

  def __getitem__(self, index):
    if self._log_dir:
      with open(os.path.join(self._log_dir, f"{os.getpid()}.log"), "a") as f:
        f.write(f"{index}\n")
    image = np.full((self._size, self._size, 3), index % 251, np.uint8)
    return {"key": f"{index:06d}", "image": image,
            "captions": [f"caption {index % 7}"], "label": -1}


def _config(**data):
  config = ml_collections.ConfigDict()
  config.data = data_config.default_data_config()
  config.tokenizer = data_config.default_tokenizer_config()
  config.tokenizer.max_len = 8
  config.data.image_size = S
  config.data.cache_max_mb = 0
  config.data.num_threads = 1
  for k, v in data.items():
    config.data[k] = v
  return config


def _iterator(num=4096, mb=8, log_dir=None, **data):
  return pipeline.make_train_iterator(
      _config(**data), batch_size=mb, microbatch_size=mb, seed=0,
      source=PixelSource(num, log_dir=log_dir))


def test_reused_image_buffers_never_overwrite_a_held_micro_batch():
  want = [m["image"].copy() for m in
          (next(it) for it in [_iterator()] for _ in range(8))]
  it = _iterator()
  a = next(it)
  b = next(it)
  assert not np.shares_memory(a["image"], b["image"])
  pointer = a["image"].ctypes.data
  del a  # Nobody holds micro-batch 0 now: its buffer is used again.
  c = next(it)
  assert c["image"].ctypes.data == pointer
  # A view, and a zero-copy CPU device array, hold theirs.
  view = b["image"][1:]
  on_device = jax.device_put(c["image"])
  del b, c
  got = [next(it) for _ in range(5)]
  for m in got:
    assert not np.shares_memory(m["image"], view)
    assert m["image"].ctypes.data != on_device.unsafe_buffer_pointer()
  np.testing.assert_array_equal(view, want[1][1:])
  np.testing.assert_array_equal(np.asarray(on_device), want[2])
  for m, w in zip(got, want[3:]):
    np.testing.assert_array_equal(m["image"], w)
  it.close()


def _streamed_peak(num_microbatches, mb, c):
  """tracemalloc's peak over a streamed step's inputs (uint8 c x c images,
  resized on the device to the tower's S), after one step as warm-up."""
  tower, _, _, params, _, _ = _parts()
  mesh = Mesh(np.array(jax.devices()[:1]), (step_lib.AXIS,))
  streamer = streamed_tower.StreamedImageTower(mesh, tower, params["img"],
                                           depth=2)
  it = pipeline.make_train_iterator(
      _config(decode_size=c), batch_size=mb, microbatch_size=mb, seed=0,
      source=PixelSource(4096, size=c))
  # Warm: compiled (assembling k pieces is its own program), buffers made.
  jax.block_until_ready(streamer.step_inputs(it, num_microbatches))
  tracemalloc.start()
  try:
    base = tracemalloc.get_traced_memory()[0]
    inputs = streamer.step_inputs(it, num_microbatches)
    jax.block_until_ready(inputs)
    peak = tracemalloc.get_traced_memory()[1] - base
  finally:
    tracemalloc.stop()
    it.close()
  return peak


def test_streamed_step_host_peak_does_not_grow_with_micro_batches():
  mb, c = 64, 48
  image_bytes = mb * c * c * 3
  few, many = _streamed_peak(8, mb, c), _streamed_peak(32, mb, c)
  # Holding the images of the 24 more micro-batches would add 24 *
  # image_bytes; the text tokens that legitimately grow add 0.2 of one, and
  # what the pipeline holds ahead (a few chunks) is bounded.
  assert few > image_bytes  # It measures the micro-batches at all.
  assert many - few < 4 * image_bytes, (few, many, image_bytes)


def _reads(log_dir):
  n = 0
  for name in os.listdir(log_dir):
    with open(os.path.join(log_dir, name)) as f:
      n += sum(1 for _ in f)
  return n


@pytest.mark.slow
def test_worker_read_ahead_is_bounded_whatever_the_workers(tmp_path):
  mb, workers, batches = 512, 4, 2
  it = _iterator(num=64 * mb, mb=mb, log_dir=str(tmp_path),
                 num_workers=workers, prefetch_batches=batches)
  try:
    for _ in range(2):
      next(it)
    # Let every buffer fill (reads stop once they are all full).
    last, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + 120
    while time.monotonic() - stable_since < 3 and time.monotonic() < deadline:
      time.sleep(0.5)
      n = _reads(tmp_path)
      if n != last:
        last, stable_since = n, time.monotonic()
    ahead = last - 2 * mb
  finally:
    it.close()
  # prefetch_batches micro-batches, one being assembled, and a few chunks per
  # worker in hand (pipeline.worker_buffers); each worker reading ahead by
  # the whole prefetch buffer would be 16 micro-batches here.
  bound = (batches + 1) * mb + 4 * workers * pipeline.CHUNK
  assert 0 < ahead <= bound, (ahead, bound)
