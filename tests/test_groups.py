"""``groups=``: false-negative masking and multi-positive InfoNCE, against
float64.

The float64 references (``tests/group_reference.py``) are checked by finite
differences first; then the tile seam of the xla backend, the losses on one
device (xla and the full-matrix reference, every direction, both modes,
labels), the ring and the gather on 8 host devices with groups split across
devices, the sigmoid ring, the Flax head, and the errors. The kernel
backends' tiles have their own files (``test_groups_kernels.py``,
``test_groups_mosaic.py``).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from infcl_jax import BlockSizes
from infcl_jax import contrastive_loss
from infcl_jax import sharded_contrastive_loss
from infcl_jax import sharded_sigmoid_loss
from infcl_jax import sigmoid_loss
from infcl_jax.backends import registry
from infcl_jax.flax import ContrastiveLoss
from infcl_jax.losses import groups as groups_lib
from tests import group_reference as gr
from tests import np_reference
from tests.helpers import as64, assert_rel_close, rand_emb, seed_of, tol

TILES = BlockSizes(block_q=8, block_k=16)


# ------------------------------------------------------- group structures


def structure(rng, n, kind):
  """Group ids of n rows: all distinct, pairs, one big group among
  singletons, a few random groups, or one group for everything."""
  if kind == "distinct":
    return rng.permutation(n) * 3 + 1
  if kind == "pairs":
    return np.arange(n) // 2
  if kind == "big":
    g = np.arange(n) + 100
    g[rng.choice(n, size=max(2, n // 3), replace=False)] = 7
    return g
  if kind == "random":
    return rng.integers(0, max(2, n // 4), n)
  if kind == "one":
    return np.full(n, 5)
  raise ValueError(kind)


KINDS = ("distinct", "pairs", "big", "random", "one")


def one_way_groups(rng, kind, n_q, n_k):
  """(g_q, g_k) with every query related to at least its own key i."""
  g_q = structure(rng, n_q, kind)
  g_k = rng.integers(-50, -1, n_k)  # Extra keys unrelated unless equal.
  g_k[:n_q] = g_q
  return g_q, g_k


def close(actual, ref, dtype, what):
  r = tol(dtype)
  assert_rel_close(actual, ref, rtol=r, atol=1e-6, what=what)


def check_clip(val, grads, ref, dtype, t):
  close(val, ref[0], dtype, "loss")
  gross = 2 * abs(float(t)) / np.sqrt(ref[1].shape[0])
  eps = 1e-5 if dtype == jnp.float32 else 1e-3
  assert_rel_close(grads[0], ref[1], rtol=tol(dtype), atol=eps * gross,
                   what="d image")
  assert_rel_close(grads[1], ref[2], rtol=tol(dtype), atol=eps * gross,
                   what="d text")
  assert_rel_close(grads[2], ref[3], rtol=tol(dtype), atol=eps,
                   what="d scale")


# ------------------------------------------- the float64 references (FD)


def _fd(f, args, i, eps=1e-6):
  """Central differences of scalar f w.r.t. argument i (array or float)."""
  a = np.array(args[i], np.float64)
  out = np.zeros_like(a)
  for idx in np.ndindex(a.shape):
    hi, lo = a.copy(), a.copy()
    hi[idx] += eps
    lo[idx] -= eps
    ah = list(args); ah[i] = hi if a.shape else float(hi)
    al = list(args); al[i] = lo if a.shape else float(lo)
    out[idx] = (f(*ah) - f(*al)) / (2 * eps)
  return out


@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("direction,nx,ny", [
    ("both", 7, 7), ("image_to_text", 5, 8), ("text_to_image", 8, 5)])
def test_reference_gradients_match_finite_differences(mode, direction, nx, ny):
  rng = np.random.default_rng(nx * 10 + ny)
  x, y = rng.normal(size=(nx, 3)), rng.normal(size=(ny, 3))
  n_q, n_k = (ny, nx) if direction == "text_to_image" else (nx, ny)
  g_q, g_k = one_way_groups(rng, "random", n_q, n_k)
  g_k = g_q if direction == "both" else g_k
  loss = lambda x, y, t, b: gr.clip_loss_and_grads(
      x, y, t, b, g_q, g_k, mode, direction)[0]
  _, dx, dy, dt, _ = gr.clip_loss_and_grads(x, y, 1.7, 0.3, g_q, g_k, mode,
                                            direction)
  args = [x, y, 1.7, 0.3]
  np.testing.assert_allclose(dx, _fd(loss, args, 0), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(dy, _fd(loss, args, 1), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(dt, _fd(loss, args, 2), rtol=1e-6, atol=1e-8)


def test_reference_labels_gradients_match_finite_differences():
  rng = np.random.default_rng(3)
  x, y = rng.normal(size=(5, 3)), rng.normal(size=(9, 3))
  lab = rng.integers(0, 9, 5)
  g_q, g_k = rng.integers(0, 3, 5), rng.integers(0, 3, 9)
  loss = lambda x, y: gr.clip_loss_and_grads(
      x, y, 2.0, 0.0, g_q, g_k, "mask", "image_to_text", lab)[0]
  _, dx, dy, _, _ = gr.clip_loss_and_grads(x, y, 2.0, 0.0, g_q, g_k, "mask",
                                           "image_to_text", lab)
  np.testing.assert_allclose(dx, _fd(loss, [x, y], 0), rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(dy, _fd(loss, [x, y], 1), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", ["mask", "positives"])
def test_reference_sigmoid_gradients_match_finite_differences(mode):
  rng = np.random.default_rng(4)
  x, y = rng.normal(size=(6, 3)), rng.normal(size=(6, 3))
  g = np.array([0, 0, 1, 2, 2, 2])
  loss = lambda x, y, t, b: gr.sigmoid_loss_and_grads(x, y, t, b, g, mode)[0]
  ref = gr.sigmoid_loss_and_grads(x, y, 1.5, -1.0, g, mode)
  args = [x, y, 1.5, -1.0]
  for i in range(4):
    np.testing.assert_allclose(ref[i + 1], _fd(loss, args, i), rtol=1e-6,
                               atol=1e-8)


def test_reference_with_distinct_groups_is_the_plain_loss():
  rng = np.random.default_rng(5)
  x, y = rng.normal(size=(9, 4)), rng.normal(size=(9, 4))
  g = rng.permutation(9)
  plain = np_reference.clip_loss_and_grads(x, y, 3.0, 0.2)
  for mode in ("mask", "positives"):
    for a, b in zip(gr.clip_loss_and_grads(x, y, 3.0, 0.2, g, g, mode), plain):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------- the tile seam


@pytest.mark.parametrize("kind", ["pairs", "big", "one"])
def test_xla_tiles_match_float64(kind):
  rng = np.random.default_rng(len(kind))
  n, m, d = 29, 45, 12
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, m, d, jnp.float32)
  gx = structure(rng, n, kind)
  gy = np.concatenate([gx, structure(rng, m - n, kind) + 1000])
  gy[-1] = gx[0]  # A related pair off the diagonal.
  g = (jnp.asarray(gx, jnp.int32), jnp.asarray(gy, jnp.int32))
  t, b = 4.0, 0.3
  tiles = registry.get("xla", "softmax")
  r, c = tiles.lse(x, y, t, b, rows=True, cols=True, block_sizes=TILES,
                   groups=g)
  rr, cc = gr.tile_lse(as64(x), as64(y), t, b, gx, gy)
  np.testing.assert_array_equal(np.isinf(r), np.isinf(rr))
  np.testing.assert_allclose(np.where(np.isinf(rr), 0, r),
                             np.where(np.isinf(rr), 0, rr), rtol=1e-5)
  np.testing.assert_allclose(np.where(np.isinf(cc), 0, c),
                             np.where(np.isinf(cc), 0, cc), rtol=1e-5)
  # A row of related pairs only has LSE -inf and no gradient (not NaN).
  rs = np.where(np.isinf(rr), -np.inf, rr).astype(np.float32)
  cs = np.where(np.isinf(cc), -np.inf, cc).astype(np.float32)
  got = tiles.lse_grad(x, y, t, b, rs, cs, 0.25, 0.5, block_sizes=TILES,
                       groups=g)
  ref = gr.tile_lse_grads(as64(x), as64(y), t, b, rs, cs, 0.25, 0.5, gx, gy)
  for a, e, what in zip(got, ref, ("dx", "dy", "dscale", "dbias")):
    assert_rel_close(a, e, rtol=2e-5, atol=1e-6, what=what)
  sig = registry.get("xla", "sigmoid")
  ys, gys = y[:n], gy[:n]
  for mode in ("mask", "positives"):
    for diag in (True, False):
      gs = (g[0], jnp.asarray(gys))
      tot = sig.sigmoid_sum(x, ys, t, -1.0, has_diagonal=diag,
                            block_sizes=TILES, groups=gs, group_mode=mode)
      grads = sig.sigmoid_grad(x, ys, t, -1.0, 1.0, has_diagonal=diag,
                               block_sizes=TILES, groups=gs, group_mode=mode)
      ref = gr.sigmoid_tile(as64(x), as64(ys), t, -1.0, gx, gys, diag, mode)
      for a, e in zip((tot,) + tuple(grads), ref):
        assert_rel_close(a, e, rtol=2e-5, atol=1e-6, what=f"{mode} {diag}")


def test_tile_groups_are_checked():
  tiles = registry.get("xla", "softmax")
  x = jnp.ones((4, 2))
  with pytest.raises(ValueError, match=r"groups must be \(\(n,\), \(m,\)\)"):
    tiles.lse(x, x, 1.0, 0.0, rows=True, cols=False,
              groups=(jnp.zeros(3, jnp.int32), jnp.zeros(4, jnp.int32)))
  with pytest.raises(ValueError, match="group_mode must be one of"):
    registry.get("xla", "sigmoid").sigmoid_sum(
        x, x, 1.0, 0.0, has_diagonal=True,
        groups=(jnp.zeros(4, jnp.int32),) * 2, group_mode="both")


def test_related_sum_against_numpy():
  rng = np.random.default_rng(6)
  g_dst, g_src = rng.integers(0, 9, 31), rng.integers(0, 9, 23)
  vals = rng.normal(size=(23, 3))
  got = groups_lib.related_sum(jnp.asarray(g_dst), jnp.asarray(g_src),
                               jnp.asarray(vals, jnp.float32))
  ref = (g_dst[:, None] == g_src[None, :]).astype(float) @ vals
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)




def test_positives_term_against_numpy():
  # Ids drawn so that some queries have no related key in this shard (their
  # term is 0) and groups repeat on both sides; value and gradients against
  # the dense float64 sum over related pairs.
  rng = np.random.default_rng(7)
  bq, bk, d = 29, 23, 5
  g_q, g_k = rng.integers(0, 14, bq), rng.integers(3, 12, bk)
  q, k = rng.normal(size=(bq, d)), rng.normal(size=(bk, d))
  w_q, w_k = rng.uniform(0.1, 1.0, bq), rng.uniform(0.1, 1.0, bk)
  scale, bias = 1.7, -0.3
  rel = (g_q[:, None] == g_k[None, :]).astype(float)
  w = rel * (w_q[:, None] + w_k[None, :])
  ref = np.sum(w * (scale * q @ k.T + bias))
  f = lambda q_, k_, s_, b_: groups_lib.positives_term(
      q_, k_, s_, b_, jnp.asarray(g_q), jnp.asarray(g_k),
      jnp.asarray(w_q, jnp.float32), jnp.asarray(w_k, jnp.float32))
  args = (jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
          jnp.float32(scale), jnp.float32(bias))
  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(*args)
  np.testing.assert_allclose(val, ref, rtol=1e-5)
  s = q @ k.T
  want = (scale * w @ k, scale * w.T @ q, np.sum(w * s), np.sum(w))
  for got, exp in zip(grads, want):
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
# ------------------------------------------------------------ one device


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("kind", ["pairs", "big", "one"])
def test_both_directions_match_float64(backend, mode, kind):
  rng = np.random.default_rng(seed_of(mode, kind))
  n, d = 37, 16
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, n, d, jnp.float32)
  g = structure(rng, n, kind)
  t, b = jnp.float32(8.0), jnp.float32(0.4)

  def f(x, y, t, b):
    return contrastive_loss(x, y, t, logit_bias=b, groups=g, group_mode=mode,
                            backend=backend, block_sizes=None if backend ==
                            "reference" else TILES)

  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, y, t, b)
  ref = gr.clip_loss_and_grads(as64(x), as64(y), 8.0, 0.4, g, g, mode)
  check_clip(val, grads, ref, jnp.float32, t)


@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("direction,bx,by", [
    ("image_to_text", 21, 34), ("text_to_image", 34, 21)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_way_matches_float64(mode, direction, bx, by, dtype):
  rng = np.random.default_rng(bx + by + (mode == "mask"))
  x, y = rand_emb(rng, bx, 12, dtype), rand_emb(rng, by, 12, dtype)
  n_q, n_k = (bx, by) if direction == "image_to_text" else (by, bx)
  g_q, g_k = one_way_groups(rng, "random", n_q, n_k)
  groups = (g_q, g_k) if direction == "image_to_text" else (g_k, g_q)
  t = jnp.float32(6.0)

  def f(x, y, t, b):
    return contrastive_loss(x, y, t, logit_bias=b, direction=direction,
                            groups=groups, group_mode=mode, backend="xla",
                            block_sizes=TILES)

  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(
      x, y, t, jnp.float32(0.0))
  ref = gr.clip_loss_and_grads(as64(x), as64(y), 6.0, 0.0, g_q, g_k, mode,
                               direction)
  check_clip(val, grads, ref, dtype, t)


def test_labels_compose_with_mask():
  """The labelled key stays each query's positive; related others leave."""
  rng = np.random.default_rng(8)
  x, y = rand_emb(rng, 19, 8, jnp.float32), rand_emb(rng, 40, 8, jnp.float32)
  lab = rng.integers(0, 40, 19)
  g_q, g_k = rng.integers(0, 4, 19), rng.integers(0, 4, 40)

  def f(x, y):
    return contrastive_loss(x, y, 5.0, direction="image_to_text", labels=lab,
                            groups=(g_q, g_k), backend="xla",
                            block_sizes=TILES)

  val, grads = jax.value_and_grad(f, argnums=(0, 1))(x, y)
  ref = gr.clip_loss_and_grads(as64(x), as64(y), 5.0, 0.0, g_q, g_k, "mask",
                               "image_to_text", lab)
  check_clip(val, tuple(grads) + (ref[3],), ref, jnp.float32, 5.0)


@pytest.mark.parametrize("mode", ["mask", "positives"])
def test_distinct_groups_equal_the_plain_loss_within_rounding(mode):
  """Not bitwise: "mask" puts the positive into its LSE last, "positives"
  sums it through the grouped sums; both within float32 rounding."""
  rng = np.random.default_rng(9)
  x, y = rand_emb(rng, 50, 16, jnp.float32), rand_emb(rng, 50, 16, jnp.float32)
  g = rng.permutation(50)
  f = lambda x, y, **kw: contrastive_loss(x, y, 9.0, backend="xla",
                                          block_sizes=TILES, **kw)
  plain, gp = jax.value_and_grad(f, argnums=(0, 1))(x, y)
  grouped, gg = jax.value_and_grad(
      lambda x, y: f(x, y, groups=g, group_mode=mode), argnums=(0, 1))(x, y)
  np.testing.assert_allclose(grouped, plain, rtol=2e-6)
  for a, b in zip(gg, gp):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_without_groups_the_loss_is_bitwise_unchanged():
  """``groups=None`` runs exactly today's computation."""
  rng = np.random.default_rng(10)
  x, y = rand_emb(rng, 40, 16, jnp.float32), rand_emb(rng, 40, 16, jnp.float32)
  a = contrastive_loss(x, y, 9.0, backend="xla", block_sizes=TILES)
  b = contrastive_loss(x, y, 9.0, backend="xla", block_sizes=TILES,
                       groups=None, group_mode="mask")
  assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_a_query_without_positives_gives_nan():
  x = rand_emb(np.random.default_rng(11), 6, 4, jnp.float32)
  y = rand_emb(np.random.default_rng(12), 9, 4, jnp.float32)
  g_q, g_k = np.arange(6), np.arange(9) + 1  # Query 0 has no related key.
  val = contrastive_loss(x, y, 2.0, direction="image_to_text",
                         groups=(g_q, g_k), group_mode="positives",
                         backend="xla")
  assert np.isnan(val)


def test_nan_embedding_is_not_masked_away():
  rng = np.random.default_rng(13)
  x, y = rand_emb(rng, 8, 4, jnp.float32), rand_emb(rng, 8, 4, jnp.float32)
  x = x.at[3, 0].set(jnp.nan)
  g = np.array([0, 0, 1, 1, 2, 2, 3, 3])
  for mode in ("mask", "positives"):
    assert np.isnan(contrastive_loss(x, y, 2.0, groups=g, group_mode=mode,
                                     backend="xla"))
    assert np.isnan(sigmoid_loss(x, y, 2.0, -1.0, groups=g, group_mode=mode,
                                 backend="xla"))


@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_sigmoid_matches_float64(mode, dtype):
  rng = np.random.default_rng(14)
  n = 41
  x, y = rand_emb(rng, n, 16, dtype), rand_emb(rng, n, 16, dtype)
  g = structure(rng, n, "random")

  def f(x, y, t, b):
    return sigmoid_loss(x, y, t, b, groups=g, group_mode=mode, backend="xla",
                        block_sizes=TILES)

  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(
      x, y, jnp.float32(5.0), jnp.float32(-2.0))
  ref = gr.sigmoid_loss_and_grads(as64(x), as64(y), 5.0, -2.0, g, mode)
  r = tol(dtype)
  for a, e, what in zip((val,) + tuple(grads), ref,
                        ("loss", "dx", "dy", "dscale", "dbias")):
    assert_rel_close(a, e, rtol=r, atol=1e-6, what=what)
  ref_val = sigmoid_loss(x, y, 5.0, -2.0, groups=g, group_mode=mode,
                         backend="reference")
  assert_rel_close(ref_val, ref[0], rtol=r, what="reference backend")


def test_groups_traced_inside_jit():
  rng = np.random.default_rng(15)
  x, y = rand_emb(rng, 20, 8, jnp.float32), rand_emb(rng, 20, 8, jnp.float32)
  g = structure(rng, 20, "pairs")
  f = jax.jit(lambda x, y, g: contrastive_loss(x, y, 4.0, groups=g,
                                                backend="xla"))
  ref = gr.clip_loss_and_grads(as64(x), as64(y), 4.0, 0.0, g, g, "mask")
  assert_rel_close(f(x, y, jnp.asarray(g)), ref[0], rtol=1e-5)


def test_flax_head_passes_groups():
  rng = np.random.default_rng(16)
  x, y = rand_emb(rng, 12, 8, jnp.float32), rand_emb(rng, 12, 8, jnp.float32)
  g = structure(rng, 12, "pairs")
  for mode in ("mask", "positives"):
    head = ContrastiveLoss(backend="xla", normalize=False, group_mode=mode)
    params = head.init(jax.random.key(0), x, y, groups=g)
    val = head.apply(params, x, y, groups=g)
    t = float(np.exp(params["params"]["log_scale"]))
    ref = gr.clip_loss_and_grads(as64(x), as64(y), t, 0.0, g, g, mode)
    assert_rel_close(val, ref[0], rtol=1e-5, what=mode)


# ------------------------------------------------- the ring and the gather


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("data",))


@pytest.mark.parametrize("strategy", ["ring", "gather"])
@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("direction,bx,by", [
    ("both", 48, 48), ("image_to_text", 32, 56), ("text_to_image", 56, 32)])
def test_sharded_matches_float64(strategy, mode, direction, bx, by):
  """8 devices; groups spread over devices (a query's related keys live on
  others): the ids travel with their shard."""
  rng = np.random.default_rng(bx * 7 + by + (strategy == "ring"))
  x, y = rand_emb(rng, bx, 8, jnp.float32), rand_emb(rng, by, 8, jnp.float32)
  n_q, n_k = (by, bx) if direction == "text_to_image" else (bx, by)
  g_q, g_k = one_way_groups(rng, "random", n_q, n_k)
  if direction == "both":
    groups, g_k = g_q, g_q
  else:
    groups = (g_k, g_q) if direction == "text_to_image" else (g_q, g_k)
  mesh = _mesh(8)

  def f(x, y, t, b):
    return sharded_contrastive_loss(
        x, y, t, logit_bias=b, mesh=mesh, direction=direction, groups=groups,
        group_mode=mode, strategy=strategy, backend="xla",
        block_sizes=BlockSizes(block_q=4, block_k=8))

  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(
      x, y, jnp.float32(7.0), jnp.float32(0.5))
  ref = gr.clip_loss_and_grads(as64(x), as64(y), 7.0, 0.5, g_q, g_k, mode,
                               direction)
  check_clip(val, grads, ref, jnp.float32, 7.0)


def test_sharded_labels_with_mask_on_the_ring():
  rng = np.random.default_rng(17)
  x, y = rand_emb(rng, 24, 8, jnp.float32), rand_emb(rng, 40, 8, jnp.float32)
  lab = rng.integers(0, 40, 24)
  g_q, g_k = rng.integers(0, 5, 24), rng.integers(0, 5, 40)
  mesh = _mesh(4)

  def f(x, y):
    return sharded_contrastive_loss(
        x, y, 3.0, mesh=mesh, direction="image_to_text", labels=lab,
        groups=(g_q, g_k), strategy="ring", backend="xla",
        block_sizes=BlockSizes(block_q=4, block_k=8))

  val, grads = jax.value_and_grad(f, argnums=(0, 1))(x, y)
  ref = gr.clip_loss_and_grads(as64(x), as64(y), 3.0, 0.0, g_q, g_k, "mask",
                               "image_to_text", lab)
  check_clip(val, tuple(grads) + (ref[3],), ref, jnp.float32, 3.0)


@pytest.mark.parametrize("mode", ["mask", "positives"])
def test_sigmoid_ring_matches_float64(mode):
  rng = np.random.default_rng(18)
  x, y = rand_emb(rng, 48, 8, jnp.float32), rand_emb(rng, 48, 8, jnp.float32)
  g = structure(rng, 48, "random")
  mesh = _mesh(8)

  def f(x, y, t, b):
    return sharded_sigmoid_loss(x, y, t, b, mesh=mesh, groups=g,
                                group_mode=mode, backend="xla",
                                block_sizes=BlockSizes(block_q=4, block_k=8))

  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(
      x, y, jnp.float32(4.0), jnp.float32(-1.0))
  ref = gr.sigmoid_loss_and_grads(as64(x), as64(y), 4.0, -1.0, g, mode)
  for a, e, what in zip((val,) + tuple(grads), ref,
                        ("loss", "dx", "dy", "dscale", "dbias")):
    assert_rel_close(a, e, rtol=1e-5, atol=1e-7, what=what)


# --------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs,match", [
    (dict(groups=np.zeros(5, int)), r"groups must have shape \(6,\)"),
    (dict(groups=np.zeros(6)), "groups must be an integer array"),
    (dict(groups=(np.zeros(6, int),) * 3), "one array or a pair"),
    (dict(groups=np.zeros(6, int), group_mode="all"),
     "group_mode must be one of"),
    (dict(group_mode="positives"), "needs groups="),
    (dict(groups=(np.zeros(6, int), np.zeros(5, int))),
     r"text groups must have shape \(6,\)"),
])
def test_bad_groups_are_one_line_errors(kwargs, match):
  x = jnp.ones((6, 4))
  with pytest.raises((ValueError, TypeError), match=match):
    contrastive_loss(x, x, 1.0, backend="xla", **kwargs)


def test_unpaired_batch_needs_a_pair_of_arrays():
  with pytest.raises(ValueError, match="needs a paired batch"):
    contrastive_loss(jnp.ones((4, 2)), jnp.ones((6, 2)), 1.0,
                     direction="image_to_text", groups=np.zeros(4, int))


def test_positives_cannot_take_labels():
  with pytest.raises(ValueError, match="labels= cannot be combined"):
    contrastive_loss(jnp.ones((4, 2)), jnp.ones((6, 2)), 1.0,
                     direction="image_to_text", labels=np.arange(4),
                     groups=(np.zeros(4, int), np.zeros(6, int)),
                     group_mode="positives")


def test_sigmoid_groups_are_checked():
  x = jnp.ones((6, 4))
  with pytest.raises(ValueError, match=r"groups must have shape \(6,\)"):
    sigmoid_loss(x, x, 1.0, 0.0, groups=np.zeros(3, int))


# ------------------------------------------------ float32 on TF32 tiles


def _correlated(n, m, d, seed, noise=3.0):
  """Unit-norm pairs sharing a direction (a trained model: the positives
  score well above the rest, the loss is small)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(max(n, m), d))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y = x + noise * rng.normal(size=x.shape) / np.sqrt(d)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  return x[:n].astype(np.float32), y[:m].astype(np.float32)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: "
                    "off it the kernels are interpreted in exact float32")
@pytest.mark.parametrize("backend", ["pallas", "mosaic"])
@pytest.mark.parametrize("n,m,d,t,direction", [
    (8192, 8192, 768, 50.0, "both"), (3001, 3001, 200, 50.0, "both"),
    (2500, 1000, 96, 30.0, "text_to_image")])
def test_float32_on_tf32_tiles_keeps_a_small_loss_accurate(backend, n, m, d,
                                                           t, direction):
  """The positive leaves the TF32 tiles and comes back in float32
  (``groups.exact_positive_ids``): relative loss error <= 1e-3 where the
  loss is small, against float64. (The "triton" backend's TF32 products
  are coarser: 1.5e-3 to 3.2e-3 on these cases, measured on the H200 and
  said in README; ``f32_precision="highest"`` is its float32 route.)"""
  x, y = _correlated(n, m, d, seed=n + d)
  f = lambda x, y: contrastive_loss(x, y, jnp.float32(t),
                                    direction=direction, backend=backend)
  val, (gx, gy) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, y)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), t, 0.0, direction)
  assert abs(float(val) - ref[0]) <= 1e-3 * abs(ref[0]), (float(val), ref[0])
  assert_rel_close(gx, ref[1], rtol=1e-2, what="d image")
  assert_rel_close(gy, ref[2], rtol=1e-2, what="d text")
