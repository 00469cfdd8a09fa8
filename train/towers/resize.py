"""Square image resize on the device, as Pillow's bicubic does it on the host.

The host pipeline can deliver images at a ``config.data.decode_size`` C
larger than the tower's S (a 256 px img2dataset shard then needs no host
work beyond the JPEG decode, which is ~3x cheaper than decode + resize);
``Tower.embed`` resizes them to S here, per micro-batch.

``resize_square`` follows Pillow's ``Image.resize(..., BICUBIC)`` (the host
path's ``host.resize_crop``): a separable, antialiased Keys cubic
(a = -0.5, support widened by the downscale factor), the width pass first,
each pass clipped to [0, 255] and rounded to whole levels as Pillow's uint8
passes are. The result is then Pillow's to within one level in rare pixels
(tests/test_stream_device_resize.py pins it), so a tower sees the same
pixels whichever side resized them. The passes are ``jax.image.resize``
matrix products at HIGHEST precision (float32, not TF32, on GPUs): two small
[C, S] contractions per image, cheap beside a tower's forward.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _pass(x, shape, precision):
  y = jax.image.resize(x, shape, "bicubic", antialias=True,
                       precision=precision)
  return jnp.round(jnp.clip(y, 0.0, 255.0))


def resize_square(images, size: int,
                  precision=jax.lax.Precision.HIGHEST):
  """uint8 [b, C, C, 3] -> float32 [b, size, size, 3] of whole levels in
  [0, 255]; images already at ``size`` are only cast. Traceable.
  ``precision``: of the passes' matrix products (HIGHEST, the trainer's:
  Pillow's pixels; another only for benchmarks/bench_train.py --stages).

  ValueError (at trace time) for non-square images or C < size: the host
  pipeline delivers squares at least the tower's size.
  """
  b, h, w, c = images.shape
  if h != w:
    raise ValueError(f"images of {h}x{w} px: the device resize takes "
                     "square images (the host pipeline crops them)")
  if h < size:
    raise ValueError(f"images of {h} px are smaller than the tower's "
                     f"image_size {size}: the device only shrinks "
                     "(config.data.decode_size must be >= image_size)")
  x = images.astype(jnp.float32)
  if h == size:
    return x
  x = _pass(x, (b, h, size, c), precision)  # Width first, as Pillow.
  return _pass(x, (b, size, size, c), precision)
