"""Image decoders: encoded bytes -> uint8 squares, on the host or the GPU.

    config.data.decoder = "host"   # the reader threads / worker processes
    config.data.decoder = "gpu"    # nvImageCodec (nvJPEG) on the device
    config.data.decoder = "auto"   # "gpu" when the extra and a GPU are there

With "host" every example is decoded where it is read (``Compact`` in
pipeline.py calls ``decode_host``): libjpeg-turbo through ``simplejpeg``
when it is installed (about twice Pillow's rate per core, and bitwise
Pillow's pixels: the same library, at the same DCT scale as Pillow's draft
mode), else Pillow.

With "gpu" the reader threads only read the bytes and check that each JPEG
is whole (``jpeg_problem``: a truncated JPEG decodes silently into an
image on the GPU, so it is caught here, on the host, for both decoders).
``DecodedIterator`` then takes the micro-batch's encoded images from the
stream, decodes them in one batch call (``BatchDecoder.decode``: the GPU
decoder in train/data/gpu_decode.py; ``HostBatchDecoder`` here runs the
same contract on the host, for tests and machines without a GPU), and
tops the micro-batch up with the next examples of the stream for each one
that fails. The stream of kept examples, their order and the iterator
state are then those of the host path, so a run can resume on either
decoder. ``Prefetch`` runs that on a thread with a bounded queue, so a
micro-batch is decoded while the previous one's tower step runs.
"""
from __future__ import annotations

import atexit
import functools
import queue
import threading

import numpy as np

from train.data.source import BadDataLedger
from train.data.source import BadExample

DECODERS = ("host", "gpu", "auto")
SOURCE_KINDS = ("webdataset", "table")  # the sources that carry bytes

_SOI = b"\xff\xd8"
_EOI = b"\xff\xd9"
# Markers without a length field: TEM, RST0..7, SOI.
_STANDALONE = frozenset([0x01, 0xD8] + list(range(0xD0, 0xD8)))


def is_jpeg(data) -> bool:
  return bytes(data[:2]) == _SOI


def jpeg_problem(data) -> str:
  """"" for a JPEG whose marker structure is whole, else why it is not.

  Walks the header segments from SOI to the first scan (SOS), then looks
  for the end-of-image marker after it. In entropy-coded data a 0xFF byte
  is always followed by 0x00 or a restart marker, so an EOI there is the
  end of the image: a file cut anywhere past its header has none. Not a
  JPEG (no SOI): "" (the decoder names it).
  """
  data = bytes(data)
  if not data.startswith(_SOI):
    return ""
  n, pos = len(data), 2
  while True:
    if pos >= n:
      return f"truncated JPEG: its header ends at byte {n}, before any scan"
    if data[pos] != 0xFF:
      return f"corrupt JPEG: no marker at byte {pos} of its header"
    while pos < n and data[pos] == 0xFF:  # fill bytes
      pos += 1
    if pos >= n:
      return f"truncated JPEG: its header ends at byte {n}, before any scan"
    marker = data[pos]
    pos += 1
    if marker in _STANDALONE:
      continue
    if marker == 0xD9:
      return "corrupt JPEG: end-of-image marker before any scan"
    if pos + 2 > n:
      return f"truncated JPEG: its header ends at byte {n}, before any scan"
    length = int.from_bytes(data[pos:pos + 2], "big")
    if length < 2:
      return f"corrupt JPEG: segment length {length} at byte {pos}"
    if pos + length > n:
      return (f"truncated JPEG: a header segment needs {pos + length} "
              f"bytes, the file has {n}")
    pos += length
    if marker == 0xDA:  # SOS: entropy-coded data follows.
      break
  if data.find(_EOI, pos) < 0:
    return (f"truncated JPEG: no end-of-image marker after its scan data "
            f"({n} bytes)")
  return ""


def _simplejpeg():
  try:
    import simplejpeg  # pylint: disable=import-outside-toplevel
    return simplejpeg
  except ImportError:
    return None


def _draft_scale(h: int, w: int, size: int) -> int:
  # Pillow's JpegImageFile.draft: the largest of 8, 4, 2 that keeps both
  # sides >= size (floor-divided), else 1.
  if not size:
    return 1
  scale = min(w // size, h // size)
  return next((s for s in (8, 4, 2) if scale >= s), 1)


def _decode_simplejpeg(sj, data, size: int):
  h, w, _, _ = sj.decode_jpeg_header(data)
  s = _draft_scale(h, w, size)
  # libjpeg-turbo picks the smallest of its M/8 scales that reaches the
  # minimum: asking for ceil(side / s) gives exactly 1/s, Pillow's scale.
  return sj.decode_jpeg(data, colorspace="RGB", min_height=-(-h // s),
                        min_width=-(-w // s))


def _decode_pillow(data, size: int):
  import io  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  with Image.open(io.BytesIO(data)) as im:
    if size:
      im.draft("RGB", (size, size))
    im = im.convert("RGB")
    return np.asarray(im, np.uint8)


def decode_host(data, where: str = "", size: int = 0,
                library: str = "auto") -> np.ndarray:
  """Encoded image bytes (JPEG, PNG, WebP, ...) -> uint8 [H, W, 3].

  With ``size``, a JPEG is decoded at the smallest DCT scale that keeps
  both sides >= size (Pillow's draft mode: a large photo decodes several
  times faster, and the resize then sees fewer pixels). BadExample if it
  does not decode fully (a truncated JPEG fails here, not later).
  ``library``: "auto" (simplejpeg for JPEGs when installed, else Pillow),
  "simplejpeg" or "pillow".
  """
  problem = jpeg_problem(data)
  if problem:
    raise BadExample(where, f"undecodable image ({problem})")
  sj = _simplejpeg() if library in ("auto", "simplejpeg") else None
  if library == "simplejpeg" and sj is None:
    raise ImportError("simplejpeg is not installed")
  try:
    if sj is not None and is_jpeg(data):
      try:
        return _decode_simplejpeg(sj, data, size)
      except ValueError:
        # libjpeg-turbo's TurboJPEG API refuses some JPEGs that Pillow
        # reads (CMYK, for one): Pillow's answer decides.
        pass
    return _decode_pillow(data, size)
  except Exception as e:  # pylint: disable=broad-except
    # Pillow raises many types (OSError, SyntaxError, ValueError, ...).
    if not is_jpeg(data) and not _known_image(data):
      raise BadExample(where, f"undecodable image (not an image: "
                       f"{len(data)} bytes starting {bytes(data[:8])!r}; "
                       f"{type(e).__name__}: {e})") from None
    raise BadExample(where, f"undecodable image ({type(e).__name__}: "
                     f"{e})") from None


def _known_image(data) -> bool:
  head = bytes(data[:12])
  return (head.startswith((b"\x89PNG", b"GIF8", b"BM", b"II*\0", b"MM\0*"))
          or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"))


class HostBatchDecoder:
  """The batch contract on the host: ``decode(encoded, wheres, size)`` ->
  (uint8 [k, size, size, 3] of the k that decode, in order; bool [n]: which
  did; [(i, where, reason)] for the others). The GPU decoder meets the same
  contract (its images are a jax array on the device)."""

  name = "host"

  def __init__(self, library: str = "auto"):
    self.library = library

  def describe(self) -> str:
    fast = self.library != "pillow" and _simplejpeg() is not None
    return f"host ({'simplejpeg' if fast else 'Pillow'})"

  def decode(self, encoded: list, wheres: list, size: int):
    from train.data import pipeline  # pylint: disable=import-outside-toplevel
    images, ok, bad = [], np.zeros(len(encoded), bool), []
    for i, (data, where) in enumerate(zip(encoded, wheres)):
      try:
        images.append(pipeline.resize_crop(
            decode_host(data, where, size, self.library), size))
        ok[i] = True
      except BadExample as e:
        bad.append((i, e.where, e.reason))
    out = (np.stack(images) if images
           else np.zeros((0, size, size, 3), np.uint8))
    return out, ok, bad


def gpu_unavailable() -> str:
  """"" when the GPU decoder can run here, else why not (one line)."""
  try:
    from nvidia import nvimgcodec  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    return ("the gpu-decode extra is not installed (pip install "
            "'infcl-jax[gpu-decode]': nvidia-nvimgcodec-cu13 and "
            f"nvidia-nvjpeg; {type(e).__name__}: {e})")
  except Exception as e:  # pylint: disable=broad-except
    return f"nvidia.nvimgcodec does not load ({type(e).__name__}: {e})"
  import jax  # pylint: disable=import-outside-toplevel
  platforms = sorted({d.platform for d in jax.local_devices()})
  if platforms != ["gpu"]:
    return (f"it needs a CUDA GPU, and jax's local devices are "
            f"{'/'.join(platforms)}")
  return ""


def check_decoder(data) -> None:
  """One-line ValueError for a config.data.decoder that cannot run (the
  early config check: "gpu" needs its extra and a GPU; the source's kind
  is checked when it is open, ``make_batch_decoder``)."""
  decoder = data.get("decoder", "host")
  if decoder not in DECODERS:
    raise ValueError(f"config.data.decoder={decoder!r} must be one of "
                     f"{', '.join(DECODERS)}")
  if decoder == "gpu":
    why = gpu_unavailable()
    if why:
      raise ValueError(f"config.data.decoder='gpu' cannot run: {why} (use "
                       "decoder='host' or 'auto')")


def has_encoded_images(source) -> bool:
  """Whether ``source``'s examples carry encoded image bytes: webdataset
  shards and tables do, and any source that says so (``encoded_images``);
  TFDS datasets arrive decoded."""
  from train.data import sources  # pylint: disable=import-outside-toplevel
  return bool(getattr(source, "encoded_images", sources.kind_of(
      source.spec) in SOURCE_KINDS))


def make_batch_decoder(data, source):
  """The batch decoder of config.data.decoder for ``source``, or None:
  decode on the host, per example, where it is read."""
  check_decoder(data)
  decoder = data.get("decoder", "host")
  if decoder == "host":
    return None
  if not has_encoded_images(source):
    if decoder == "auto":
      return None
    raise ValueError(
        f"config.data.decoder='gpu' decodes encoded images (webdataset:, "
        f"csv:, tsv:, jsonl: sources); {source.spec} delivers decoded ones "
        "(use decoder='host' or 'auto')")
  if gpu_unavailable():
    return None  # "auto" (check_decoder raised for "gpu")
  from train.data import gpu_decode  # pylint: disable=import-outside-toplevel
  return gpu_decode.GpuBatchDecoder()


class DecodedIterator:
  """Micro-batches of images decoded in batches (see the module doc).

  ``inner`` is a pipeline.TrainIterator whose elements carry the encoded
  image ("encoded", bytes) and its "key" instead of "image". Each
  micro-batch takes the next ``microbatch_size`` examples of that stream,
  decodes them with ``decoder``, and for the ones that fail (counted and
  named in the ledger) takes the next ones, until it is full: a bad image
  never costs the good ones of its batch, and the kept examples are the
  host path's. The state is the inner iterator's, taken between
  micro-batches.
  """

  def __init__(self, inner, decoder, size: int):
    self.inner, self.decoder, self.size = inner, decoder, size
    self.microbatch_size = inner.microbatch_size

  @property
  def ledger(self) -> BadDataLedger:
    return self.inner.ledger

  @property
  def bad(self) -> int:
    return self.inner.ledger.bad

  @property
  def seen(self) -> int:
    return self.inner.ledger.seen

  def describe(self) -> str:
    return self.decoder.describe()

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    need, parts = self.microbatch_size, []
    ledger = self.inner.ledger
    while need:
      raw = self.inner.take(need)
      encoded, keys = raw.pop("encoded"), raw.pop("key")
      images, ok, bad = self.decoder.decode(list(encoded), list(keys),
                                            self.size)
      for _, where, reason in bad:
        ledger.add_bad(where, reason)
      ledger.check()
      part = {k: v[ok] for k, v in raw.items()}
      part["image"] = images
      parts.append(part)
      need -= int(np.count_nonzero(ok))
    ledger.add_good(self.microbatch_size)
    if len(parts) == 1:
      return parts[0]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
           if k != "image"}
    out["image"] = _concatenate([p["image"] for p in parts])
    return out

  def next_batch(self, num_microbatches: int) -> dict:
    parts = [next(self) for _ in range(num_microbatches)]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
           if k != "image"}
    out["image"] = _concatenate([p["image"] for p in parts])
    return out

  def get_state(self) -> dict:
    return self.inner.get_state()

  def set_state(self, state: dict) -> None:
    self.inner.set_state(state)

  def close(self):
    self.inner.close()


def _concatenate(arrays):
  if isinstance(arrays[0], np.ndarray):
    return np.concatenate(arrays)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return jnp.concatenate(arrays)


class _Raised:
  def __init__(self, error):
    self.error = error


def _stop_thread(stop, thread):
  stop.set()
  thread.join(timeout=10)


class Prefetch:
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
    parts = [next(self) for _ in range(num_microbatches)]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]
           if k != "image"}
    out["image"] = _concatenate([p["image"] for p in parts])
    return out

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

  @property
  def bad(self) -> int:
    return self.ledger.bad

  @property
  def seen(self) -> int:
    return self.ledger.seen

  def describe(self) -> str:
    return self.iterator.describe()

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
