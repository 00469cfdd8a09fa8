"""The SigLIP sigmoid loss across 1-8 devices (the sigmoid ring) vs float64.

The reference is the single-device loss on the gathered batch (the shards
concatenated in axis order), with the closed-form float64 gradients.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes, sigmoid_loss
from tests import np_reference
from tests.helpers import (as64, assert_rel_close,
                           compiled_kernels_in_shard_map, rand_emb, tol)

TILES = BlockSizes(block_q=4, block_k=8)


np_sigmoid = np_reference.sigmoid_loss_and_grads


def mesh_of(n):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host devices (conftest.py sets XLA_FLAGS)")
  return Mesh(np.array(jax.devices()[:n]), ("data",))


def ring_value_and_grads(mesh, x, y, t, b, backend="xla", block_sizes=TILES,
                         check_vma=True):
  """Value and grads computed inside shard_map, per-device convention."""
  def step(x, y, t, b):
    val, (dx, dy, dt, db) = jax.value_and_grad(
        lambda *a: sigmoid_loss(*a, axis_name="data", backend=backend,
                                block_sizes=block_sizes),
        argnums=(0, 1, 2, 3))(x, y, t, b)
    if not check_vma:  # Without the type system, the user sums the shares.
      dt, db = jax.lax.psum(dt, "data"), jax.lax.psum(db, "data")
    return val, dx, dy, dt, db

  return jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P(), P("data"), P("data"), P(), P()),
      check_vma=check_vma))(x, y, t, b)


def check(got, x, y, t, b, dtype):
  val, dx, dy, dt, db = got
  ref = np_sigmoid(as64(x), as64(y), float(t), float(b))
  r = tol(dtype)
  assert val.shape == () and val.dtype == jnp.float32
  assert dx.dtype == x.dtype and dy.dtype == y.dtype
  assert_rel_close(val, ref[0], rtol=min(r, 2e-4), atol=1e-7, what="loss")
  eps = 1e-5 if dtype == jnp.float32 else 1e-3
  gross = abs(float(t)) / np.sqrt(x.shape[0])
  assert_rel_close(dx, ref[1], rtol=r, atol=eps * gross, what="d image")
  assert_rel_close(dy, ref[2], rtol=r, atol=eps * gross, what="d text")
  assert_rel_close(dt, ref[3], rtol=r, atol=eps, what="d scale")
  assert_rel_close(db, ref[4], rtol=r, atol=eps, what="d bias")


# (n_devices, local batch, D, dtype, scale, bias): odd local batches, 1-8
# devices, the SigLIP init (t = 10, b = -10) and large logits.
CASES = [
    (1, 5, 8, jnp.float32, 10.0, -10.0),
    (2, 3, 8, jnp.float32, 10.0, -10.0),
    (3, 5, 16, jnp.bfloat16, 10.0, -10.0),
    (4, 7, 8, jnp.float32, 3.0, 0.5),
    (5, 3, 8, jnp.float32, 10.0, -10.0),
    (8, 9, 16, jnp.float32, 100.0, -30.0),
    (8, 5, 8, jnp.bfloat16, 10.0, -10.0),
]


@pytest.mark.parametrize("n,b,d,dtype,t,bias", CASES)
def test_ring_matches_reference(n, b, d, dtype, t, bias):
  mesh = mesh_of(n)
  rng = np.random.default_rng(n * 100 + b)
  x = rand_emb(rng, n * b, d, dtype)
  y = rand_emb(rng, n * b, d, dtype)
  t, bias = jnp.float32(t), jnp.float32(bias)
  check(ring_value_and_grads(mesh, x, y, t, bias), x, y, t, bias, dtype)


def test_grad_from_outside_shard_map():
  """jax.grad of the shard_mapped loss: ordinary global gradients."""
  mesh = mesh_of(4)
  rng = np.random.default_rng(1)
  x = rand_emb(rng, 12, 8, jnp.float32)
  y = rand_emb(rng, 12, 8, jnp.float32)
  t, b = jnp.float32(10.0), jnp.float32(-10.0)
  f = jax.shard_map(
      lambda *a: sigmoid_loss(*a, axis_name="data", block_sizes=TILES),
      mesh=mesh, in_specs=(P("data"), P("data"), P(), P()), out_specs=P())
  val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, y, t, b)
  check((val,) + grads, x, y, t, b, jnp.float32)


def test_reference_backend_across_devices():
  mesh = mesh_of(4)
  rng = np.random.default_rng(2)
  x = rand_emb(rng, 12, 8, jnp.float32)
  y = rand_emb(rng, 12, 8, jnp.float32)
  t, b = jnp.float32(5.0), jnp.float32(-2.0)
  check(ring_value_and_grads(mesh, x, y, t, b, backend="reference"),
        x, y, t, b, jnp.float32)


def test_pallas_sigmoid_through_the_ring():
  """Pallas sigmoid tiles (interpret mode on CPU) through the same ring,
  inside shard_map's default check_vma=True."""
  mesh = mesh_of(2)
  rng = np.random.default_rng(3)
  x = rand_emb(rng, 16, 16, jnp.float32)
  y = rand_emb(rng, 16, 16, jnp.float32)
  t, b = jnp.float32(10.0), jnp.float32(-10.0)
  check(ring_value_and_grads(mesh, x, y, t, b, backend="pallas",
                             block_sizes=None),
        x, y, t, b, jnp.float32)


def test_user_psum_convention_without_check_vma():
  """check_vma=False: each device gets its share of the replicated scale and
  bias grads, and the user's psum gives the totals."""
  mesh = mesh_of(4)
  rng = np.random.default_rng(4)
  x = rand_emb(rng, 20, 8, jnp.float32)
  y = rand_emb(rng, 20, 8, jnp.float32)
  t, b = jnp.float32(10.0), jnp.float32(-10.0)
  check(ring_value_and_grads(mesh, x, y, t, b, check_vma=False),
        x, y, t, b, jnp.float32)


def test_compiled_pallas_grad_traces_inside_shard_map(monkeypatch):
  """The GPU configuration of the Pallas sigmoid tiles (compiled, not
  interpreted) traces under jax.grad inside shard_map with check_vma=True."""
  calls = compiled_kernels_in_shard_map(
      monkeypatch, mesh_of(2),
      lambda x, y, t, b, name: sigmoid_loss(x, y, t, b, axis_name="data",
                                            backend=name), jnp.float16)
  # float16: the max pre-pass, the panel and the forward, all compiled.
  assert {n for n, _ in calls} == {"infcl_sigmoid_fwd", "infcl_sigmoid_bwd_max",
                                   "infcl_sigmoid_bwd_g"}, calls
  assert not any(interpret for _, interpret in calls), calls


def test_nan_gives_nan():
  mesh = mesh_of(4)
  x = jnp.ones((8, 4), jnp.float32).at[6, 0].set(jnp.nan)
  f = jax.shard_map(lambda x, y: sigmoid_loss(x, y, 10.0, -10.0, axis_name="data"),
                    mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
  assert np.isnan(float(f(x, jnp.ones((8, 4), jnp.float32))))


def test_axis_errors():
  mesh = mesh_of(2)
  x = jnp.ones((4, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"axis_name='data' is not bound"):
    sigmoid_loss(x, x, 10.0, -10.0, axis_name="data")
  f = jax.shard_map(lambda x: sigmoid_loss(x, x, 10.0, -10.0, axis_name="batch"),
                    mesh=mesh, in_specs=P("data"), out_specs=P())
  with pytest.raises(ValueError, match=r"unknown axis name 'batch'.*'data'"):
    f(x)


def _temp_bytes(n, b, d=64):
  mesh = mesh_of(n)
  f = jax.shard_map(
      lambda *a: sigmoid_loss(*a, axis_name="data",
                              block_sizes=BlockSizes(block_q=16, block_k=32)),
      mesh=mesh, in_specs=(P("data"), P("data"), P(), P()), out_specs=P())
  grad = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))
  emb = jax.ShapeDtypeStruct((n * b, d), jnp.float32)
  sc = jax.ShapeDtypeStruct((), jnp.float32)
  return grad.lower(emb, emb, sc, sc).compile().memory_analysis().temp_size_in_bytes


def test_memory_per_device_flat_in_n_and_linear_in_local_batch():
  b, d = 64, 64
  by_n = {n: _temp_bytes(n, b) for n in (2, 4, 8)}
  assert by_n[8] <= by_n[4] * 1.02, by_n
  assert max(by_n.values()) <= 12 * b * d * 4, by_n
  by_b = {64: by_n[4], 128: _temp_bytes(4, 128), 256: _temp_bytes(4, 256)}
  step1, step2 = by_b[128] - by_b[64], by_b[256] - by_b[128]
  assert step1 > 0 and abs(step2 - 2 * step1) <= 0.2 * step2, by_b


@pytest.mark.parametrize("n", [1, 4])
def test_sharded_sigmoid_loss_on_global_arrays(n):
  from infcl_jax import sharded_sigmoid_loss
  mesh = mesh_of(n)
  rng = np.random.default_rng(40 + n)
  x = rand_emb(rng, 5 * n, 12, jnp.float32)
  y = rand_emb(rng, 5 * n, 12, jnp.float32)
  t, b = jnp.float32(7.0), jnp.float32(-3.0)
  f = lambda *a: sharded_sigmoid_loss(*a, mesh=mesh, block_sizes=TILES)
  got = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, y, t, b)
  check((got[0],) + got[1], x, y, t, b, jnp.float32)


def test_sharded_sigmoid_loss_errors():
  from infcl_jax import sharded_sigmoid_loss
  mesh = mesh_of(4)
  x = jnp.ones((6, 4))
  with pytest.raises(ValueError, match="not divisible by the 4 devices"):
    sharded_sigmoid_loss(x, x, 1.0, 0.0, mesh=mesh)
  with pytest.raises(ValueError, match="unknown axis name"):
    sharded_sigmoid_loss(jnp.ones((8, 4)), jnp.ones((8, 4)), 1.0, 0.0,
                         mesh=mesh, axis_name="model")
  with pytest.raises(ValueError, match="equal batch"):
    sharded_sigmoid_loss(jnp.ones((8, 4)), jnp.ones((12, 4)), 1.0, 0.0, mesh=mesh)


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_backward_ties_its_accumulator_send_at_every_step(family):
  """Both families' backward steps tie the travelling gradient accumulator
  (float32, b x D) to the shard the tile reads (``Ring.pass_on``): at N = 4
  the ring's middle steps (one scan body) and its last step each hold one
  optimization barrier over it. At N = 2 each step sends one array, so this
  is the case a 2-GPU schedule test cannot see."""
  from infcl_jax import contrastive_loss  # pylint: disable=import-outside-toplevel
  from tests.helpers import primitive_operands  # pylint: disable=import-outside-toplevel
  mesh = mesh_of(4)
  b, d = 6, 8
  if family == "sigmoid":
    loss = lambda x, y, t: sigmoid_loss(x, y, t, -1.0, axis_name="data",
                                        backend="xla", block_sizes=TILES)
  else:
    loss = lambda x, y, t: contrastive_loss(
        x, y, t, axis_name="data", strategy="ring", backend="xla",
        block_sizes=TILES)
  step = jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                       in_specs=(P("data"), P("data"), P()),
                       out_specs=(P("data"), P("data")))
  x = jax.ShapeDtypeStruct((4 * b, d), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  barriers = primitive_operands(jax.make_jaxpr(step)(x, x, t),
                                "optimization_barrier")
  acc = [ops for ops in barriers if ((b, d), "float32") in ops]
  assert len(acc) == 2, barriers
  # Each ties the accumulator to a bf16 shard of the same shape.
  assert all(((b, d), "bfloat16") in ops for ops in acc), acc
