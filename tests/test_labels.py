"""``labels=``: an arbitrary positive key per query, against float64.

One device (every backend), the ring and the gather strategy on 1-8 host
devices (where a query's positive may live on another device), repeated
labels, and the errors.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes, contrastive_loss, sharded_contrastive_loss
from tests import np_reference
from tests.helpers import as64, assert_rel_close, loss_floor, rand_emb, tol

TILES = BlockSizes(block_q=4, block_k=8)
PALLAS_TILES = BlockSizes(block_q=16, block_k=16, block_d=16, num_programs=2,
                          bwd_block_q=16, bwd_block_k=16, panel_rows=16,
                          f32_precision="highest")


def _labels(rng, n_q, n_k, repeat=True):
  lab = rng.integers(0, n_k, n_q)
  if repeat and n_q > 2:
    lab[1] = lab[0]  # Two queries share one positive.
  return lab


def _check(val, grads, x, y, t, b, direction, labels, dtype):
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), float(t), float(b),
                                         direction, labels)
  r = tol(dtype)
  assert_rel_close(val, ref[0], rtol=min(r, 2e-4), atol=loss_floor(x, y, t, b),
                   what="loss")
  eps = 1e-5 if dtype == jnp.float32 else 1e-3
  gross = 2 * abs(float(t)) / np.sqrt(min(x.shape[0], y.shape[0]))
  assert_rel_close(grads[0], ref[1], rtol=r, atol=eps * gross, what="d image")
  assert_rel_close(grads[1], ref[2], rtol=r, atol=eps * gross, what="d text")
  assert_rel_close(grads[2], ref[3], rtol=r, atol=eps * 2 * x.shape[1],
                   what="d scale")
  assert abs(float(grads[3]) - ref[4]) < (1e-5 if dtype == jnp.float32 else 1e-3)


@pytest.mark.parametrize("backend,tiles", [
    ("xla", TILES), ("pallas", PALLAS_TILES), ("reference", None)])
@pytest.mark.parametrize("direction,bx,by,dtype", [
    ("image_to_text", 13, 29, jnp.float32),
    ("text_to_image", 21, 11, jnp.float32),
    ("image_to_text", 17, 17, jnp.bfloat16),
])
def test_one_device_matches_float64(backend, tiles, direction, bx, by, dtype):
  rng = np.random.default_rng(bx * 100 + by)
  x, y = rand_emb(rng, bx, 7, dtype), rand_emb(rng, by, 7, dtype)
  n_q, n_k = (bx, by) if direction == "image_to_text" else (by, bx)
  lab = _labels(rng, n_q, n_k)
  t, b = jnp.float32(9.0), jnp.float32(0.7)

  def f(x, y, t, b):
    return contrastive_loss(x, y, t, logit_bias=b, direction=direction,
                            labels=jnp.asarray(lab), backend=backend,
                            block_sizes=tiles)
  val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, y, t, b)
  _check(val, grads, x, y, t, b, direction, lab, dtype)


def test_default_labels_equal_arange():
  rng = np.random.default_rng(5)
  x, y = rand_emb(rng, 9, 5, jnp.float32), rand_emb(rng, 14, 5, jnp.float32)
  kw = dict(direction="image_to_text", block_sizes=TILES, backend="xla")
  np.testing.assert_allclose(
      contrastive_loss(x, y, 4.0, labels=jnp.arange(9), **kw),
      contrastive_loss(x, y, 4.0, **kw), rtol=1e-6)


def mesh_of(n):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (conftest.py sets XLA_FLAGS)")
  return Mesh(np.array(jax.devices()[:n]), ("data",))


@pytest.mark.parametrize("n,strategy,direction,bq,bk", [
    (1, "ring", "image_to_text", 5, 9),
    (2, "ring", "image_to_text", 3, 5),
    (4, "ring", "text_to_image", 4, 4),
    (4, "ring", "image_to_text", 5, 2),  # More queries than keys.
    (8, "ring", "image_to_text", 3, 7),
    (2, "gather", "text_to_image", 5, 3),
    (8, "gather", "image_to_text", 3, 3),
])
def test_across_devices_matches_float64(n, strategy, direction, bq, bk):
  """Labels index the global keys: positives on other devices, repeats, and
  (with labels) fewer keys than queries."""
  mesh = mesh_of(n)
  rng = np.random.default_rng(n * 10 + bq)
  # Global arrays: n * bq queries, n * bk keys.
  q = rand_emb(rng, n * bq, 8, jnp.float32)
  k = rand_emb(rng, n * bk, 8, jnp.float32)
  x, y = (q, k) if direction == "image_to_text" else (k, q)
  lab = _labels(rng, n * bq, n * bk)
  # Every device's first query points at the last device's last key.
  lab[::bq] = n * bk - 1
  t, b = jnp.float32(7.0), jnp.float32(-0.4)

  def f(x, y, t, b):
    return sharded_contrastive_loss(
        x, y, t, mesh=mesh, logit_bias=b, direction=direction,
        labels=jnp.asarray(lab), strategy=strategy, backend="xla",
        block_sizes=TILES)
  val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, y, t, b)
  _check(val, grads, x, y, t, b, direction, lab, jnp.float32)


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_inside_shard_map_with_local_labels(strategy):
  """contrastive_loss(axis_name=...) takes this device's slice of labels."""
  mesh = mesh_of(4)
  rng = np.random.default_rng(11)
  x, y = rand_emb(rng, 12, 6, jnp.float32), rand_emb(rng, 20, 6, jnp.float32)
  lab = _labels(rng, 12, 20)
  t = jnp.float32(5.0)

  def local(x, y, lab, t):
    return jax.value_and_grad(
        lambda x, y, t: contrastive_loss(
            x, y, t, direction="image_to_text", labels=lab, axis_name="data",
            strategy=strategy, backend="pallas", block_sizes=PALLAS_TILES),
        argnums=(0, 1, 2))(x, y, t)

  val, grads = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P()),
      out_specs=(P(), (P("data"), P("data"), P()))))(x, y, jnp.asarray(lab), t)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), 5.0, 0.0,
                                         "image_to_text", lab)
  assert_rel_close(val, ref[0], rtol=2e-5, what="loss")
  for g, r, what in zip(grads, ref[1:4], ("d image", "d text", "d scale")):
    assert_rel_close(g, r, rtol=5e-5, atol=1e-7, what=what)


# --- Errors -----------------------------------------------------------------

X = jnp.ones((4, 3), jnp.float32)
Y = jnp.ones((6, 3), jnp.float32)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(direction="both", labels=jnp.arange(4)), ValueError,
     r"labels= needs direction='image_to_text' or 'text_to_image'"),
    (dict(direction="image_to_text", labels=jnp.arange(5)), ValueError,
     r"labels must have shape \(4,\).*image_emb has 4 rows.*\(5,\)"),
    (dict(direction="image_to_text", labels=jnp.ones((4,), jnp.float32)),
     TypeError, r"labels must be an integer array.*float32"),
    (dict(direction="image_to_text", labels=jnp.asarray([0, 1, 6, 2])),
     ValueError, r"labels must index the 6 rows of text_emb: got 6 at position 2"),
    (dict(direction="image_to_text", labels=jnp.asarray([0, -1, 1, 2])),
     ValueError, r"got -1 at position 1"),
])
def test_bad_labels(kw, exc, match):
  y = X if kw["direction"] == "both" else Y
  with pytest.raises(exc, match=match):
    contrastive_loss(X, y, 1.0, **kw)


def test_text_to_image_labels_index_images():
  with pytest.raises(ValueError, match=r"labels must index the 4 rows of "
                     r"image_emb: got 4"):
    contrastive_loss(X, X[:2], 1.0, direction="text_to_image",
                     labels=jnp.asarray([0, 4]))


def test_traced_out_of_range_label_gives_nan_not_a_finite_loss():
  """Inside the caller's jit the values cannot be read: NaN, not a loss
  silently missing a positive."""
  f = jax.jit(lambda lab: jax.value_and_grad(
      lambda x: contrastive_loss(x, Y, 1.0, direction="image_to_text",
                                 labels=lab, backend="xla"))(X))
  val, dx = f(jnp.asarray([0, 1, 2, 6]))
  assert np.isnan(float(val)) and np.isnan(np.asarray(dx)).all()
  val, dx = f(jnp.asarray([0, 1, 2, 5]))
  assert np.isfinite(float(val)) and np.isfinite(np.asarray(dx)).all()


def test_sharded_labels_errors():
  mesh = mesh_of(2)
  with pytest.raises(ValueError, match=r"labels must have shape \(4,\)"):
    sharded_contrastive_loss(X, Y[:4], 1.0, mesh=mesh, direction="image_to_text",
                             labels=jnp.arange(2))
  with pytest.raises(ValueError, match=r"got 4 at position 3"):
    sharded_contrastive_loss(X, Y[:4], 1.0, mesh=mesh,
                             direction="image_to_text",
                             labels=jnp.asarray([0, 1, 2, 4]))
