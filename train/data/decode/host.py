"""One image on the host: the JPEG check, the decode, the resize and crop.

config.data.decoder = "host": the pipeline (train/data/pipeline.py) calls
``decode_host`` and ``resize_crop`` on every example where it is read, in
the reader threads or worker processes. The lowest layer of the decoding,
shared by the GPU decoder (gpu.py: what nvImageCodec cannot decode is
decoded here), the pipeline and evaluation, which import it and which it
does not import.

``decode_host`` decodes one encoded image: libjpeg-turbo through
``simplejpeg`` when it is installed (about twice Pillow's rate per core, and
bitwise Pillow's pixels: the same library, at the same DCT scale as
Pillow's draft mode), else Pillow. ``jpeg_problem`` finds a truncated JPEG
from its markers (nvJPEG decodes one silently into an image, so the reader
threads check every JPEG before either decoder sees it). ``resize_crop`` is
the host's shorter-side bicubic resize and central crop, which the device
resize (gpu.py, train/towers/resize.py) reproduces.
"""
from __future__ import annotations

import io
import re

import numpy as np
from PIL import Image

from train.data.sources.contract import BadExample

try:  # Optional: without it, Pillow decodes every image.
  import simplejpeg as _simplejpeg
except ImportError:
  _simplejpeg = None

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


def simplejpeg():
  """The simplejpeg module, or None where it is not installed."""
  return _simplejpeg


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
  sj = simplejpeg() if library in ("auto", "simplejpeg") else None
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
      # Pillow's message here only repeats this, with its buffer's address.
      raise BadExample(where, f"undecodable image (not an image: "
                       f"{len(data)} bytes starting {bytes(data[:8])!r}; "
                       f"{type(e).__name__})") from None
    # Less the object reprs Pillow names (``<_io.BytesIO object at 0x..>``):
    # a reason is the same for the same bytes, wherever it was decoded.
    why = re.sub(r" ?<[^<>]* at 0x[0-9a-fA-F]+>", "", str(e))
    raise BadExample(where, f"undecodable image ({type(e).__name__}: "
                     f"{why})") from None


def _known_image(data) -> bool:
  head = bytes(data[:12])
  return (head.startswith((b"\x89PNG", b"GIF8", b"BM", b"II*\0", b"MM\0*"))
          or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"))


def crop_geometry(h: int, w: int, size: int):
  """(resized h, resized w, top, left) of ``resize_crop`` for an (h, w)
  image: the shorter side to ``size``, then the central square."""
  scale = size / min(h, w)
  nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
  return nh, nw, (nh - size) // 2, (nw - size) // 2


def resize_crop(image: np.ndarray, size: int) -> np.ndarray:
  """uint8 [H, W, C] -> uint8 [size, size, 3].

  Resizes the shorter side to `size` (bicubic, antialiased), then takes the
  central square crop; grayscale is repeated to RGB and alpha dropped.
  """
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  image = image[..., :3]
  h, w = image.shape[:2]
  if (h, w) != (size, size):
    nh, nw, top, left = crop_geometry(h, w, size)
    image = np.asarray(Image.fromarray(image).resize(
        (nw, nh), Image.BICUBIC,
        reducing_gap=None if size / min(h, w) >= 1 else 2.0))
    image = image[top:top + size, left:left + size]
  return np.ascontiguousarray(image, dtype=np.uint8)


def to_float(image: np.ndarray) -> np.ndarray:
  """uint8 -> float32 in [-1, 1], bitwise as the towers' SYMMETRIC
  normalisation computes it on the device (train/towers/tower.py)."""
  return (image.astype(np.float32) - np.float32(127.5)) * np.float32(
      1.0 / 127.5)


def preprocess_image(image: np.ndarray, size: int) -> np.ndarray:
  """uint8 [H, W, C] -> float32 [size, size, 3] in [-1, 1] (resize_crop)."""
  return to_float(resize_crop(image, size))
