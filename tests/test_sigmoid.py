"""The tiled SigLIP sigmoid loss against a float64 numpy reference.

The numpy reference (tests/np_reference.py) has the analytic gradients
G_ij = -z_ij * sigmoid(-z_ij * s_ij) / B, and is itself checked once
against central finite differences and against JAX x64 autodiff of
``infcl_jax.reference.sigmoid_loss_reference``.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import BlockSizes, sigmoid_loss
from infcl_jax import _math
from infcl_jax import reference
from infcl_jax.backends import registry
from tests import np_reference
from tests.helpers import as64, assert_rel_close, rand_emb

# Tiles smaller than the batch, with block_q != block_k, so that padding,
# several tiles per row / column and a diagonal that crosses tile borders
# are all exercised.
SMALL_TILES = BlockSizes(block_q=16, block_k=32)
TOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}


# ---------------------------------------------------------------- reference

def np_sigmoid_loss_and_grads(x, y, t, b, has_diagonal=True):
  """(loss, dx, dy, dt, db) in float64, from the closed forms.

  With ``has_diagonal=False`` every pair is a negative and the "loss" is the
  plain sum (no 1/B), matching the tile op ``sigmoid_sum``.
  """
  if has_diagonal:
    return np_reference.sigmoid_loss_and_grads(x, y, t, b)
  return np_reference.sigmoid_tile_sums_and_grads(x, y, t, b, False)


_as64 = as64
_rand_emb = rand_emb
_assert_rel_close = assert_rel_close


def test_np_reference_grads_match_finite_differences():
  rng = np.random.default_rng(0)
  x, y = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
  t, b = 2.5, -1.5
  _, dx, dy, dt, db = np_sigmoid_loss_and_grads(x, y, t, b)
  f = lambda x, y, t, b: np_sigmoid_loss_and_grads(x, y, t, b)[0]
  h = 1e-6

  def fd(i):
    args = [x, y, t, b]
    if i < 2:
      out = np.zeros_like(args[i])
      for k in np.ndindex(out.shape):
        p, m = args[i].copy(), args[i].copy()
        p[k] += h
        m[k] -= h
        ap, am = list(args), list(args)
        ap[i], am[i] = p, m
        out[k] = (f(*ap) - f(*am)) / (2 * h)
      return out
    ap, am = list(args), list(args)
    ap[i] += h
    am[i] -= h
    return (f(*ap) - f(*am)) / (2 * h)

  for i, g in enumerate((dx, dy, dt, db)):
    np.testing.assert_allclose(g, fd(i), rtol=1e-6, atol=1e-8)


def test_np_reference_matches_jax_x64_autodiff_of_library_reference():
  rng = np.random.default_rng(1)
  x, y = rng.standard_normal((6, 5)), rng.standard_normal((6, 5))
  t, b = 7.0, -3.0
  ref = np_sigmoid_loss_and_grads(x, y, t, b)
  with jax.enable_x64(True):
    val, grads = jax.value_and_grad(
        reference.sigmoid_loss_reference, argnums=(0, 1, 2, 3))(
            jnp.asarray(x), jnp.asarray(y), jnp.float64(t), jnp.float64(b))
    assert val.dtype == jnp.float64
    np.testing.assert_allclose(float(val), ref[0], rtol=1e-12)
    for g, r in zip(grads, ref[1:]):
      np.testing.assert_allclose(np.asarray(g), r, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------ value + grads

def _loss_and_grads(x, y, t, b, backend="xla", block_sizes=SMALL_TILES):
  f = lambda x, y, t, b: sigmoid_loss(x, y, t, b, backend=backend,
                                      block_sizes=block_sizes)
  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, y, t, b)
  return (val,) + grads


def _check(x, y, t, b, dtype, backend="xla", block_sizes=SMALL_TILES,
           loss_rtol=None):
  val, dx, dy, dt, db = _loss_and_grads(x, y, t, b, backend, block_sizes)
  assert val.dtype == jnp.float32 and val.shape == ()
  assert dx.dtype == x.dtype and dy.dtype == y.dtype
  assert dt.dtype == t.dtype and db.dtype == b.dtype
  ref = np_sigmoid_loss_and_grads(_as64(x), _as64(y), float(t), float(b))
  r = TOL[jnp.dtype(dtype).type]
  # The value is an f32 sum of per-element terms computed from exact
  # products of the (rounded) inputs, so it is tight even for 16-bit inputs.
  _assert_rel_close(val, ref[0], rtol=loss_rtol or min(r, 1e-4), what="loss")
  g_scale = np.abs(ref[1]).max() + np.abs(ref[2]).max()
  _assert_rel_close(dx, ref[1], rtol=r, atol=1e-6 * g_scale, what="d image")
  _assert_rel_close(dy, ref[2], rtol=r, atol=1e-6 * g_scale, what="d text")
  # The scalar grads are f32 sums of ~B^2 terms of both signs.
  _assert_rel_close(dt, ref[3], rtol=max(r, 1e-4), atol=1e-5, what="d scale")
  _assert_rel_close(db, ref[4], rtol=max(r, 1e-4), atol=1e-5, what="d bias")


CASES = [
    # (B, D, dtype, t, b)
    (1, 1, jnp.float32, 10.0, -10.0),
    (2, 3, jnp.float32, 1.0, 0.0),
    (7, 64, jnp.float32, 10.0, -10.0),
    (7, 3, jnp.bfloat16, 14.3, -5.0),
    (64, 768, jnp.float32, 10.0, -10.0),
    (64, 3, jnp.float16, 100.0, 10.0),
    (64, 64, jnp.bfloat16, 10.0, -10.0),
    (1000, 64, jnp.float32, 10.0, -10.0),
    (1000, 3, jnp.bfloat16, 1.0, 10.0),
    (1000, 1, jnp.float16, 5.0, -2.0),
]


@pytest.mark.parametrize("B,D,dtype,t,b", CASES)
def test_xla_matches_float64_reference(B, D, dtype, t, b):
  rng = np.random.default_rng(B * 1000 + D)
  x = _rand_emb(rng, B, D, dtype)
  y = _rand_emb(rng, B, D, dtype)
  _check(x, y, jnp.float32(t), jnp.float32(b), dtype)


@pytest.mark.parametrize("B,D,dtype", [(7, 3, jnp.float32),
                                       (64, 64, jnp.bfloat16)])
def test_reference_backend_matches_float64_reference(B, D, dtype):
  rng = np.random.default_rng(7 + B)
  x, y = _rand_emb(rng, B, D, dtype), _rand_emb(rng, B, D, dtype)
  _check(x, y, jnp.float32(10.0), jnp.float32(-10.0), dtype,
         backend="reference")


def test_default_block_sizes_and_auto_backend():
  rng = np.random.default_rng(3)
  x, y = _rand_emb(rng, 37, 16, jnp.float32), _rand_emb(rng, 37, 16, jnp.float32)
  _check(x, y, jnp.float32(10.0), jnp.float32(-10.0), jnp.float32,
         backend="auto", block_sizes=None)


def test_unnormalized_embeddings_and_python_scalars():
  rng = np.random.default_rng(4)
  x = _rand_emb(rng, 50, 8, jnp.float32, normalize=False)
  y = _rand_emb(rng, 50, 8, jnp.float32, normalize=False)
  val = sigmoid_loss(x, y, 3.0, -2, backend="xla", block_sizes=SMALL_TILES)
  ref = np_sigmoid_loss_and_grads(_as64(x), _as64(y), 3.0, -2.0)
  _assert_rel_close(val, ref[0], rtol=5e-5, what="loss")


# ---------------------------------------------------------------- extremes

@pytest.mark.parametrize("b", [-10.0, 10.0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_extreme_scale_near_identical_embeddings(b, dtype):
  # All rows nearly equal: every logit is about t + b = 100 +- 10, so the
  # B^2 - B negatives sit deep in the saturated region of the sigmoid.
  rng = np.random.default_rng(5)
  base = rng.standard_normal((1, 32))
  a = base + 1e-3 * rng.standard_normal((70, 32))
  a /= np.linalg.norm(a, axis=1, keepdims=True)
  x = jnp.asarray(a, dtype)
  c = base + 1e-3 * rng.standard_normal((70, 32))
  y = jnp.asarray(c / np.linalg.norm(c, axis=1, keepdims=True), dtype)
  _check(x, y, jnp.float32(100.0), jnp.float32(b), dtype)


def test_extreme_opposite_embeddings():
  # Positives far on the wrong side: s_ii = -100 - 10, log sigmoid would be
  # log(0) = -inf with a naive log(sigmoid(s)).
  rng = np.random.default_rng(6)
  x = _rand_emb(rng, 40, 16, jnp.float32)
  _check(x, -x, jnp.float32(100.0), jnp.float32(-10.0), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_tiny_loss_keeps_relative_accuracy(dtype):
  # Orthonormal embeddings: s_ii = t + b = 20, s_ij = b = -20. Every term is
  # softplus(-20) ~ 2e-9 and the loss ~ B * 2e-9: a formula that computed
  # softplus(s) - s, or a float16 gradient tile without rescaling (2e-9 is
  # far below float16's smallest subnormal), would lose it entirely.
  n = 48
  x = jnp.asarray(np.eye(n), dtype)
  y = jnp.asarray(np.eye(n), dtype)
  t, b = jnp.float32(40.0), jnp.float32(-20.0)
  val, dx, dy, dt, db = _loss_and_grads(x, y, t, b)
  ref = np_sigmoid_loss_and_grads(np.eye(n), np.eye(n), 40.0, -20.0)
  assert 0 < ref[0] < 1e-6
  _assert_rel_close(val, ref[0], rtol=1e-5, what="loss")
  _assert_rel_close(dt, ref[3], rtol=1e-4, what="d scale")
  _assert_rel_close(db, ref[4], rtol=1e-4, what="d bias")
  r = 1e-5 if dtype == jnp.float32 else TOL[jnp.dtype(dtype).type]
  if dtype != jnp.float16:
    _assert_rel_close(dx, ref[1], rtol=r, what="d image")
    _assert_rel_close(dy, ref[2], rtol=r, what="d text")
  # A float16 d image of ~2e-9 cannot exist (it rounds to 0 when cast to
  # the input dtype), but the tile op returns float32 and must keep it.
  kernel = registry.get("xla", "sigmoid")
  gx, gy, _, _ = kernel.sigmoid_grad(x, y, t, b, jnp.float32(1.0 / n),
                                     has_diagonal=True,
                                     block_sizes=SMALL_TILES)
  assert gx.dtype == jnp.float32
  _assert_rel_close(gx, ref[1], rtol=r, what="tile d image")
  _assert_rel_close(gy, ref[2], rtol=r, what="tile d text")


def test_nan_inputs_give_nan():
  rng = np.random.default_rng(8)
  x, y = _rand_emb(rng, 33, 8, jnp.float32), _rand_emb(rng, 33, 8, jnp.float32)
  t, b = jnp.float32(10.0), jnp.float32(-10.0)
  kw = dict(backend="xla", block_sizes=SMALL_TILES)
  assert np.isnan(float(sigmoid_loss(x.at[20, 3].set(jnp.nan), y, t, b, **kw)))
  assert np.isnan(float(sigmoid_loss(x, y.at[0, 0].set(jnp.nan), t, b, **kw)))
  assert np.isnan(float(sigmoid_loss(x, y, jnp.float32(jnp.nan), b, **kw)))
  assert np.isnan(float(sigmoid_loss(x, y, t, jnp.float32(jnp.nan), **kw)))
  grads = jax.grad(lambda x: sigmoid_loss(x, y, t, b, **kw))(
      x.at[20, 3].set(jnp.nan))
  assert np.isnan(np.asarray(grads)).any()
  xh = jnp.asarray(x, jnp.float16).at[5, 5].set(jnp.nan)
  dxh = jax.grad(lambda x: sigmoid_loss(x, jnp.asarray(y, jnp.float16), t, b,
                                        **kw))(xh)
  assert np.isnan(np.asarray(dxh, np.float32)).any()


# -------------------------------------------------------- tile ops directly

def test_tile_ops_without_diagonal_on_rectangular_block_pair():
  # The ring's off-diagonal tiles: every pair negative, n != m.
  rng = np.random.default_rng(9)
  x, y = _rand_emb(rng, 13, 5, jnp.float32), _rand_emb(rng, 29, 5, jnp.float32)
  kernel = registry.get("xla", "sigmoid")
  t, b, coef = jnp.float32(10.0), jnp.float32(-3.0), jnp.float32(0.25)
  ref = np_sigmoid_loss_and_grads(_as64(x), _as64(y), 10.0, -3.0,
                                  has_diagonal=False)
  tiles = BlockSizes(block_q=4, block_k=8)
  total = kernel.sigmoid_sum(x, y, t, b, has_diagonal=False, block_sizes=tiles)
  _assert_rel_close(total, ref[0], rtol=2e-5, what="sum")
  grads = kernel.sigmoid_grad(x, y, t, b, coef, has_diagonal=False,
                              block_sizes=tiles)
  for g, r, name in zip(grads, ref[1:], ("dx", "dy", "dscale", "dbias")):
    _assert_rel_close(g, 0.25 * np.asarray(r), rtol=2e-5, what=name)
  with pytest.raises(ValueError, match="has_diagonal"):
    kernel.sigmoid_sum(x, y, t, b, has_diagonal=True, block_sizes=tiles)
  with pytest.raises(ValueError, match="has_diagonal"):
    kernel.sigmoid_grad(x, y, t, b, coef, has_diagonal=True, block_sizes=tiles)


def test_tile_ops_inside_shard_map():
  # The ring calls the tile ops on per-device shards, where shard_map types
  # values as device-varying (check_vma): the scan carries must follow.
  from jax.sharding import Mesh, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
  rng = np.random.default_rng(12)
  x, y = _rand_emb(rng, 21, 5, jnp.float32), _rand_emb(rng, 21, 5, jnp.float32)
  kernel = registry.get("xla", "sigmoid")
  tiles = BlockSizes(block_q=8, block_k=16)

  def f(x, y, t, b):
    total = kernel.sigmoid_sum(x, y, t, b, has_diagonal=True,
                               block_sizes=tiles)
    dx, dy, dt, db = kernel.sigmoid_grad(x, y, t, b, 1.0 / 21,
                                         has_diagonal=True, block_sizes=tiles)
    return total[None], dx, dy, dt[None], db[None]

  out = jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=(P("d"), P("d"), P(), P()),
      out_specs=(P("d"),) * 5))(x, y, jnp.float32(3.0), jnp.float32(-2.0))
  ref = np_sigmoid_loss_and_grads(_as64(x), _as64(y), 3.0, -2.0)
  _assert_rel_close(out[0][0] / 21, ref[0], rtol=2e-5, what="sum")
  for g, r, name in zip(out[1:], ref[1:], ("dx", "dy", "dscale", "dbias")):
    _assert_rel_close(np.reshape(g, np.shape(r)), r, rtol=2e-5, what=name)


def test_softplus_is_stable():
  u = jnp.asarray([-80.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 100.0, 1000.0])
  got = np.asarray(_math.softplus(u), np.float64)
  want = np.logaddexp(0.0, np.asarray(u, np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Far below f32's range it is 0, never NaN; far above it is u itself.
  np.testing.assert_array_equal(
      np.asarray(_math.softplus(jnp.asarray([-1e4, 1e30]))),
      np.asarray([0.0, 1e30], np.float32))


# ------------------------------------------------ transformations, backends

def test_jit_grad_value_and_grad_agree():
  rng = np.random.default_rng(10)
  x, y = _rand_emb(rng, 45, 7, jnp.float32), _rand_emb(rng, 45, 7, jnp.float32)
  t, b = jnp.float32(10.0), jnp.float32(-10.0)

  def f(x, y, t, b):
    return 2.0 * sigmoid_loss(x, y, t, b, backend="xla",
                              block_sizes=SMALL_TILES)

  val, g1 = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, y, t, b)
  g2 = jax.grad(f, argnums=(0, 1, 2, 3))(x, y, t, b)
  ref = np_sigmoid_loss_and_grads(_as64(x), _as64(y), 10.0, -10.0)
  _assert_rel_close(val, 2 * ref[0], rtol=5e-5, what="loss")
  for a, c, r in zip(g1, g2, ref[1:]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6,
                               atol=1e-9)
    _assert_rel_close(a, 2 * np.asarray(r), rtol=5e-5, atol=1e-7)


def test_vmap_over_batch_of_problems():
  rng = np.random.default_rng(11)
  xs = jnp.stack([_rand_emb(rng, 21, 6, jnp.float32) for _ in range(3)])
  ys = jnp.stack([_rand_emb(rng, 21, 6, jnp.float32) for _ in range(3)])
  ts = jnp.asarray([1.0, 10.0, 30.0], jnp.float32)
  b = jnp.float32(-5.0)

  def f(x, y, t):
    return sigmoid_loss(x, y, t, b, backend="xla", block_sizes=SMALL_TILES)

  vals, (dxs, dts) = jax.vmap(jax.value_and_grad(f, argnums=(0, 2)))(xs, ys, ts)
  for k in range(3):
    ref = np_sigmoid_loss_and_grads(_as64(xs[k]), _as64(ys[k]), float(ts[k]),
                                    -5.0)
    _assert_rel_close(vals[k], ref[0], rtol=5e-5, what="loss")
    _assert_rel_close(dxs[k], ref[1], rtol=5e-5, what="d image")
    _assert_rel_close(dts[k], ref[3], rtol=1e-4, what="d scale")


# ------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((np.ones((4, 3, 2), np.float32), np.ones((4, 3), np.float32), 1.0, 0.0),
     {}, ValueError, r"image_emb.*rank 2.*\(4, 3, 2\)"),
    ((np.ones((4, 3), np.float32), np.ones((4,), np.float32), 1.0, 0.0),
     {}, ValueError, r"text_emb.*rank 2.*\(4,\)"),
    ((np.ones((4, 3), np.float32), np.ones((4, 5), np.float32), 1.0, 0.0),
     {}, ValueError, r"feature dimension.*\(4, 3\).*\(4, 5\)"),
    ((np.ones((4, 3), np.float32), np.ones((5, 3), np.float32), 1.0, 0.0),
     {}, ValueError, r"equal batch.*\(4, 3\).*\(5, 3\)"),
    ((np.ones((4, 3), np.int32), np.ones((4, 3), np.float32), 1.0, 0.0),
     {}, TypeError, r"image_emb.*int32"),
    ((np.ones((4, 3), np.float32), np.ones((4, 3), np.float32),
      np.ones((2,), np.float32), 0.0), {}, ValueError, r"logit_scale.*\(2,\)"),
    ((np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), 1.0,
      np.ones((1, 1), np.float32)), {}, ValueError, r"logit_bias.*\(1, 1\)"),
    ((np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), 1.0, None),
     {}, TypeError, r"logit_bias"),
    ((np.ones((4, 3), np.float32), np.ones((4, 3), np.float32), 1.0, 0.0),
     {"backend": "cuda"}, ValueError, r"backend.*'cuda'"),
])
def test_bad_input_errors(args, kwargs, exc, match):
  args = tuple(jnp.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
  with pytest.raises(exc, match=match):
    sigmoid_loss(*args, **kwargs)


# ------------------------------------------------------------------ memory

def _temp_bytes(fn, b, d=768, dtype=jnp.bfloat16):
  x = jax.ShapeDtypeStruct((b, d), dtype)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  grad = jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3)))
  return grad.lower(x, x, t, t).compile().memory_analysis().temp_size_in_bytes


def test_memory_linear_in_batch():
  tiled = lambda x, y, t, b: sigmoid_loss(x, y, t, b, backend="xla")
  sizes = (16384, 32768, 65536)
  temps = [_temp_bytes(tiled, b) for b in sizes]
  for b, m in zip(sizes, temps):
    # The logit matrix alone would be B^2 * 4 bytes (1 GiB at 16k); the
    # tiled loss needs the f32 grad accumulators (a few B * D * 4) plus
    # O(tile) buffers: measured ~105 / 201 / 393 MiB (jax 0.11.2, CPU).
    assert m < b * b * 4 / 8, (b, m)
    assert m <= 3 * b * 768 * 4 + 32 * 2**20, (b, m)
  # Doubling B at most about doubles the temporaries (O(B * D) + O(tile)).
  assert temps[1] <= 2.3 * temps[0], temps
  assert temps[2] <= 2.3 * temps[1], temps

  ref = lambda x, y, t, b: sigmoid_loss(x, y, t, b, backend="reference")
  ref_temps = [_temp_bytes(ref, b) for b in sizes[:2]]
  assert ref_temps[0] >= 16384 ** 2 * 4, ref_temps
  assert ref_temps[1] >= 3.5 * ref_temps[0], ref_temps
