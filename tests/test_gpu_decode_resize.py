"""The GPU decoder's resize (train/data/decode/gpu.py: resize_crop_batch), on
jax CPU arrays: pixels against the host path's ``host.resize_crop``
(Pillow) on odd shapes, Pillow's reducing gap and pass order included, and
the number of executables it compiles on a web-like mix of shapes. The
``gpu`` test runs the whole GpuBatchDecoder on such a mix.
"""
import io

import numpy as np
import pytest
from PIL import Image

from tests.helpers import seed_of
from tests import host_decoder
from train.data.decode import choice
from train.data.decode import gpu as G
from train.data.decode import host as host_lib

# Measured on the CPU (float32 matmuls of Pillow's 22-bit coefficients): 1
# level in ~1e-5 of the pixels, where the exact sum lies within float32's
# error of a rounding boundary; the rest is Pillow's, bitwise (see
# test_plans_are_pillows_arithmetic_bitwise). The bound: that level, and
# 10x the measured fraction.
PIXEL_MAX, PIXEL_FRAC = 1, 1e-4


def _image(rng, h, w):
  """Smooth content with noise: both the resize's flat and busy regimes."""
  low = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
  im = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), float)
  return np.clip(im + rng.normal(0, 25, im.shape), 0, 255).astype(np.uint8)


def _device(images):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return [jnp.asarray(x) for x in images]


def _exact(image, size):
  """The device's arithmetic on a plan, in exact integers (numpy int64)."""
  p = G.plan(*image.shape[:2], size)
  x = image[p.rows.lo:p.rows.hi, p.cols.lo:p.cols.hi].astype(np.int64)
  if p.crop_only:
    return x
  if p.rows.factor > 1 or p.cols.factor > 1:
    fy, fx = p.rows.factor, p.cols.factor
    hr, wr = -(-x.shape[0] // fy), -(-x.shape[1] // fx)
    pad = np.zeros((hr * fy, wr * fx, 3), np.int64)
    pad[:x.shape[0], :x.shape[1]] = x
    s = pad.reshape(hr, fy, wr, fx, 3).sum((1, 3))
    cy = np.full(hr, fy)
    cy[-1] = p.rows.last
    cx = np.full(wr, fx)
    cx[-1] = p.cols.last
    n = cy[:, None] * cx[None]
    mult = np.vectorize(G._mult)(n)  # pylint: disable=protected-access
    x = ((s + (n // 2)[..., None]) * mult[..., None]) >> 24
  if p.vertical_first:
    x = x.transpose(1, 0, 2)

  def dense(start, taps, width):
    m = np.zeros((len(start), width + G.TAPS), np.int64)
    for i, (s0, k) in enumerate(zip(start, taps)):
      m[i, s0:s0 + G.TAPS] = k
    return m[:, :width]

  def rnd(v):
    return np.clip((v + (1 << 21)) >> 22, 0, 255)

  sa, ka, sb, kb = G._pass_taps(p)  # pylint: disable=protected-access
  y = rnd(np.einsum("hwc,sw->hsc", x, dense(sa, ka, x.shape[1])))
  z = rnd(np.einsum("th,hsc->tsc", dense(sb, kb, x.shape[0]), y))
  return z.transpose(1, 0, 2) if p.vertical_first else z


# Shapes: odd ones, square, taller and wider, a tall one past twice its width
# (Pillow 13 resizes it vertically first), upscales (223x500, 37x301) and,
# at 64, shrinks past 4x (Pillow's box reduce first, by 2 to 7).
CASES = [(37, 301), (256, 256), (300, 256), (1000, 333), (224, 224),
         (223, 500), (700, 256), (61, 70), (1200, 1000), (256, 1000)]


@pytest.mark.parametrize("size", [224, 64])
def test_plans_are_pillows_arithmetic_bitwise(size):
  # The host half (coefficients, windows, reduce, pass order) carried out in
  # exact integers is Pillow's resize_crop bitwise: what the device differs
  # by is its float32 rounding only.
  rng = np.random.default_rng(seed_of("plans", size))
  for h, w in CASES:
    x = _image(rng, h, w)
    assert np.array_equal(_exact(x, size), host_lib.resize_crop(x, size)), (
        h, w, size)


@pytest.mark.parametrize("size", [224, 64])
def test_device_resize_is_the_hosts_on_odd_shapes(size):
  rng = np.random.default_rng(seed_of("device", size))
  images = [_image(rng, h, w) for h, w in CASES]
  got = np.asarray(G.resize_crop_batch(_device(images), size))
  assert got.shape == (len(images), size, size, 3) and got.dtype == np.uint8
  diffs = []
  for (h, w), x, g in zip(CASES, images, got):
    d = np.abs(g.astype(np.int16) - host_lib.resize_crop(x, size))
    diffs.append(d)
    assert d.max() <= PIXEL_MAX, (h, w, size, d.max())
  frac = np.mean([(d > 0).mean() for d in diffs])
  print(f"size {size}: pixels off by one {frac:.2e}")
  assert frac <= PIXEL_FRAC
  # Reduced by Pillow here (the reducing gap: 1200x1000 by 2 at 224, by up
  # to 7 at 64), and (Pillow 13) ordered vertically first: both ran.
  plans = [G.plan(h, w, size) for h, w in CASES]
  assert any(p.vertical_first for p in plans) == (
      G._pillow_major() >= 13)  # pylint: disable=protected-access
  assert max(p.rows.factor for p in plans) == (2 if size == 224 else 7)


def _web_shapes(rng, n, short):
  """img2dataset keep_ratio-like: the shorter side one of ``short``, the
  other up to 4x it, 30% portrait."""
  out = []
  for _ in range(n):
    s = int(rng.choice(short))
    other = int(rng.integers(s, 4 * s + 1))
    out.append((s, other) if rng.random() < 0.7 else (other, s))
  return out


def _neighbour(h, w, size, taken):
  """A shape not in taken with (h, w)'s canvas and pass order."""
  p = G.plan(h, w, size)
  for dh, dw in ((0, 1), (0, -1), (1, 0), (-1, 0), (0, 2), (2, 0)):
    q = G.plan(h + dh, w + dw, size)
    if ((h + dh, w + dw) not in taken and q.canvas == p.canvas
        and q.vertical_first == p.vertical_first and not q.crop_only):
      return h + dh, w + dw
  raise AssertionError((h, w))


@pytest.mark.slow
def test_executables_stay_bounded_on_a_web_mix_of_shapes():
  # 3 micro-batches of 50 images, ~30 distinct shapes each, shorter sides
  # of three sizes (so several canvases, each group a different count): the
  # resize compiles per (canvas, count bucket) only,
  # and a second pass with new shapes in the same canvases compiles no new
  # resize (only each new shape's own cut).
  size = 32
  rng = np.random.default_rng(seed_of("web mix"))
  batches = []
  for _ in range(3):
    kinds = _web_shapes(rng, 30, (40, 56, 90))
    shapes = [kinds[i] for i in rng.integers(0, 30, 50)]
    batches.append(shapes)
  before = G.compiled_counts()
  for shapes in batches:
    images = [_image(rng, h, w) for h, w in shapes]
    got = np.asarray(G.resize_crop_batch(_device(images), size))
    for x, g in zip(images, got):
      assert np.abs(g.astype(np.int16)
                    - host_lib.resize_crop(x, size)).max() <= PIXEL_MAX
  after = G.compiled_counts()
  distinct = {s for b in batches for s in b}
  canvases = {G.plan(h, w, size).canvas for h, w in distinct}
  resize = after["resize"] - before["resize"]
  print(f"{len(distinct)} shapes, {len(canvases)} canvases: resize "
        f"executables {resize}, per-shape {after['prepare'] - before['prepare']}")
  # At most one per canvas and count bucket (1..CHUNK in powers of 2), and
  # far fewer than the groups (the old path compiled one per group).
  assert resize <= len(canvases) * 7 and resize <= 12
  assert after["prepare"] - before["prepare"] <= len(distinct)
  # Second pass: a new shape for every old one, same canvas and order.
  taken = set(distinct)
  renamed = {}
  for s in sorted(distinct):
    renamed[s] = _neighbour(*s, size, taken)
    taken.add(renamed[s])
  for shapes in batches:
    images = [_image(rng, *renamed[s]) for s in shapes]
    got = np.asarray(G.resize_crop_batch(_device(images), size))
    for x, g in zip(images, got):
      assert np.abs(g.astype(np.int16)
                    - host_lib.resize_crop(x, size)).max() <= PIXEL_MAX
  again = G.compiled_counts()
  assert again["resize"] == after["resize"]
  assert again["prepare"] - after["prepare"] <= len(renamed)


def test_squares_at_size_only_move_and_the_order_is_kept():
  # The fast path: images already at (size, size) are not resampled (no
  # resize executable), bitwise; mixed with resized ones, every row lands
  # at its input position.
  size = 24
  rng = np.random.default_rng(seed_of("squares"))
  squares = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
             for _ in range(5)]
  before = G.compiled_counts()["resize"]
  got = np.asarray(G.resize_crop_batch(_device(squares), size))
  assert np.array_equal(got, np.stack(squares))
  assert G.compiled_counts()["resize"] == before
  mixed = [squares[0], _image(rng, 30, 50), squares[1], _image(rng, 90, 40),
           _image(rng, 30, 50), squares[2]]
  got = np.asarray(G.resize_crop_batch(_device(mixed), size))
  for x, g in zip(mixed, got):
    assert np.abs(g.astype(np.int16)
                  - host_lib.resize_crop(x, size)).max() <= PIXEL_MAX
  assert G.resize_crop_batch([], size).shape == (0, size, size, 3)


@pytest.mark.parametrize("shape", [(48, 64), (150, 40), (300, 70)])
def test_a_shapes_many_members_resize_in_one_executable_as_pillow(shape):
  # SAME or more images of one shape (a centre-cropped shard's common case;
  # shrinking, Pillow's reducing gap and the vertical-first order among
  # the shapes): one fused call per SAME_CHUNK, no per-image cut, each image
  # Pillow's within the bound; the rows land where asked.
  size = 32
  rng = np.random.default_rng(seed_of(f"same {shape}"))
  n = G.SAME + 5
  images = [_image(rng, *shape) for _ in range(n)]
  before = G.compiled_counts()
  got = np.asarray(G.resize_crop_batch(_device(images), size))
  after = G.compiled_counts()
  assert after["same"] - before["same"] == 1
  assert after["prepare"] == before["prepare"]
  assert after["resize"] == before["resize"]
  diff = np.stack([np.abs(g.astype(np.int16) - host_lib.resize_crop(x, size))
                   for x, g in zip(images, got)])
  assert diff.max() <= PIXEL_MAX
  # Fewer than SAME of a shape: the per-shape cut and canvas path, whose
  # arithmetic (the same canvas, the same taps) this is, bitwise.
  few = np.asarray(G.resize_crop_batch(_device(images[:G.SAME - 1]), size))
  assert np.array_equal(few, got[:G.SAME - 1])
  assert G.compiled_counts()["prepare"] == after["prepare"] + 1
  # Rows given out of order, the padded tail dropped.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  rows = list(rng.permutation(n))
  out = G.resize_crop_into(jnp.zeros((n + 2, size, size, 3), jnp.uint8),
                           _device(images), rows)
  out = np.asarray(out)
  assert np.array_equal(out[rows], got) and not out[n:].any()


def test_counts_are_padded_to_powers_of_two_in_chunks():
  chunks = list(G._chunks(list(range(2 * G.CHUNK + 5))))  # pylint: disable=protected-access
  assert [(len(c), pad) for c, pad in chunks] == [
      (G.CHUNK, 0), (G.CHUNK, 0), (5, 3)]
  sides = {G._bucket(n) for n in range(1, 4 * 224 + 18)}  # pylint: disable=protected-access
  # A canvas side after the reducing gap is < 4 * size + 17: its buckets.
  assert len(sides) <= 48 and all(
      G._bucket(n) >= n and G._bucket(n) <= max(16, n * 9 // 8 + 16)  # pylint: disable=protected-access
      for n in range(1, 2000))


# ------------------------------------------------------------------- GPU

GPU_WHY = choice.gpu_unavailable()


def _jpeg(image):
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format="JPEG", quality=90)
  return buf.getvalue()


@pytest.mark.gpu
@pytest.mark.skipif(bool(GPU_WHY), reason=f"GPU decoder: {GPU_WHY}")
def test_gpu_decoder_on_a_web_mix_of_shapes_is_the_host_paths():
  # nvImageCodec + the device resize on JPEGs of keep_ratio shapes (shorter
  # side 256, no DCT-scaled host decode at 224) against the host path: the
  # bound of tests/test_gpu_decode.py's 256 px JPEGs (max 2 levels, mean
  # 0.01), and a bounded number of resize executables for ~40 shapes.
  rng = np.random.default_rng(seed_of("gpu web mix"))
  shapes = _web_shapes(rng, 40, (256,)) + [(256, 256), (224, 224), (300, 224)]
  jpgs = [_jpeg(_image(rng, h, w)) for h, w in shapes]
  where = [f"k{i}" for i in range(len(jpgs))]
  dec = G.GpuBatchDecoder()
  before = G.compiled_counts()["resize"]
  for _ in range(2):
    g, ok, bad = dec.decode(jpgs, where, 224)
    assert ok.all() and not bad and g.devices() == {dec.device}
  h, hok, _ = host_decoder.HostBatchDecoder().decode(jpgs, where, 224)
  assert hok.all()
  d = np.abs(np.asarray(g).astype(np.int16) - h)
  resize = G.compiled_counts()["resize"] - before
  print(f"{len(set(shapes))} shapes: max |diff| {d.max()}, mean "
        f"{d.mean():.4f}; resize executables {resize}")
  assert d.max() <= 2 and d.mean() <= 0.01
  assert resize <= 8
