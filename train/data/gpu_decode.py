"""JPEG decoding on the GPU: nvImageCodec (nvJPEG) -> jax, resized on device.

``GpuBatchDecoder`` meets the batch contract of train/data/decode.py
(``decode(encoded, wheres, size)`` -> uint8 [k, size, size, 3] of the k
that decode, which did, and the others named) for one local device: each
device's shard of a micro-batch (``decode.DecodedIterator``) goes to that
device's decoder, nvImageCodec on that GPU, in one call; each decoded
image is handed to jax on that device through DLPack (no host copy);
images of one shape are stacked and resized and centre-cropped to ``size``
there as the host path does it (``pipeline.resize_crop``: shorter side to
``size``, Pillow's separable antialiased bicubic with each pass rounded to
whole levels, then the central square), and the result stays uint8 until
the tower normalises it.

What nvImageCodec cannot decode (it answers None: a PNG, a CMYK JPEG, a
file that is no image) is decoded on the host instead, so the kept
examples are the host path's: only what the host cannot decode either is
bad, with the host's reason. Truncated JPEGs, which nvJPEG decodes
silently into an image, never get here: the reader threads check every
JPEG's markers first (decode.jpeg_problem).

Needs the ``gpu-decode`` extra (nvidia-nvimgcodec-cu13 with nvidia-nvjpeg:
CUDA 13, as the jax CUDA plugin beside it) and a CUDA device; importing
this module needs neither.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

BACKENDS = ("auto", "hw", "cuda", "hybrid")


def _pass(x, shape):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  y = jax.image.resize(x, shape, "bicubic", antialias=True,
                       precision=jax.lax.Precision.HIGHEST)
  return jnp.round(jnp.clip(y, 0.0, 255.0))


def crop_geometry(h: int, w: int, size: int):
  """(resized h, resized w, top, left) of ``pipeline.resize_crop``."""
  scale = size / min(h, w)
  nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
  return nh, nw, (nh - size) // 2, (nw - size) // 2


@functools.partial(jax.jit, static_argnums=1)
def resize_crop_device(images, size: int):
  """uint8 [b, h, w, 3] -> uint8 [b, size, size, 3], as the host's
  ``pipeline.resize_crop`` (width pass first, as Pillow; a side already at
  its target is not resampled)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  b, h, w, c = images.shape
  if (h, w) == (size, size):
    return images
  nh, nw, top, left = crop_geometry(h, w, size)
  x = images.astype(jnp.float32)
  if nw != w:
    x = _pass(x, (b, h, nw, c))
  if nh != h:
    x = _pass(x, (b, nh, nw, c))
  x = x[:, top:top + size, left:left + size]
  return x.astype(jnp.uint8)


class GpuBatchDecoder:
  """nvImageCodec on one local jax device (see the module doc).

  Args:
    backend: "auto" (nvImageCodec's order: the hardware JPEG engines where
      the GPU has them, then CUDA, then the CPU), "hw" (hardware only),
      "cuda" (CUDA kernels only) or "hybrid" (CPU Huffman + GPU IDCT).
      On the H200 with nvImageCodec 0.9.0.20 and nvJPEG 13.2, "auto"
      decodes 256 px JPEGs at 9.3k-11.3k img/s and "hw" at 7.3k-7.9k
      (batches of 256-4096, benchmarks/bench_data.py --decoders); "cuda"
      cannot be created there.
    device: the jax device whose GPU decodes (nvImageCodec's device_id:
      its own decoder, on that GPU's stream) and holds the images (default:
      the first local one). ``for_device`` makes the decoder of another:
      ``DecodedIterator`` has one per local device, each decoding its own
      shard of the micro-batch.
    fancy_upsampling: chroma upsampled as libjpeg-turbo's default does it
      (the host path's), rather than nvJPEG's nearest neighbour.
  """

  name = "gpu"

  def __init__(self, backend: str = "auto", device=None,
               fancy_upsampling: bool = True):
    from nvidia import nvimgcodec  # pylint: disable=import-outside-toplevel
    if backend not in BACKENDS:
      raise ValueError(f"GPU decode backend {backend!r} must be one of "
                       f"{', '.join(BACKENDS)}")
    self.backend = backend
    self.device = device or jax.local_devices()[0]
    self._fancy_asked = fancy_upsampling
    kinds = {"hw": "HW_GPU_ONLY", "cuda": "GPU_ONLY",
             "hybrid": "HYBRID_CPU_GPU"}
    hw_id = getattr(self.device, "local_hardware_id", None)
    kwargs = {"device_id": int(self.device.id if hw_id is None else hw_id)}
    if backend in kinds:
      kwargs["backends"] = [nvimgcodec.Backend(
          getattr(nvimgcodec.BackendKind, kinds[backend]))]
    self.fancy_upsampling = fancy_upsampling
    try:
      self._decoder = nvimgcodec.Decoder(
          **kwargs, **({"options": ":fancy_upsampling=1"}
                       if fancy_upsampling else {}))
    except RuntimeError:
      if not fancy_upsampling:
        raise
      # A backend that does not take the option: its own upsampling (the
      # pixels' bound to the host path is then looser).
      self.fancy_upsampling = False
      try:
        self._decoder = nvimgcodec.Decoder(**kwargs)
      except RuntimeError as e:
        raise ValueError(f"nvImageCodec cannot create a decoder for "
                         f"backend {backend!r} on {self.device}: {e}"
                         ) from None
    # The host path does not apply EXIF orientation (Pillow's Image.open
    # leaves it), so neither does this one.
    self.zero_copy = True
    self._params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
        allow_any_depth=False)

  def for_device(self, device) -> "GpuBatchDecoder":
    if device == self.device:
      return self
    return GpuBatchDecoder(self.backend, device, self._fancy_asked)

  def describe(self) -> str:
    return (f"gpu (nvImageCodec, backend {self.backend}, {self.device}"
            f"{'' if self.fancy_upsampling else ', no fancy upsampling'})")

  def _decode_all(self, encoded: list) -> list:
    try:
      return list(self._decoder.decode(encoded, params=self._params))
    except Exception:  # pylint: disable=broad-except
      # One bad stream can fail the whole batch call: decode one by one,
      # so that only it is lost.
      out = []
      for data in encoded:
        try:
          out.append(self._decoder.decode(data, params=self._params))
        except Exception:  # pylint: disable=broad-except
          out.append(None)
      return out

  def _to_jax(self, img):
    if self.zero_copy:
      try:
        # On this decoder's device: no copy where nvImageCodec decoded on
        # it; a copy for an image in host memory (a CPU-backend decode).
        return jax.dlpack.from_dlpack(img, device=self.device)
      except Exception:  # pylint: disable=broad-except
        # A DLPack mismatch between the two builds: through the host
        # instead (slower; ``zero_copy`` says which path ran).
        self.zero_copy = False
    return jax.device_put(np.asarray(img.cpu()), self.device)

  def _usable(self, img):
    """nvImageCodec's answer for one image -> uint8 [h, w, 3] on the
    device, or None: the host decodes it (None, or another layout)."""
    if img is None:
      return None
    a = self._to_jax(img)
    if a.ndim == 3 and a.shape[-1] == 3 and a.dtype == np.uint8:
      return a
    return None

  def decode(self, encoded: list, wheres: list, size: int):
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from train.data import decode as decode_lib  # pylint: disable=import-outside-toplevel
    from train.data import pipeline  # pylint: disable=import-outside-toplevel
    from train.data.source import BadExample  # pylint: disable=import-outside-toplevel
    n = len(encoded)
    ok, bad = np.zeros(n, bool), []
    groups: dict = {}  # shape -> [(i, device array)]
    host = []  # (i, uint8 [size, size, 3]) decoded on the host
    for i, img in enumerate(self._decode_all(encoded)):
      a = self._usable(img)
      if a is not None:
        groups.setdefault(tuple(a.shape), []).append((i, a))
        ok[i] = True
        continue
      try:
        host.append((i, pipeline.resize_crop(
            decode_lib.decode_host(encoded[i], wheres[i], size), size)))
        ok[i] = True
      except BadExample as e:
        bad.append((i, e.where, e.reason))
    pieces, order = [], []
    for members in groups.values():
      order += [i for i, _ in members]
      pieces.append(resize_crop_device(jnp.stack([a for _, a in members]),
                                       size))
    if host:
      order += [i for i, _ in host]
      pieces.append(jax.device_put(np.stack([x for _, x in host]),
                                   self.device))
    if not pieces:
      return jax.device_put(np.zeros((0, size, size, 3), np.uint8),
                            self.device), ok, bad
    images = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    if order != sorted(order):
      images = images[np.argsort(np.asarray(order), kind="stable")]
    return images, ok, bad
