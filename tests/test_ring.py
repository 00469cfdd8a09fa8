"""The CLIP loss across devices (ring and gather) vs the float64 reference.

Runs on the 8 host CPU devices that conftest.py asks XLA for. The reference
is the single-device loss on the gathered batch: the shards concatenated in
axis order.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes, contrastive_loss, sharded_contrastive_loss
from tests import np_reference
from tests.helpers import (as64, assert_rel_close, loss_floor,
                           compiled_kernels_in_shard_map, rand_emb, seed_of,
                           tol)

# Tiles smaller than a shard, so that padded and multi-tile paths run.
TILES = BlockSizes(block_q=4, block_k=8)


def mesh_of(n, names=("data",), shape=None):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (conftest.py sets XLA_FLAGS)")
  devs = np.array(jax.devices()[:n]).reshape(shape or (n,))
  return Mesh(devs, names)


def _check_against_reference(val, grads, x, y, t, b, direction, dtype):
  ref = np_reference.clip_loss_and_grads(
      as64(x), as64(y), float(t), 0.0 if b is None else float(b), direction)
  r = tol(dtype)
  assert_rel_close(val, ref[0], rtol=min(r, 2e-4), atol=loss_floor(x, y, t, b),
                   what="loss")
  eps = 1e-5 if dtype == jnp.float32 else 1e-3
  gross = 2 * abs(float(t)) / np.sqrt(min(x.shape[0], y.shape[0]))
  dx, dy, dt = grads[:3]
  assert dx.dtype == x.dtype and dy.dtype == y.dtype
  assert_rel_close(dx, ref[1], rtol=r, atol=eps * gross, what="d image")
  assert_rel_close(dy, ref[2], rtol=r, atol=eps * gross, what="d text")
  assert_rel_close(dt, ref[3], rtol=r, atol=eps * 2 * x.shape[1], what="d scale")
  if b is not None:
    assert abs(float(grads[3]) - ref[4]) < (1e-5 if dtype == jnp.float32 else 1e-3)


# (n_devices, strategy, direction, b_x, b_y, D, dtype, bias): a covering
# subset of N x strategy x direction x dtype x bias, odd local batches.
CASES = [
    (1, "ring", "both", 5, 5, 8, jnp.float32, 0.5),
    (2, "ring", "both", 3, 3, 8, jnp.float32, None),
    (4, "ring", "both", 5, 5, 16, jnp.bfloat16, -1.0),
    (8, "ring", "both", 7, 7, 8, jnp.float32, 0.3),
    (8, "ring", "both", 9, 9, 16, jnp.bfloat16, None),
    (2, "ring", "image_to_text", 3, 5, 8, jnp.float32, 1.0),
    (4, "ring", "image_to_text", 3, 7, 8, jnp.float32, None),
    (8, "ring", "image_to_text", 5, 5, 8, jnp.bfloat16, 0.2),
    (4, "ring", "text_to_image", 9, 5, 8, jnp.float32, -0.5),
    (8, "ring", "text_to_image", 7, 3, 16, jnp.bfloat16, None),
    (1, "gather", "image_to_text", 3, 5, 8, jnp.float32, None),
    (2, "gather", "both", 5, 5, 8, jnp.bfloat16, 0.5),
    (4, "gather", "text_to_image", 7, 3, 8, jnp.float32, 0.5),
    (8, "gather", "both", 3, 3, 8, jnp.float32, None),
    (8, "gather", "image_to_text", 3, 5, 16, jnp.bfloat16, -0.2),
]


@pytest.mark.parametrize("n,strategy,direction,bx,by,d,dtype,bias", CASES)
def test_sharded_matches_reference(n, strategy, direction, bx, by, d, dtype,
                                   bias):
  """Value and grads of the global arrays equal the single-device loss."""
  mesh = mesh_of(n)
  rng = np.random.default_rng(seed_of(n, strategy, direction, bx))
  x = rand_emb(rng, n * bx, d, dtype)
  y = rand_emb(rng, n * by, d, dtype)
  t = jnp.float32(rng.uniform(5.0, 20.0))
  b = None if bias is None else jnp.float32(bias)

  def f(x, y, t, b):
    return sharded_contrastive_loss(x, y, t, mesh=mesh, logit_bias=b,
                                    direction=direction, strategy=strategy,
                                    block_sizes=TILES)

  argnums = (0, 1, 2) if b is None else (0, 1, 2, 3)
  val, grads = jax.value_and_grad(f, argnums=argnums)(x, y, t, b)
  assert val.shape == () and val.dtype == jnp.float32
  _check_against_reference(val, grads, x, y, t, b, direction, dtype)


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_gradient_convention_inside_shard_map(strategy):
  """Inside shard_map: dL/d(own shard) per device; replicated inputs get the
  sum over devices (automatically with check_vma=True, by psum without)."""
  n, b, d = 4, 5, 8
  mesh = mesh_of(n)
  rng = np.random.default_rng(7)
  x = rand_emb(rng, n * b, d, jnp.float32)
  y = rand_emb(rng, n * b, d, jnp.float32)
  w = jnp.asarray(np.eye(d) + 0.1 * rng.standard_normal((d, d)), jnp.float32)
  t = jnp.float32(10.0)
  loss = functools.partial(contrastive_loss, axis_name="data",
                           strategy=strategy, block_sizes=TILES)
  ref = np_reference.clip_loss_and_grads(as64(x) @ as64(w), as64(y), 10.0)
  ref_dw = as64(x).T @ ref[1]  # d/dW of L(xW, y).

  def step(x, y, w, t):
    # A replicated "parameter" w: its gradient is the total over devices.
    val, (dx, dy, dw, dt) = jax.value_and_grad(
        lambda x, y, w, t: loss(x @ w, y, t), argnums=(0, 1, 2, 3))(x, y, w, t)
    return val, dx, dy, dw, dt

  specs = (P("data"), P("data"), P(), P())
  val, dx, dy, dw, dt = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=specs,
      out_specs=(P(), P("data"), P("data"), P(), P())))(x, y, w, t)
  assert_rel_close(val, ref[0], 2e-5, what="loss")
  assert_rel_close(dx, as64(ref[1]) @ as64(w).T, 5e-5, what="d image shard")
  assert_rel_close(dy, ref[2], 5e-5, what="d text shard")
  assert_rel_close(dw, ref_dw, 5e-5, what="d replicated param (summed)")
  assert_rel_close(dt, ref[3], 5e-5, what="d scale (summed)")

  # Without the type system, each device gets its own share; the user sums.
  def step_nocheck(x, y, w, t):
    _, dx, dy, dw, dt = step(x, y, w, t)
    return dx, dy, jax.lax.psum(dw, "data"), jax.lax.psum(dt, "data")

  dx2, dy2, dw2, dt2 = jax.jit(jax.shard_map(
      step_nocheck, mesh=mesh, in_specs=specs,
      out_specs=(P("data"), P("data"), P(), P()), check_vma=False))(x, y, w, t)
  assert_rel_close(dx2, as64(ref[1]) @ as64(w).T, 5e-5, what="d image (no vma)")
  assert_rel_close(dy2, ref[2], 5e-5, what="d text (no vma)")
  assert_rel_close(dw2, ref_dw, 5e-5, what="psum of d param (no vma)")
  assert_rel_close(dt2, ref[3], 5e-5, what="psum of d scale (no vma)")


@pytest.mark.parametrize("axis_name", ["data", ("data", "model")])
def test_multi_axis_mesh(axis_name):
  """A ("data", "model") mesh: ring over one axis or over both."""
  mesh = mesh_of(8, ("data", "model"), (4, 2))
  rng = np.random.default_rng(3)
  n = 4 if axis_name == "data" else 8
  x = rand_emb(rng, n * 3, 8, jnp.float32)
  y = rand_emb(rng, n * 3, 8, jnp.float32)
  t = jnp.float32(12.0)
  val, grads = jax.value_and_grad(
      lambda x, y, t: sharded_contrastive_loss(
          x, y, t, mesh=mesh, axis_name=axis_name, block_sizes=TILES),
      argnums=(0, 1, 2))(x, y, t)
  _check_against_reference(val, grads, x, y, t, None, "both", jnp.float32)


def test_explicit_mesh_and_presharded_inputs():
  """jax.make_mesh's default (Explicit axes) and inputs already sharded."""
  mesh_of(4)  # Skips without 8 devices.
  mesh = jax.make_mesh((4,), ("data",))
  rng = np.random.default_rng(5)
  x = rand_emb(rng, 12, 8, jnp.float32)
  y = rand_emb(rng, 12, 8, jnp.float32)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), 9.0)
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  for args in ((x, y), (xs, y)):
    val = sharded_contrastive_loss(*args, 9.0, mesh=mesh, block_sizes=TILES)
    assert_rel_close(val, ref[0], 2e-5, what="loss")


def test_reference_backend_across_devices():
  """backend="reference" with axis_name: the full matrix of the gathered
  batch, same values and per-shard grads as the tiled strategies."""
  mesh = mesh_of(4)
  rng = np.random.default_rng(11)
  x = rand_emb(rng, 12, 8, jnp.float32)
  y = rand_emb(rng, 20, 8, jnp.float32)
  t = jnp.float32(7.0)
  val, grads = jax.value_and_grad(
      lambda x, y, t: sharded_contrastive_loss(
          x, y, t, mesh=mesh, direction="image_to_text", backend="reference"),
      argnums=(0, 1, 2))(x, y, t)
  _check_against_reference(val, grads, x, y, t, None, "image_to_text",
                           jnp.float32)


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_nan_gives_nan(strategy):
  mesh = mesh_of(4)
  x = jnp.ones((8, 4), jnp.float32).at[5, 1].set(jnp.nan)
  y = jnp.ones((8, 4), jnp.float32)
  val = sharded_contrastive_loss(x, y, 1.0, mesh=mesh, strategy=strategy)
  assert np.isnan(float(val))


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_pallas_backend_through_the_ring(strategy):
  """The strategies only call the tile seam, so the Pallas tiles (interpret
  mode on CPU) plug in unchanged, inside shard_map's default check_vma=True
  (replicated inputs' grads summed by the type system)."""
  mesh = mesh_of(2)
  rng = np.random.default_rng(2)
  # Odd shards of 21 rows, D = 20: several row / column blocks, D steps and
  # panels per tile, all with padding.
  x = rand_emb(rng, 42, 20, jnp.float32)
  y = rand_emb(rng, 42, 20, jnp.float32)
  t, b = jnp.float32(10.0), jnp.float32(-1.5)
  bs = BlockSizes(block_q=16, block_k=16, block_d=16, num_programs=2,
                  bwd_block_q=16, bwd_block_k=16, panel_rows=16,
                  f32_precision="highest")

  def step(x, y, t, b):
    return jax.value_and_grad(
        lambda x, y, t, b: contrastive_loss(
            x, y, t, logit_bias=b, axis_name="data", strategy=strategy,
            backend="pallas", block_sizes=bs),
        argnums=(0, 1, 2, 3))(x, y, t, b)

  val, grads = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P(), (P("data"), P("data"), P(), P()))))(x, y, t, b)
  _check_against_reference(val, grads, x, y, t, b, "both", jnp.float32)


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_compiled_pallas_grad_traces_inside_shard_map(strategy, monkeypatch):
  """The GPU configuration of the Pallas tiles (compiled, not interpreted)
  traces under jax.grad inside shard_map with check_vma=True."""
  calls = compiled_kernels_in_shard_map(
      monkeypatch, mesh_of(2),
      lambda x, y, t, b, name: contrastive_loss(
          x, y, t, logit_bias=b, axis_name="data", strategy=strategy,
          backend=name), jnp.bfloat16)
  # Both kernels were traced, compiled: no interpreter.
  assert {n for n, _ in calls} == {"infcl_lse_fwd", "infcl_lse_bwd_panel"}
  assert not any(interpret for _, interpret in calls), calls


# --- Errors -----------------------------------------------------------------

X8 = jnp.ones((8, 4), jnp.float32)


def test_unknown_axis_name_in_mesh():
  mesh = mesh_of(4)
  with pytest.raises(ValueError, match=r"unknown axis name.*'batch'.*\['data'\]"):
    sharded_contrastive_loss(X8, X8, 1.0, mesh=mesh, axis_name="batch")


def test_unknown_axis_name_inside_shard_map():
  mesh = mesh_of(4)
  f = jax.shard_map(lambda x: contrastive_loss(x, x, 1.0, axis_name="batch"),
                    mesh=mesh, in_specs=P("data"), out_specs=P())
  with pytest.raises(ValueError, match=r"unknown axis name 'batch'.*'data'"):
    f(X8)


def test_axis_name_outside_shard_map():
  with pytest.raises(ValueError, match=r"axis_name='data' is not bound.*shard_map"):
    contrastive_loss(X8, X8, 1.0, axis_name="data")
  with pytest.raises(ValueError, match=r"not bound.*outside shard_map"):
    jax.jit(lambda x: contrastive_loss(x, x, 1.0, axis_name="data"))(X8)


def test_indivisible_global_batch():
  mesh = mesh_of(4)
  with pytest.raises(ValueError, match=r"image_emb has global batch 10.*not divisible by the 4 devices"):
    sharded_contrastive_loss(jnp.ones((10, 4)), jnp.ones((10, 4)), 1.0,
                             mesh=mesh)
  with pytest.raises(ValueError, match=r"text_emb has global batch 14"):
    sharded_contrastive_loss(X8, jnp.ones((14, 4)), 1.0, mesh=mesh,
                             direction="image_to_text")


def test_bad_strategy():
  mesh = mesh_of(2)
  with pytest.raises(ValueError, match=r"strategy must be one of.*'tree'"):
    sharded_contrastive_loss(X8, X8, 1.0, mesh=mesh, strategy="tree")
  with pytest.raises(ValueError, match=r"strategy must be one of.*'tree'"):
    contrastive_loss(X8, X8, 1.0, strategy="tree")


def _collectives(n, b, d=8, **kw):
  """The collective primitives of the sharded loss's fwd+bwd jaxpr."""
  mesh = mesh_of(n)
  step = jax.shard_map(
      jax.grad(lambda x, y: contrastive_loss(x, y, 2.0, axis_name="data",
                                             backend="xla", **kw),
               argnums=(0, 1)),
      mesh=mesh, in_specs=(P("data"), P("data")),
      out_specs=(P("data"), P("data")))
  x = jax.ShapeDtypeStruct((n * b, d), jnp.bfloat16)
  text = str(jax.make_jaxpr(step)(x, x))
  return {p for p in ("all_gather", "ppermute", "psum_scatter",
                      "reduce_scatter") if p in text}


def test_auto_strategy_picks_by_global_batch():
  """strategy="auto" (the default) gathers up to 131,072 global keys and
  runs the ring above; explicit strategies are kept."""
  from infcl_jax.losses import strategy  # pylint: disable=import-outside-toplevel
  assert strategy.pick("auto", 2, 65536) == "gather"
  assert strategy.pick("auto", 2, 65537) == "ring"
  assert strategy.pick("auto", 8, 16384) == "gather"
  assert strategy.pick("auto", 8, 16385) == "ring"
  assert strategy.pick("auto", 1, 10**7) == "ring"
  assert strategy.pick("ring", 2, 8) == "ring"
  assert strategy.pick("gather", 8, 10**6) == "gather"
  small = _collectives(2, 24)
  assert "all_gather" in small and "ppermute" not in small, small
  large = _collectives(2, 65544)
  assert "ppermute" in large and "all_gather" not in large, large
  assert "ppermute" in _collectives(2, 24, strategy="ring")
  assert "ppermute" not in _collectives(4, 65544, strategy="gather")


# --- Memory -----------------------------------------------------------------

def _temp_bytes(n, b, strategy="ring", d=64):
  mesh = mesh_of(n)
  grad = jax.jit(jax.grad(
      lambda x, y, t: sharded_contrastive_loss(
          x, y, t, mesh=mesh, strategy=strategy,
          block_sizes=BlockSizes(block_q=16, block_k=32)),
      argnums=(0, 1, 2)))
  x = jax.ShapeDtypeStruct((n * b, d), jnp.float32)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  return grad.lower(x, x, t).compile().memory_analysis().temp_size_in_bytes


def test_ring_memory_per_device_is_linear_in_local_batch_and_flat_in_n():
  b, d = 64, 64
  by_n = {n: _temp_bytes(n, b) for n in (2, 4, 8)}
  shard = b * d * 4
  # The same program per device from N = 4 on (one loop body), and never
  # more than a few shard-sized buffers: nothing is b x B or B x D.
  assert by_n[8] <= by_n[4] * 1.02, by_n
  assert max(by_n.values()) <= 12 * shard, (by_n, shard)
  by_b = {bb: _temp_bytes(4, bb) for bb in (128, 256)}
  by_b[64] = by_n[4]
  step1, step2 = by_b[128] - by_b[64], by_b[256] - by_b[128]
  assert step1 > 0 and abs(step2 - 2 * step1) <= 0.2 * step2, by_b


def test_gather_memory_grows_with_n():
  """The documented trade-off: the gather strategy holds B x D per device."""
  b = 64
  ring8, gather2, gather8 = (_temp_bytes(8, b), _temp_bytes(2, b, "gather"),
                             _temp_bytes(8, b, "gather"))
  assert gather8 > 2 * gather2 and gather8 > 2 * ring8, (ring8, gather2, gather8)
