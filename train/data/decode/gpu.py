"""JPEG decoding on the GPU: nvImageCodec (nvJPEG) -> jax, resized on device.

``GpuBatchDecoder`` meets the batch contract of train/data/decode/'s
module doc (``decode(encoded, wheres, size)`` -> uint8 [k, size, size, 3]
of the k that decode, which did, and the others named) for one local
device: each device's shard of a micro-batch (``batching.DecodedIterator``)
goes to that device's decoder, nvImageCodec on that GPU, in one call
(faster beside the tower than sub-batches: BENCHMARKS.md "Data path"), or
with ``threads`` > 1 split in that many contiguous parts, each decoded by
its own nvImageCodec decoder on its own thread (nvImageCodec's call sets
each image up on the calling thread: one thread's setup, not the GPU,
bounded the decoder in the streamed step); each decoded image is
handed to jax on that device through DLPack (no host copy) and
resized and centre-cropped to ``size`` there as the host path does it
(``host.resize_crop``: shorter side to ``size``, Pillow's reduce and
separable antialiased bicubic, each step rounded to whole levels, then the
central square), and the result stays uint8 until the tower normalises it.
The resize (``resize_crop_batch``, see the comment above it) takes any mix
of shapes with a bounded number of executables: Pillow's coefficients are
computed on the host and sent as data, images are cut to the window their
crop needs and padded to a few canvas sizes, so a web shard's hundreds of
shapes per micro-batch do not compile a resize each; a shape's many
members (a centre-cropped shard's one shape) go in one program per 256.

What nvImageCodec cannot decode (it answers None: a PNG, a CMYK JPEG, a
file that is no image) is decoded on the host instead, so the kept
examples are the host path's: only what the host cannot decode either is
bad, with the host's reason. Truncated JPEGs, which nvJPEG decodes
silently into an image, never get here: the reader threads check every
JPEG's markers first (host.jpeg_problem).

Needs the ``gpu-decode`` extra (nvidia-nvimgcodec-cu13 with nvidia-nvjpeg:
CUDA 13, as the jax CUDA plugin beside it) and a CUDA device; importing
this module needs neither.
"""
from __future__ import annotations

import concurrent.futures
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import PIL

from train.data.decode import host as host_lib
from train.data.decode.host import crop_geometry
from train.data.sources.contract import BadExample
from train.data.stopwatch import Stopwatch

BACKENDS = ("auto", "hw", "cuda", "hybrid")
# nvImageCodec's backend kinds. Its nvJPEG CUDA decoder registers as
# HYBRID_CPU_GPU: below nvjpeg_cuda_decoder:hybrid_huffman_threshold pixels
# (10^6 by default, so every 256 px JPEG) it does the Huffman decode on CPU
# threads (its executor's, max_num_cpu_threads, plus the caller), above it
# on the GPU. "hw" is the hardware JPEG engines alone.
_KINDS = {"hw": "HW_GPU_ONLY", "cuda": "GPU_ONLY", "hybrid": "HYBRID_CPU_GPU"}
MAX_THREADS = 32  # nvImageCodec decoders per GPU (gpu_decoder_threads)


def parse_backends(spec: str) -> tuple:
  """config.data.gpu_decoder_backend -> ((kind, load_hint or None), ...).

  "auto" is nvImageCodec's own choice (()); otherwise comma-separated
  kinds, each with an optional load hint, the share of a batch nvImageCodec
  gives it before the next (its Backend(load_hint=...)): "hw:0.7,hybrid"
  sends ~70% to the hardware engines and the rest to the CUDA decoder.
  One-line ValueError for anything else.
  """
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"config.data.gpu_decoder_backend={spec!r} must be "
                     f"'auto' or comma-separated kinds of {', '.join(BACKENDS[1:])}"
                     " with optional load hints ('hw:0.7,hybrid')")
  if spec.strip() == "auto":
    return ()
  out = []
  for part in spec.split(","):
    kind, _, hint = part.strip().partition(":")
    if kind not in _KINDS:
      raise ValueError(f"config.data.gpu_decoder_backend={spec!r}: {kind!r} "
                       f"is not one of {', '.join(BACKENDS)} ('auto' alone)")
    if kind in (k for k, _ in out):
      raise ValueError(f"config.data.gpu_decoder_backend={spec!r} names "
                       f"{kind!r} twice")
    load = None
    if hint:
      try:
        load = float(hint)
      except ValueError:
        load = -1.0
      if not 0.0 < load <= 1.0:
        raise ValueError(f"config.data.gpu_decoder_backend={spec!r}: the "
                         f"load hint {hint!r} of {kind!r} must be a number "
                         "in (0, 1]")
    out.append((kind, load))
  return tuple(out)


def check_options(options: str) -> str:
  """config.data.gpu_decoder_options, checked: nvImageCodec's decoder
  options, space-separated ``[decoder_id]:name=value`` entries
  (":num_cuda_streams=2", "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0").
  nvImageCodec ignores an entry it cannot parse, so a typo would measure
  the defaults: refused here in one line instead."""
  if not isinstance(options, str):
    raise ValueError(f"config.data.gpu_decoder_options={options!r} must be "
                     "a string")
  for entry in options.split():
    head, eq, value = entry.partition("=")
    if ":" not in head or not eq or not value or not head.split(":")[-1]:
      raise ValueError(f"config.data.gpu_decoder_options={options!r}: entry "
                       f"{entry!r} is not [decoder_id]:option=value")
  return " ".join(options.split())


def check_settings(backend: str, options: str, cpu_threads: int,
                   threads: int = 1) -> tuple:
  """The config.data.gpu_decoder_* settings, checked (one-line
  ValueError): (parse_backends(backend), check_options(options))."""
  if (not isinstance(cpu_threads, int) or isinstance(cpu_threads, bool)
      or cpu_threads < 0):
    raise ValueError(f"config.data.gpu_decoder_cpu_threads={cpu_threads!r} "
                     "must be an int >= 0 (0 = nvImageCodec's default, one "
                     "per core)")
  if not isinstance(threads, int) or isinstance(threads, bool) or not (
      1 <= threads <= MAX_THREADS):
    raise ValueError(f"config.data.gpu_decoder_threads={threads!r} must be "
                     f"an int in [1, {MAX_THREADS}] (nvImageCodec decoders "
                     "per GPU, each on its own thread)")
  return parse_backends(backend), check_options(options)

# ------------------------------------------------------------ the device resize
#
# Why not jax.image.resize on each group of one shape (as before): every
# executable is specialised to its input shape and batch size, and a web
# shard (img2dataset keep_ratio: shorter side 256, the other anything up to
# ~1000) brings hundreds of (h, w) per micro-batch, each group a different
# count: every group compiled a new stack and a new resize. Here the
# resize is Pillow's arithmetic written as data, not as shapes:
#
# * Pillow's bicubic (the host path, host.resize_crop) is two separable
#   passes, each out = clip(floor(X · K^T / 2^22 + 1/2)) with K its integer
#   (22-bit) coefficients (Resample.c: precompute_coeffs,
#   normalize_coeffs_8bpc). The coefficients and the pass order are computed
#   here on the host per (h, w, size), cached, and sent as taps (a start and
#   17 coefficients per output row); one jitted function of fixed shapes
#   expands them to matrices and runs both passes for any image that fits
#   its canvas. The matmuls are float32 at HIGHEST precision: a coefficient
#   k / 2^22 is exact in float32, the products and sums are not quite
#   (30-bit products), so a pixel whose exact value lies within ~1e-5 of a
#   rounding boundary can round the other way: measured 1 level in ~1e-5
#   of the pixels (tests/test_gpu_decode_resize.py). The old path
#   (jax.image.resize: unquantised coefficients, always horizontal first)
#   was off by 1 level in up to 0.5% of the pixels, and by up to 22 levels
#   on images over twice as tall as wide (Pillow 13's order, below).
# * Only the output crop is computed: the rows and columns of the source
#   the central square's taps touch (its window, ~ the shorter side square)
#   are cut out per image, so a canvas depends on the shorter side and the
#   scale, not on the aspect: keep_ratio shards at 224 all share one canvas.
#   Canvas sides are rounded up to 8 steps an octave (<= 12.5% padding each)
#   and group counts up to powers of two (chunks of at most CHUNK): the
#   resize's executables are bounded by (canvas buckets) x (count buckets)
#   per output size, whatever the mix. Zero taps ignore the padding.
# * The cut (and Pillow's box reduce, below) is a small jitted function per
#   source shape: a jax array's shape is static, so some executable per
#   (h, w) is unavoidable short of decoding into preallocated canvases; it
#   is one slice + pad (no batch size in its key), compiled once per shape
#   per device, i.e. bounded by the data set's distinct shapes, not by
#   (shape x count) per micro-batch. Padding a whole micro-batch to one
#   canvas instead would still need that per-shape pad, and would pad a
#   256 px image to the batch's largest. Measured on 2 CPU cores, 3
#   micro-batches of 50 keep_ratio-like images (142 shapes) to 224: the old
#   path 25.4 s cold (142 resize executables plus as many stacks), 5.2
#   ms/img warm; this one 6.0 s cold (142 cuts, 6 resize executables: the
#   cuts are ~35 ms of compile each), 3.4 ms/img warm (the window: fewer
#   FLOPs than resizing the whole image).
# * reducing_gap=2.0 (the host's when shrinking): where a side shrinks by
#   >= 4x Pillow first box-reduces by f = int(ratio / 2) (Image.resize), one
#   rounding of the 2-D box sum as Reduce.c does it ((sum + n//2) * m >> 24,
#   m = trunc(2^32 / (256 n)) in float32, n the box's pixel count, smaller
#   at the right and bottom edges). Done here exactly, in integers, in the
#   per-shape function, which then bounds the residual scale below 4: a
#   canvas side is then at most 4 * size + 17 whatever the image's size.
# * Pass order: Pillow 13 runs the vertical pass first when the height
#   shrinks by more than twice as many pixels as the width (Resample.c,
#   ImagingResampleInner); earlier Pillows go horizontal first (12.2 and
#   12.3 too, but for images over 100x taller than wide: not modelled). The
#   two round differently, so the order is the installed Pillow's (the host
#   path's; pyproject allows pillow>=10); a vertical-first image is
#   transposed in its per-shape function and its result transposed back,
#   so both orders share one executable.
#
# Result: bitwise the host's but for those rare 1-level pixels, on every
# shape (the old path drifted by a few levels past the reducing gap).

_BITS = 22  # Pillow's PRECISION_BITS for 8-bit images: 32 - 8 - 2.
TAPS = 17  # Taps per output pixel: 2 * ceil(2 * residual scale < 4) + 1.
CHUNK = 64  # Most images per resize call; counts are padded to powers of 2.
# Why a shape's many members go in one executable each call (cut, reduce and
# resize fused; the plan a constant): every jax call is one more program on
# the device's queue, and the GPU client admits only so many ahead of the
# device (32), so a call per image (the cut) stalled the decoder behind the
# tower's step. A web shard's rare shapes keep the per-shape cut.
SAME = 8  # A shape's members in one decode call from which they are fused.
SAME_CHUNK = 256  # Most of them per fused call.


def _cubic(x):
  """Pillow's bicubic kernel (a = -0.5), float64."""
  x = np.abs(x)
  near = ((-0.5 + 2.0) * x - (-0.5 + 3.0)) * x * x + 1
  far = (((x - 5) * x + 8) * x - 4) * -0.5
  return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _coeffs(in_size: int, in1: float, out_size: int):
  """Pillow's precompute_coeffs + normalize_coeffs_8bpc for the box
  [0, in1) (float32, as Pillow's C box) of ``in_size`` pixels to
  ``out_size``: (first tap [out], number of taps [out], int coefficients
  [out, ksize]). The same float64 operations in the same order, so the
  quantised integers are Pillow's."""
  scale = float(np.float32(in1)) / out_size
  filterscale = max(scale, 1.0)
  support = 2.0 * filterscale
  ksize = int(np.ceil(support)) * 2 + 1
  center = (np.arange(out_size) + 0.5) * scale
  first = np.maximum((center - support + 0.5).astype(np.int64), 0)
  count = np.minimum((center + support + 0.5).astype(np.int64),
                     in_size) - first
  t = np.arange(ksize)
  w = _cubic((t + first[:, None] - center[:, None] + 0.5) * (1.0 / filterscale))
  w = np.where(t < count[:, None], w, 0.0)
  total = np.cumsum(w, axis=1)[:, -1]  # Pillow's sequential sum.
  w = np.where(total[:, None] != 0.0,
               w / np.where(total == 0.0, 1.0, total)[:, None], w)
  one = float(1 << _BITS)
  k = np.where(w < 0, -0.5 + w * one, 0.5 + w * one).astype(np.int64)
  return first, count, k


class _Axis(NamedTuple):
  """One side of an image's plan (see ``plan``)."""
  factor: int  # Pillow's box-reduce factor on this side (1: none).
  lo: int  # The window: source pixels [lo, hi) ...
  hi: int
  last: int  # ... and the pixel count of its last reduce box.
  need: bool  # Whether Pillow resamples this side at all.
  start: np.ndarray  # int32 [size]: each output pixel's first tap, in
  # window coordinates (after the reduce) ...
  taps: np.ndarray  # ... and its TAPS coefficients, int32 [size, TAPS].


def _axis(n_in: int, n_out: int, crop: int, size: int, gap: bool) -> _Axis:
  factor = (int(n_in / n_out / 2.0) or 1) if gap else 1
  n_red = -(-n_in // factor)
  end = np.float32(n_in / factor)  # Image.resize's box after the reduce.
  need = n_out != n_red or end != n_out
  if need:
    first, count, k = _coeffs(n_red, end, n_out)
    first, count, k = (a[crop:crop + size] for a in (first, count, k))
    lo, hi = int(first.min()), int((first + count).max())
    if k.shape[1] > TAPS:
      raise AssertionError(f"{k.shape[1]} taps > {TAPS} for {n_in}->{n_out}")
    taps = np.zeros((size, TAPS), np.int64)
    taps[:, :k.shape[1]] = k
    start = first - lo
  else:  # The identity on the reduced side, cropped.
    lo, hi = crop, crop + size
    taps = np.zeros((size, TAPS), np.int64)
    taps[:, 0] = 1 << _BITS
    start = np.arange(size)
  last = min(factor, n_in - (hi - 1) * factor)
  return _Axis(factor, lo * factor, min(hi * factor, n_in), last, bool(need),
               start.astype(np.int32), taps.astype(np.int32))


def _bucket(n: int) -> int:
  """A canvas side: n rounded up to 8 steps an octave (16 at least)."""
  step = max(16, 1 << max(0, (n - 1).bit_length() - 4))
  return -(-n // step) * step


class Plan(NamedTuple):
  """How one (h, w) goes to (size, size), computed on the host (numpy,
  cached per (h, w, size): the jitted functions key on shapes, never on
  a plan, whose hash would cost more than the call)."""
  h: int
  w: int
  size: int
  rows: _Axis
  cols: _Axis
  vertical_first: bool  # Pillow's pass order: the canvas is transposed.
  canvas: tuple  # (Hc, Wc): the window's bucket, after any transpose.

  @property
  def crop_only(self) -> bool:
    """Pillow neither reduces nor resamples: the central square as is."""
    return not (self.rows.need or self.cols.need or self.rows.factor > 1
                or self.cols.factor > 1)


@functools.lru_cache(maxsize=1 << 16)
def plan(h: int, w: int, size: int) -> Plan:
  """The plan of ``host.resize_crop`` for an (h, w) image."""
  nh, nw, top, left = crop_geometry(h, w, size)
  gap = size / min(h, w) < 1  # reducing_gap=2.0 only when shrinking.
  fx = (int(w / nw / 2.0) or 1) if gap else 1
  fy = (int(h / nh / 2.0) or 1) if gap else 1
  # Pillow reduces both sides when either's factor is > 1 (a 1 is a no-op).
  gap = gap and (fx > 1 or fy > 1)
  rows = _axis(h, nh, top, size, gap)
  cols = _axis(w, nw, left, size, gap)
  # Pillow's order, on the (reduced) image's sizes.
  vfirst = _vertical_first(-(-h // rows.factor), -(-w // cols.factor), nh, nw)
  win = (-(-(rows.hi - rows.lo) // rows.factor),
         -(-(cols.hi - cols.lo) // cols.factor))
  if vfirst:
    win = win[::-1]
  return Plan(h, w, size, rows, cols, bool(vfirst),
              (_bucket(win[0]), _bucket(win[1])))


@functools.lru_cache(maxsize=None)
def _pillow_major() -> int:
  return int(PIL.__version__.split(".")[0])


def _vertical_first(h_in: int, w_in: int, nh: int, nw: int) -> bool:
  """Whether the host's Pillow resizes (h_in, w_in) -> (nh, nw) vertically
  first (see the comment above)."""
  if _pillow_major() < 13:
    return False
  return h_in - nh > 0 and h_in - nh > 2 * (w_in - nw)


def _mult(n: int) -> int:
  """Reduce.c's division_UINT32(n, 8): 2^32 / (256 n), in float32."""
  return int(np.float32(2.0**32) / np.float32(256 * n))


def _reduce(x, rows: _Axis, cols: _Axis):
  """Pillow's box reduce of the window x (uint8 [h, w, 3]), exactly."""
  fy, fx = rows.factor, cols.factor
  h, w = x.shape[:2]
  hr, wr = -(-h // fy), -(-w // fx)
  x = jnp.pad(x.astype(jnp.uint32), ((0, hr * fy - h), (0, wr * fx - w),
                                     (0, 0)))
  s = x.reshape(hr, fy, wr, fx, 3).sum(axis=(1, 3))
  # Box sizes: full but the last row / column (the image's edge).
  last_r = (jnp.arange(hr) == hr - 1)[:, None, None]
  last_c = (jnp.arange(wr) == wr - 1)[None, :, None]
  def table(f):
    return jnp.where(last_r, jnp.where(last_c, f(rows.last * cols.last),
                                       f(rows.last * fx)),
                     jnp.where(last_c, f(fy * cols.last), f(fy * fx)))
  amend = table(lambda n: np.uint32(n // 2))
  mult = table(lambda n: np.uint32(_mult(n)))
  # (sum + amend) * mult < 2^32: sum <= 255 n and mult <= 2^24 / n.
  return (((s + amend) * mult) >> 24).astype(jnp.uint8)


def _canvas(image, size: int):
  """uint8 [h, w, 3] -> the uint8 canvas its resize takes, or for a
  crop-only plan the [size, size, 3] result (traced: its plan is static)."""
  p = plan(*image.shape[:2], size)
  x = image[p.rows.lo:p.rows.hi, p.cols.lo:p.cols.hi]
  if p.crop_only:
    return x
  if p.rows.factor > 1 or p.cols.factor > 1:
    x = _reduce(x, p.rows, p.cols)
  if p.vertical_first:
    x = jnp.swapaxes(x, 0, 1)
  hc, wc = p.canvas
  return jnp.pad(x, ((0, hc - x.shape[0]), (0, wc - x.shape[1]), (0, 0)))


# One executable per source shape and size.
_prepare = jax.jit(_canvas, static_argnums=1)


def _dense(start, taps, width: int):
  """Taps -> float32 matrices: start int32 [n, s], taps int32 [n, s, T]
  -> [n, s, width], each row's T coefficients from its start on."""
  t = jnp.arange(width)[None, None, :] - start[:, :, None]
  inside = (t >= 0) & (t < taps.shape[-1])
  k = jnp.take_along_axis(taps, jnp.clip(t, 0, taps.shape[-1] - 1), axis=2)
  return jnp.where(inside, k, 0).astype(jnp.float32) * np.float32(2.0**-_BITS)


def _round(v):
  """Pillow's (sum + 2^21) >> 22, clipped to a level."""
  return jnp.clip(jnp.floor(v + 0.5), 0.0, 255.0)


def _two_passes(x, sa, ka, sb, kb):
  """uint8 canvases [n, Hc, Wc, 3] -> float32 [n, size, size, 3], whole
  levels: the first pass along a canvas row, then along its columns, by
  each canvas's taps ([n, size] starts, [n, size, TAPS] coefficients)."""
  hp = jax.lax.Precision.HIGHEST
  x = x.astype(jnp.float32)
  y = _round(jnp.einsum("nhwc,nsw->nhsc", x, _dense(sa, ka, x.shape[2]),
                        precision=hp))
  return _round(jnp.einsum("nth,nhsc->ntsc", _dense(sb, kb, x.shape[1]), y,
                           precision=hp))


@functools.partial(jax.jit, donate_argnums=0)
def _resize_into(out, canvases, sa, ka, sb, kb, flip, rows):
  """Resizes n canvases (a tuple of uint8 [Hc, Wc, 3]) by their taps and
  writes them to rows ``rows`` of out (uint8 [k, size, size, 3]; a row >= k
  is padding, dropped). One executable per (k, canvas, n)."""
  z = _two_passes(jnp.stack(canvases), sa, ka, sb, kb)
  z = jnp.where(flip[:, None, None, None], jnp.swapaxes(z, 1, 2), z)
  return out.at[rows].set(z.astype(jnp.uint8), mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _resize_same_into(out, images, rows):
  """``_prepare`` and ``_resize_into`` in one executable for n images of
  one shape (a tuple of uint8 [h, w, 3]), whose plan and taps are then
  constants. One executable per (k, shape, n)."""
  n, size = len(images), out.shape[1]
  p = plan(*images[0].shape[:2], size)
  x = jax.vmap(lambda im: _canvas(im, size))(jnp.stack(images))
  sa, ka, sb, kb = (jnp.broadcast_to(t, (n,) + t.shape)
                    for t in _pass_taps(p))
  z = _two_passes(x, sa, ka, sb, kb)
  if p.vertical_first:
    z = jnp.swapaxes(z, 1, 2)
  return out.at[rows].set(z.astype(jnp.uint8), mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _place_into(out, images, rows):
  """Writes a tuple of uint8 [size, size, 3] to rows ``rows`` of out."""
  return out.at[rows].set(jnp.stack(images), mode="drop")


def _pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _chunks(items: list, chunk: int = CHUNK):
  """A group in calls of ``chunk``, the last padded to a power of two: the
  count in an executable's key takes log2(chunk) + 1 values."""
  for i in range(0, len(items), chunk):
    part = items[i:i + chunk]
    yield part, _pow2(len(part)) - len(part)


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple, device):
  """A zero image to pad a call with (cached: never written, and shared
  by the calls on one device)."""
  return jax.device_put(np.zeros(shape, np.uint8), device)


def _pass_taps(p: Plan):
  """(first-pass start, taps, second-pass start, taps) of a plan, in canvas
  order: the first pass runs along a canvas row."""
  a, b = (p.rows, p.cols) if p.vertical_first else (p.cols, p.rows)
  return a.start, a.taps, b.start, b.taps


def resize_crop_into(out, images: list, rows: list):
  """Writes ``host.resize_crop`` of each uint8 [h, w, 3] device array
  in images to its row of out (uint8 [k, size, size, 3], on the images'
  device), returning the new out (the old one is donated).

  Images at (size, size) are written as they are. A shape with SAME or more
  members is cut and resized in calls of up to SAME_CHUNK of them, each one
  executable; the others are planned per shape, cut to their window, and
  resized in groups of one canvas.
  """
  k, size = out.shape[0], out.shape[1]
  device = next(iter(out.devices()))
  by_shape = {}
  for image, row in zip(images, rows):
    by_shape.setdefault(tuple(image.shape[:2]), []).append((image, row))
  squares, groups = [], {}
  for (h, w), members in by_shape.items():
    if (h, w) == (size, size):
      squares += members
      continue
    p = plan(h, w, size)
    if len(members) >= SAME and not p.crop_only:
      for part, pad in _chunks(members, SAME_CHUNK):
        out = _resize_same_into(
            out, tuple(a for a, _ in part)
            + (_zeros((h, w, 3), device),) * pad,
            np.asarray([r for _, r in part] + [k] * pad, np.int32))
      continue
    for image, row in members:
      if p.crop_only:
        squares.append((_prepare(image, size), row))
      else:
        groups.setdefault(p.canvas, []).append(
            (_prepare(image, size), p, row))
  for part, pad in _chunks(squares):
    filler = (_zeros((size, size, 3), device),) * pad
    out = _place_into(out, tuple(a for a, _ in part) + filler,
                      np.asarray([r for _, r in part] + [k] * pad, np.int32))
  for canvas, members in groups.items():
    for part, pad in _chunks(members):
      taps = [_pass_taps(p) for _, p, _ in part]
      taps += [tuple(np.zeros_like(t) for t in taps[0])] * pad
      sa, ka, sb, kb = (np.stack(t) for t in zip(*taps))
      flip = np.asarray([p.vertical_first for _, p, _ in part]
                        + [False] * pad)
      out = _resize_into(
          out, tuple(c for c, _, _ in part)
          + (_zeros(canvas + (3,), device),) * pad,
          sa, ka, sb, kb, flip,
          np.asarray([r for _, _, r in part] + [k] * pad, np.int32))
  return out


def resize_crop_batch(images: list, size: int, device=None):
  """uint8 [h_i, w_i, 3] device arrays (any mix of shapes) -> uint8
  [len(images), size, size, 3] on ``device`` (default: the first image's),
  each as ``host.resize_crop`` makes it (see the comment above)."""
  if device is None:
    device = next(iter(images[0].devices())) if images else jax.devices()[0]
  out = jnp.zeros((len(images), size, size, 3), jnp.uint8, device=device)
  return resize_crop_into(out, images, list(range(len(images))))


def compiled_counts() -> dict:
  """Executables compiled so far by the device resize's jitted functions
  (tests bound them; the per-shape one grows with the data's shapes)."""
  return {"prepare": _prepare._cache_size(),  # pylint: disable=protected-access
          "resize": _resize_into._cache_size(),  # pylint: disable=protected-access
          "same": _resize_same_into._cache_size(),  # pylint: disable=protected-access
          "place": _place_into._cache_size()}  # pylint: disable=protected-access


class GpuBatchDecoder:
  """nvImageCodec on one local jax device (see the module doc).

  Args:
    backend: "auto" (nvImageCodec's order: the hardware JPEG engines where
      the GPU has them, then CUDA, then the CPU), "hw" (hardware only),
      "cuda" (CUDA kernels only) or "hybrid" (CPU Huffman + GPU IDCT).
      On the H200 with nvImageCodec 0.9.0.20 and nvJPEG 13.2, "auto"
      decodes 256 px JPEGs at 9.3k-11.3k img/s and "hw" at 7.3k-7.9k
      (batches of 256-4096, benchmarks/bench_data.py --decoders); "cuda"
      cannot be created there. A comma-separated mix with load hints
      ("hw:0.7,hybrid") splits each batch between them (parse_backends).
    device: the jax device whose GPU decodes (nvImageCodec's device_id:
      its own decoder, on that GPU's stream) and holds the images (default:
      the first local one). ``for_device`` makes the decoder of another:
      ``DecodedIterator`` has one per local device, each decoding its own
      shard of the micro-batch.
    fancy_upsampling: chroma upsampled as libjpeg-turbo's default does it
      (the host path's), rather than nvJPEG's nearest neighbour.
    options: more of nvImageCodec's decoder options (check_options), after
      ":fancy_upsampling=1".
    cpu_threads: nvImageCodec's executor threads (max_num_cpu_threads; 0 =
      its default, one per core), of each of its decoders. Its CUDA
      decoder's Huffman stage runs there for small images, beside the data
      workers and the tower's dispatch, so this and the workers share the
      host's cores.
    threads: nvImageCodec decoders on this device, each on its own thread:
      a shard is split in that many contiguous parts, decoded and handed to
      jax side by side (nvImageCodec sets every image of a call up on the
      calling thread, and releases the GIL while it decodes), then resized
      together. The images, their order and the bad members are those of
      one decoder.
  """

  name = "gpu"

  def __init__(self, backend: str = "auto", device=None,
               fancy_upsampling: bool = True, options: str = "",
               cpu_threads: int = 0, threads: int = 1):
    # Lazy: the gpu-decode extra, needed only where this decoder is made.
    from nvidia import nvimgcodec  # pylint: disable=import-outside-toplevel
    kinds, options = check_settings(backend, options, cpu_threads, threads)
    self.backend, self.options = backend, options
    self.cpu_threads, self.threads = cpu_threads, threads
    self.device = device or jax.local_devices()[0]
    self._fancy_asked = fancy_upsampling
    hw_id = getattr(self.device, "local_hardware_id", None)
    kwargs = {"device_id": int(self.device.id if hw_id is None else hw_id)}
    if kinds:
      kwargs["backends"] = [
          nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, _KINDS[k]),
                             **({} if load is None else {"load_hint": load}))
          for k, load in kinds]
    if cpu_threads:
      kwargs["max_num_cpu_threads"] = cpu_threads
    self.fancy_upsampling = fancy_upsampling
    with_fancy = " ".join(([":fancy_upsampling=1"] if fancy_upsampling
                           else []) + ([self.options] if self.options else []))
    try:
      self._decoder = nvimgcodec.Decoder(
          **kwargs, **({"options": with_fancy} if with_fancy else {}))
    except RuntimeError:
      if not fancy_upsampling:
        raise
      # A backend that does not take the option: its own upsampling (the
      # pixels' bound to the host path is then looser).
      self.fancy_upsampling = False
      try:
        self._decoder = nvimgcodec.Decoder(
            **kwargs, **({"options": self.options} if self.options else {}))
      except RuntimeError as e:
        raise ValueError(f"nvImageCodec cannot create a decoder for "
                         f"backend {backend!r} on {self.device}: {e}"
                         ) from None
    # The others as the first was made (its options taken or not).
    opts = " ".join(([":fancy_upsampling=1"] if self.fancy_upsampling
                     else []) + ([self.options] if self.options else []))
    self._decoders = [self._decoder] + [
        nvimgcodec.Decoder(**kwargs, **({"options": opts} if opts else {}))
        for _ in range(threads - 1)]
    self._pool = None  # the decoders' threads, made on first use
    # The host path does not apply EXIF orientation (Pillow's Image.open
    # leaves it), so neither does this one.
    self.zero_copy = True
    self.clock = Stopwatch()
    self._params = nvimgcodec.DecodeParams(
        apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
        allow_any_depth=False)

  def for_device(self, device) -> "GpuBatchDecoder":
    if device == self.device:
      return self
    return GpuBatchDecoder(self.backend, device, self._fancy_asked,
                           self.options, self.cpu_threads, self.threads)

  def describe(self) -> str:
    many = self.threads > 1
    return (f"gpu (nvImageCodec, backend {self.backend}, {self.device}"
            f"{'' if self.fancy_upsampling else ', no fancy upsampling'}"
            f"{f', options {self.options!r}' if self.options else ''}"
            f"{f', {self.cpu_threads} CPU threads' if self.cpu_threads else ''}"
            f"{f', {self.threads} decoders on threads' if many else ''})")

  def close(self):
    """Stops the decoders' threads (a later decode starts them again)."""
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def _decode_all(self, encoded: list, decoder=None) -> list:
    decoder = decoder or self._decoder
    try:
      return list(decoder.decode(encoded, params=self._params))
    except Exception:  # pylint: disable=broad-except
      # One bad stream can fail the whole batch call: decode one by one,
      # so that only it is lost.
      out = []
      for data in encoded:
        try:
          out.append(decoder.decode(data, params=self._params))
        except Exception:  # pylint: disable=broad-except
          out.append(None)
      return out

  def _decode_part(self, decoder, encoded: list) -> list:
    """nvImageCodec's images of ``encoded`` as jax arrays on the device (or
    None: the host decodes it), by ``decoder`` on the calling thread."""
    with self.clock("nvimgcodec"):
      outs = self._decode_all(encoded, decoder)
    with self.clock("to_jax"):
      return [self._usable(img) for img in outs]

  def _decode_parts(self, encoded: list) -> list:
    """``_decode_part`` of the whole shard: in one call, or with several
    decoders in contiguous parts on their threads, in order."""
    k = min(len(self._decoders), len(encoded))
    if k <= 1:
      return self._decode_part(self._decoder, encoded)
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
          len(self._decoders), thread_name_prefix="decode-gpu")
    bounds = np.linspace(0, len(encoded), k + 1).round().astype(int)
    with self.clock("parts"):  # the caller's wall time for all of them
      futures = [self._pool.submit(self._decode_part, d, encoded[a:b])
                 for d, a, b in zip(self._decoders, bounds[:-1], bounds[1:])]
      return [a for f in futures for a in f.result()]

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
    n = len(encoded)
    ok, bad = np.zeros(n, bool), []
    # Rows for every member, so that the resize's executables key on the
    # shard's size, not on how many decoded; a kept image's row is its rank
    # among the kept, so the bad ones' rows are the tail cut off at the end.
    images = jnp.zeros((n, size, size, 3), jnp.uint8, device=self.device)
    decoded, rows = [], []  # uint8 [h, w, 3] on the device, any shape
    usable = self._decode_parts(encoded)
    for i, a in enumerate(usable):
      if a is None:
        try:
          # Decoded and resized on the host: on the device, it is a
          # (size, size) image that the resize only places.
          a = jax.device_put(host_lib.resize_crop(
              host_lib.decode_host(encoded[i], wheres[i], size), size),
                             self.device)
        except BadExample as e:
          bad.append((i, e.where, e.reason))
          continue
      decoded.append(a)
      rows.append(len(rows))
      ok[i] = True
    if decoded:
      with self.clock("resize"):
        images = resize_crop_into(images, decoded, rows)
    kept = len(rows)
    if kept < n:
      images = images[:kept]
    return images, ok, bad
