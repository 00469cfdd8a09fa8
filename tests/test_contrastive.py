"""The tiled CLIP loss (backend="xla") against the float64 numpy reference."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import BlockSizes, contrastive_loss
from tests import np_reference
from tests.helpers import (as64, assert_rel_close, loss_floor, rand_emb,
                           seed_of, tol)

SMALL_TILES = BlockSizes(block_q=16, block_k=32)


def _loss_and_grads(x, y, t, b, direction, backend="xla", block_sizes=SMALL_TILES):
  def f(x, y, t, b):
    return contrastive_loss(x, y, t, logit_bias=b, direction=direction,
                            backend=backend, block_sizes=block_sizes)
  if b is None:
    val, (dx, dy, dt) = jax.value_and_grad(
        lambda x, y, t: f(x, y, t, None), argnums=(0, 1, 2))(x, y, t)
    return val, dx, dy, dt, None
  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, y, t, b)
  return (val,) + grads


def _check(x, y, t, b, direction, dtype, backend="xla", block_sizes=SMALL_TILES):
  val, dx, dy, dt, db = _loss_and_grads(x, y, t, b, direction, backend, block_sizes)
  assert val.dtype == jnp.float32 and val.shape == ()
  assert dx.dtype == x.dtype and dy.dtype == y.dtype
  ref = np_reference.clip_loss_and_grads(
      as64(x), as64(y), float(t), 0.0 if b is None else float(b), direction)
  r = tol(dtype)
  # Values are f32 sums over exact products: tight even for 16-bit inputs.
  assert_rel_close(val, ref[0], rtol=min(r, 2e-4), atol=loss_floor(x, y, t, b),
                   what="loss")
  # Absolute floor: rounding relative to the gross size of the terms, which
  # matters where the true gradient cancels to ~0 (e.g. all-equal inputs).
  # With unit rows, |dx_i| <= 2 t max|y| / B, so ||dx|| <= 2 t max|y| / sqrt(B).
  eps = 1e-5 if dtype == jnp.float32 else 1e-3
  size = max(np.abs(as64(x)).max(), np.abs(as64(y)).max(), 1e-30)
  gross = 2 * abs(float(t)) * size / np.sqrt(min(x.shape[0], y.shape[0]))
  assert_rel_close(dx, ref[1], rtol=r, atol=eps * gross, what="d image")
  assert_rel_close(dy, ref[2], rtol=r, atol=eps * gross, what="d text")
  assert_rel_close(dt, ref[3], rtol=r, atol=eps * 2 * size**2 * x.shape[1],
                   what="d scale")
  if db is not None:
    # Exactly 0 for softmax; rounding leaves ~eps.
    assert abs(float(db) - ref[4]) < (1e-5 if dtype == jnp.float32 else 1e-3)


# A covering subset of B x D x direction x scale x bias x dtype.
CASES = [
    # (bx, by, d, direction, scale, bias, dtype)
    (1, 1, 1, "both", 1.0, None, jnp.float32),
    (2, 2, 3, "both", 14.3, 0.5, jnp.float32),
    (7, 7, 64, "both", 100.0, None, jnp.bfloat16),
    (64, 64, 768, "both", 14.3, -2.0, jnp.float16),
    (1000, 1000, 3, "both", 100.0, 1.0, jnp.float32),
    (7, 7, 1, "image_to_text", 1.0, None, jnp.float16),
    (7, 19, 3, "image_to_text", 14.3, 0.25, jnp.float32),
    (64, 100, 768, "image_to_text", 100.0, None, jnp.bfloat16),
    (1, 5, 64, "image_to_text", 14.3, None, jnp.float32),
    (19, 7, 64, "text_to_image", 1.0, -3.0, jnp.float32),
    (100, 64, 3, "text_to_image", 100.0, None, jnp.float16),
    (2, 1, 768, "text_to_image", 14.3, 1.0, jnp.bfloat16),
]


@pytest.mark.parametrize("bx,by,d,direction,scale,bias,dtype", CASES)
def test_matches_float64_reference(bx, by, d, direction, scale, bias, dtype):
  rng = np.random.default_rng(seed_of(bx, by, d, direction))
  x = rand_emb(rng, bx, d, dtype)
  y = rand_emb(rng, by, d, dtype)
  b = None if bias is None else jnp.float32(bias)
  _check(x, y, jnp.float32(scale), b, direction, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_odd_batch_default_tiles(dtype):
  """B=4097: several default-size tiles (the XLA backend's, 512 x 2048 on
  the CPU) with a ragged edge. Its tiles do not split D, so a small D (the
  float64 reference's cost is in it) tests the same."""
  rng = np.random.default_rng(7)
  x = rand_emb(rng, 4097, 96, dtype)
  y = rand_emb(rng, 4097, 96, dtype)
  _check(x, y, jnp.float32(14.3), jnp.float32(0.1), "both", dtype,
         block_sizes=None)


@pytest.mark.parametrize("tiles", [BlockSizes(1, 1), BlockSizes(3, 5),
                                   BlockSizes(64, 8), BlockSizes(1024, 1024)])
def test_any_tile_shape(tiles):
  rng = np.random.default_rng(3)
  x = rand_emb(rng, 37, 5, jnp.float32)
  y = rand_emb(rng, 37, 5, jnp.float32)
  _check(x, y, jnp.float32(5.0), jnp.float32(0.2), "both", jnp.float32,
         block_sizes=tiles)


ADVERSARIAL = ["duplicates", "all_equal", "huge_logits", "zeros", "opposite"]


@pytest.mark.parametrize("kind,dtype", list(itertools.product(
    ADVERSARIAL, [jnp.float32, jnp.bfloat16])))
def test_adversarial_inputs(kind, dtype):
  rng = np.random.default_rng(11)
  b, d = 33, 16
  x = rng.standard_normal((b, d))
  y = rng.standard_normal((b, d))
  if kind == "duplicates":
    x[::2] = x[0]
    y[1::3] = y[1]
  elif kind == "all_equal":
    x[:] = x[0]
    y[:] = x[0]
  elif kind == "huge_logits":
    # Near-identical unit vectors at scale 100: logits ~ +-100.
    base = rng.standard_normal(d)
    x = base + 1e-2 * rng.standard_normal((b, d))
    y = base + 1e-2 * rng.standard_normal((b, d))
    y[::2] *= -1
  elif kind == "zeros":
    x[:] = 0
  elif kind == "opposite":
    y = -x
  if kind != "zeros":
    x /= np.linalg.norm(x, axis=1, keepdims=True)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  _check(jnp.asarray(x, dtype), jnp.asarray(y, dtype), jnp.float32(100.0),
         jnp.float32(-5.0), "both", dtype)


def test_tiled_equals_reference_backend():
  rng = np.random.default_rng(5)
  x = rand_emb(rng, 50, 24, jnp.float32)
  y = rand_emb(rng, 50, 24, jnp.float32)
  for direction in ("both", "image_to_text", "text_to_image"):
    a = _loss_and_grads(x, y, jnp.float32(10.0), jnp.float32(0.3), direction)
    r = _loss_and_grads(x, y, jnp.float32(10.0), jnp.float32(0.3), direction,
                        backend="reference")
    for u, v in zip(a[:4], r[:4]):
      np.testing.assert_allclose(u, v, rtol=2e-5, atol=2e-7)


def test_auto_backend_on_cpu_is_tiled_and_exact():
  rng = np.random.default_rng(6)
  x = rand_emb(rng, 20, 8, jnp.float32)
  y = rand_emb(rng, 20, 8, jnp.float32)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), 3.0)
  np.testing.assert_allclose(contrastive_loss(x, y, 3.0), ref[0], rtol=1e-5)
  hlo = jax.jit(lambda x, y: contrastive_loss(x, y, 3.0)).lower(x, y).as_text()
  assert "while" in hlo  # The tile loop, not one big matrix.


def test_nan_input_gives_nan_loss():
  rng = np.random.default_rng(8)
  x = np.array(rand_emb(rng, 40, 8, jnp.float32))
  y = rand_emb(rng, 40, 8, jnp.float32)
  x[17, 3] = np.nan
  for backend in ("xla", "reference"):
    loss = contrastive_loss(jnp.asarray(x), y, 10.0, backend=backend,
                            block_sizes=SMALL_TILES if backend == "xla" else None)
    assert np.isnan(loss), backend
  g = jax.grad(lambda y: contrastive_loss(jnp.asarray(x), y, 10.0,
                                          block_sizes=SMALL_TILES))(y)
  assert np.isnan(np.asarray(g)).any()
  loss = contrastive_loss(y, y, jnp.float32(np.nan), block_sizes=SMALL_TILES)
  assert np.isnan(loss)


def test_python_scalars_and_int_scale_accepted():
  rng = np.random.default_rng(9)
  x = rand_emb(rng, 6, 4, jnp.float32)
  v1 = contrastive_loss(x, x, 10, logit_bias=1)
  v2 = contrastive_loss(x, x, jnp.float32(10.0), logit_bias=jnp.float32(1.0))
  np.testing.assert_allclose(v1, v2, rtol=1e-6)


def test_vmap_over_problems():
  rng = np.random.default_rng(10)
  xs = jnp.stack([rand_emb(rng, 21, 6, jnp.float32) for _ in range(3)])
  ys = jnp.stack([rand_emb(rng, 21, 6, jnp.float32) for _ in range(3)])
  ts = jnp.asarray([1.0, 10.0, 50.0], jnp.float32)
  f = lambda x, y, t: contrastive_loss(x, y, t, block_sizes=SMALL_TILES)
  vals, grads = jax.vmap(jax.value_and_grad(f, argnums=(0, 1, 2)))(xs, ys, ts)
  for k in range(3):
    ref = np_reference.clip_loss_and_grads(as64(xs[k]), as64(ys[k]), float(ts[k]))
    np.testing.assert_allclose(vals[k], ref[0], rtol=2e-5)
    assert_rel_close(grads[0][k], ref[1], 5e-5, what="vmap dx")
    assert_rel_close(grads[2][k], ref[3], 5e-5, what="vmap dt")


def test_jit_of_grad_and_scale_dtype_roundtrip():
  """A bfloat16 scale gets a bfloat16 gradient with the float64 value."""
  rng = np.random.default_rng(12)
  x = rand_emb(rng, 10, 4, jnp.bfloat16)
  y = rand_emb(rng, 10, 4, jnp.bfloat16)
  t = jnp.asarray(3.0, jnp.bfloat16)
  g = jax.jit(jax.grad(lambda t: contrastive_loss(x, y, t)))(t)
  assert g.dtype == jnp.bfloat16
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), 3.0)[3]
  # One bfloat16 rounding of the float32 gradient (8 mantissa bits).
  assert abs(float(g) - ref) <= 2**-7 * abs(ref) + 1e-6, (float(g), ref)
