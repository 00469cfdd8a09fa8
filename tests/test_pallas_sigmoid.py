"""The Pallas sigmoid (SigLIP) tiles against a float64 numpy reference.

``TestPallasSigmoidInterpret`` (``INTERPRET = True``) runs the kernels with
``interpret=True`` on any platform, with tiny blocks so that padding, column
splits of the forward, several panels of the backward and a diagonal that
crosses tile and panel borders are all exercised. ``TestPallasSigmoidGpu``
(``INTERPRET = False``, ``@pytest.mark.gpu``) compiles them through Triton
at real sizes and skips without a GPU.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import BlockSizes, sigmoid_loss
from infcl_jax.backends import registry
from infcl_jax.kernels.pallas import sigmoid_fwd

from tests import np_reference
from tests.helpers import (as64, assert_rel_close, default_tiles,
                           check_past_int32_against_xla, rand_emb, tol)

# Every size below is off the block grid; num_programs=5 splits the forward's
# columns, panel_rows=32 gives several backward panels. "highest" keeps
# float32 exact when these run compiled on a GPU (TF32 otherwise); the
# interpreter is exact either way.
TINY = BlockSizes(block_q=16, block_k=32, block_d=16, num_programs=5,
                  bwd_block_q=16, bwd_block_k=32, panel_rows=32,
                  f32_precision="highest")
# The same checks compiled by Triton on a GPU: 32-wide blocks and 4 warps,
# the smallest shapes its tensor-core dot is comfortable with.
GPU_SMALL = dataclasses.replace(TINY, block_q=32, block_k=32, block_d=32,
                                bwd_block_q=32, bwd_block_k=32, panel_rows=64,
                                num_warps=4, num_stages=2, bwd_num_warps=4,
                                bwd_num_stages=2)
ON_GPU = jax.default_backend() == "gpu"


np_sigmoid = np_reference.sigmoid_tile_sums_and_grads


def check_tile_ops(be, x, y, t, b, coef, has_diagonal, bs, rtol, loss_rtol):
  ref = np_sigmoid(as64(x), as64(y), t, b, has_diagonal)
  total = be.sigmoid_sum(x, y, jnp.float32(t), jnp.float32(b),
                         has_diagonal=has_diagonal, block_sizes=bs)
  assert total.dtype == jnp.float32 and total.shape == ()
  assert_rel_close(total, ref[0], rtol=loss_rtol, what="sum")
  grads = be.sigmoid_grad(x, y, jnp.float32(t), jnp.float32(b),
                          jnp.float32(coef), has_diagonal=has_diagonal,
                          block_sizes=bs)
  scale = np.abs(ref[1]).max() + np.abs(ref[2]).max()
  for g, r, name in zip(grads, ref[1:], ("dx", "dy", "dscale", "dbias")):
    assert g.dtype == jnp.float32, name
    r = coef * np.asarray(r)
    atol = 1e-6 * coef * scale if name in ("dx", "dy") else 1e-5 * abs(coef)
    # The scalar grads are float32 sums of n * m terms of both signs.
    rt = rtol if name in ("dx", "dy") else max(rtol, 1e-4)
    assert_rel_close(g, r, rtol=rt, atol=atol, what=name)


def check_loss(x, y, t, b, bs, rtol, loss_rtol, backend="pallas"):
  f = lambda x, y, t, b: sigmoid_loss(x, y, t, b, backend=backend,
                                      block_sizes=bs)
  val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(
      x, y, jnp.float32(t), jnp.float32(b))
  assert val.dtype == jnp.float32
  assert grads[0].dtype == x.dtype and grads[1].dtype == y.dtype
  n = x.shape[0]
  ref = np_sigmoid(as64(x), as64(y), t, b, True)
  assert_rel_close(val, ref[0] / n, rtol=loss_rtol, what="loss")
  scale = (np.abs(ref[1]).max() + np.abs(ref[2]).max()) / n
  for g, r, name in zip(grads[:2], ref[1:3], ("d image", "d text")):
    assert_rel_close(g, np.asarray(r) / n, rtol=rtol, atol=1e-6 * scale,
                     what=name)
  # The scalar grads are float32 sums of B^2 terms of both signs.
  for g, r, name in zip(grads[2:], ref[3:], ("d scale", "d bias")):
    assert_rel_close(g, r / n, rtol=max(rtol, 1e-4), atol=1e-5, what=name)


# ------------------------------------------------------------ interpret mode

class TestPallasSigmoidInterpret:
  """The kernels through the interpreter: runs on CPU (and anywhere).

  The sigmoid contract of a kernel backend: a new kernel backend subclasses
  this with its NAME, and a GPU twin with INTERPRET = False.
  """

  NAME = "pallas"
  INTERPRET = True
  bs = TINY

  def backend(self):
    # platform="cpu" is what selects interpret=True.
    return registry.get(self.NAME, "sigmoid",
                        platform="cpu" if self.INTERPRET else "gpu")

  @pytest.mark.parametrize("n,m,d,dtype,has_diagonal,t,b", [
      (37, 37, 19, jnp.float32, True, 10.0, -10.0),
      (37, 37, 19, jnp.float32, False, 10.0, -3.0),
      (29, 45, 5, jnp.bfloat16, False, 14.3, -5.0),
      (45, 29, 5, jnp.float16, False, 3.0, 1.0),
      (50, 50, 40, jnp.float16, True, 5.0, -2.0),
      (64, 64, 32, jnp.bfloat16, True, 10.0, -10.0),  # No padding at all.
      (1, 1, 1, jnp.float32, True, 10.0, -10.0),
  ])
  def test_tile_ops_match_float64(self, n, m, d, dtype, has_diagonal, t, b):
    rng = np.random.default_rng(n * 100 + m + d)
    x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
    # Products of the rounded inputs are exact in float32, so the sum is
    # tight for 16-bit inputs too.
    check_tile_ops(self.backend(), x, y, t, b, 0.37, has_diagonal, self.bs,
                   rtol=tol(dtype), loss_rtol=min(tol(dtype), 2e-5))

  @pytest.mark.parametrize("impl", ["xla", "pallas"])
  def test_backward_impls_and_one_panel(self, impl):
    # bwd_impl="xla" (GEMM + fusion panel) and a single panel holding all rows.
    rng = np.random.default_rng(3)
    x, y = rand_emb(rng, 33, 9, jnp.float32), rand_emb(rng, 33, 9, jnp.float32)
    bs = dataclasses.replace(self.bs, bwd_impl=impl, panel_rows=64)
    check_tile_ops(self.backend(), x, y, 7.0, -4.0, 1.0 / 33, True, bs,
                   rtol=2e-5, loss_rtol=2e-5)

  @pytest.mark.parametrize("impl", ["xla", "pallas"])
  @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
  def test_tiny_loss_keeps_relative_accuracy(self, dtype, impl):
    # Orthonormal embeddings: s_ii = 20, s_ij = -20, every |G| ~ 2e-9, far
    # below float16's smallest subnormal: the float16 panel must be
    # rescaled before the cast or the gradient would be exactly 0.
    n = 40
    x = jnp.asarray(np.eye(n), dtype)
    bs = dataclasses.replace(self.bs, bwd_impl=impl)
    ref = np_sigmoid(np.eye(n), np.eye(n), 40.0, -20.0, True)
    assert 0 < ref[0] < 1e-5  # n^2 terms of ~2e-9.
    check_tile_ops(self.backend(), x, x, 40.0, -20.0, 1.0 / n, True, bs,
                   rtol=1e-5 if dtype == jnp.float32 else tol(dtype),
                   loss_rtol=1e-5)

  def test_extreme_scale_and_bias(self):
    # Nearly equal rows: every logit is ~ t + b, deep in the saturated
    # region for both signs of b; opposite embeddings put the positives at
    # s_ii = -110 (log(sigmoid) would be -inf there).
    rng = np.random.default_rng(5)
    base = rng.standard_normal((1, 24))
    a = base + 1e-3 * rng.standard_normal((35, 24))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    x = jnp.asarray(a, jnp.float32)
    be = self.backend()
    for b in (-10.0, 10.0):
      check_tile_ops(be, x, x, 100.0, b, 1.0, True, self.bs, rtol=5e-5,
                     loss_rtol=2e-5)
    check_tile_ops(be, x, -x, 100.0, -10.0, 1.0, True, self.bs, rtol=5e-5,
                   loss_rtol=2e-5)

  def test_nan_inputs_give_nan(self):
    rng = np.random.default_rng(8)
    x, y = rand_emb(rng, 21, 8, jnp.float32), rand_emb(rng, 21, 8, jnp.float32)
    be = self.backend()
    bad = x.at[20, 3].set(jnp.nan)
    t, b = jnp.float32(10.0), jnp.float32(-10.0)
    assert np.isnan(float(be.sigmoid_sum(bad, y, t, b, has_diagonal=True,
                                         block_sizes=self.bs)))
    assert np.isnan(float(be.sigmoid_sum(x, y, jnp.float32(jnp.nan), b,
                                         has_diagonal=False,
                                         block_sizes=self.bs)))
    for dtype in (jnp.float32, jnp.float16):
      dx, dy, dt, db = be.sigmoid_grad(bad.astype(dtype), y.astype(dtype), t,
                                       b, 1.0, has_diagonal=True,
                                       block_sizes=self.bs)
      assert np.isnan(np.asarray(dx)[20]).all()
      assert np.isnan(np.asarray(dy)).any()
      assert np.isnan(float(dt)) and np.isnan(float(db))

  def test_errors(self):
    be = self.backend()
    x, y = jnp.ones((6, 4), jnp.float32), jnp.ones((7, 4), jnp.float32)
    with pytest.raises(ValueError, match="has_diagonal"):
      be.sigmoid_sum(x, y, 1.0, 0.0, has_diagonal=True, block_sizes=self.bs)
    with pytest.raises(ValueError, match="has_diagonal"):
      be.sigmoid_grad(x, y, 1.0, 0.0, 1.0, has_diagonal=True,
                      block_sizes=self.bs)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
      be.sigmoid_sum(x, y, 1.0, 0.0, has_diagonal=False,
                     block_sizes=BlockSizes(block_q=16, block_k=24))

  def test_inside_shard_map(self):
    # The sigmoid ring calls the tile ops on per-device shards, where the
    # pallas_call outputs and scan carries must be typed device-varying.
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    rng = np.random.default_rng(12)
    x, y = rand_emb(rng, 21, 5, jnp.float32), rand_emb(rng, 21, 5, jnp.float32)
    be = self.backend()

    def f(x, y, t, b):
      # The ring makes the scalars device-varying too.
      t, b = jax.lax.pcast((t, b), "d", to="varying")
      total = be.sigmoid_sum(x, y, t, b, has_diagonal=False,
                             block_sizes=self.bs)
      dx, dy, dt, db = be.sigmoid_grad(x, y, t, b, 1.0, has_diagonal=False,
                                       block_sizes=self.bs)
      return total[None], dx, dy, dt[None], db[None]

    out = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("d"), P("d"), P(), P()),
        out_specs=(P("d"),) * 5))(x, y, jnp.float32(3.0), jnp.float32(-2.0))
    ref = np_sigmoid(as64(x), as64(y), 3.0, -2.0, False)
    for g, r, name in zip(out, ref, ("sum", "dx", "dy", "dscale", "dbias")):
      assert_rel_close(np.reshape(g, np.shape(r)), r, rtol=5e-5, what=name)


def test_column_splits_cover_every_block_once():
  for nrb in (1, 3, 32, 600):
    for nkb in (1, 2, 7, 64):
      for target in (1, 5, 132):
        splits, per = sigmoid_fwd.column_splits(nrb, nkb, target)
        covered = [j for c in range(splits)
                   for j in range(c * per, min((c + 1) * per, nkb))]
        assert covered == list(range(nkb)), (nrb, nkb, target)
        assert all(c * per < nkb for c in range(splits))  # None empty.
        assert 1 <= splits <= max(1, -(-target // nrb))
        assert splits > 1 or target <= nrb or nkb == 1 or per == nkb


@pytest.mark.parametrize("B,D,dtype,t,b", [
    (37, 19, jnp.float32, 10.0, -10.0),
    (45, 7, jnp.bfloat16, 14.3, -5.0),
    (33, 40, jnp.float16, 5.0, -2.0),
])
def test_sigmoid_loss_backend_pallas(B, D, dtype, t, b):
  # The public API end to end (custom_vjp over the registered backend);
  # interpret mode on CPU, compiled Triton on a GPU.
  rng = np.random.default_rng(B + D)
  x, y = rand_emb(rng, B, D, dtype), rand_emb(rng, B, D, dtype)
  check_loss(x, y, t, b, GPU_SMALL if ON_GPU else TINY, rtol=tol(dtype),
             loss_rtol=min(tol(dtype), 2e-5))


def test_default_block_sizes_and_vmap():
  # block_sizes=None takes the platform's defaults; vmap adds a grid axis
  # to the kernels and must not mix the problems.
  rng = np.random.default_rng(17)
  xs = jnp.stack([rand_emb(rng, 21, 6, jnp.float32) for _ in range(2)])
  ys = jnp.stack([rand_emb(rng, 21, 6, jnp.float32) for _ in range(2)])
  bs = None if not ON_GPU else dataclasses.replace(
      default_tiles("pallas", jnp.float32),
      f32_precision="highest")

  def f(x, y, t):
    return sigmoid_loss(x, y, t, -1.0, backend="pallas", block_sizes=bs)

  ts = jnp.asarray([3.0, 12.0], jnp.float32)
  vals, (dxs, dts) = jax.vmap(jax.value_and_grad(f, argnums=(0, 2)))(
      xs, ys, ts)
  for k in range(2):
    ref = np_sigmoid(as64(xs[k]), as64(ys[k]), float(ts[k]), -1.0, True)
    assert_rel_close(vals[k], ref[0] / 21, rtol=2e-5, what="loss")
    assert_rel_close(dxs[k], ref[1] / 21, rtol=5e-5, what="d image")
    assert_rel_close(dts[k], ref[3] / 21, rtol=1e-4, what="d scale")


def test_memory_is_linear_in_batch():
  # Compile only (cheap even in interpret mode): the temporaries of loss +
  # grads double with B and stay far below one B x B float32 matrix.
  def temp(b):
    s = jax.ShapeDtypeStruct((b, 768), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((), jnp.float32)
    f = lambda x, y, t, c: sigmoid_loss(x, y, t, c, backend="pallas")
    g = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))
    return g.lower(s, s, t, t).compile().memory_analysis().temp_size_in_bytes

  # 16k and 32k: on the GPU one default panel (4096 rows) is already a
  # quarter of an 8k x 8k matrix, so smaller sizes say nothing.
  t0, t1 = temp(16384), temp(32768)
  assert t1 < 0.25 * 32768 ** 2 * 4, t1
  assert 1.5 < t1 / t0 < 2.3, (t0, t1)


def test_pallas_is_registered_for_sigmoid():
  be = registry.get("pallas", "sigmoid")
  assert be.name == "pallas" and "sigmoid" in be.families
  assert be.interpret == (not ON_GPU)


# ------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Triton lowering)")
class TestPallasSigmoidGpu(TestPallasSigmoidInterpret):
  """Everything above compiled through Triton, plus real sizes."""

  INTERPRET = False
  bs = GPU_SMALL

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
  def test_b4096_matches_float64(self, dtype):
    # Default GPU block sizes. float32 runs TF32 matmuls, which drop the
    # low 13 mantissa bits: s_ii = t |x_i|^2 + b moves by ~t * 1e-3, and
    # the loss and gradients by up to ~1e-2 (bf16-like accuracy).
    rng = np.random.default_rng(41)
    x, y = rand_emb(rng, 4096, 768, dtype), rand_emb(rng, 4096, 768, dtype)
    f32 = dtype == jnp.float32
    check_loss(x, y, 10.0, -10.0, None, rtol=2e-2 if f32 else tol(dtype),
               loss_rtol=1e-2 if f32 else 1e-4, backend=self.NAME)

  def test_b4096_float32_highest_matches_float64(self):
    rng = np.random.default_rng(42)
    x, y = rand_emb(rng, 4096, 768, jnp.float32), rand_emb(
        rng, 4096, 768, jnp.float32)
    bs = dataclasses.replace(
        default_tiles("pallas", jnp.float32),
        f32_precision="highest")
    check_loss(x, y, 14.3, -2.1, bs, rtol=1e-4, loss_rtol=2e-5,
               backend=self.NAME)

  def test_odd_rectangular_off_diagonal_tile(self):
    # A ring-like tile (no positives, n != m, odd D) with the defaults.
    rng = np.random.default_rng(43)
    x = rand_emb(rng, 3001, 300, jnp.bfloat16)
    y = rand_emb(rng, 5003, 300, jnp.bfloat16)
    check_tile_ops(self.backend(), x, y, 10.0, -10.0, 1.0 / 5003, False,
                   None, rtol=2e-2, loss_rtol=1e-4)

  def test_past_2_to_the_31_matches_xla(self):
    """B * D > 2**31 elements per input: the kernels' offsets must not wrap."""
    check_past_int32_against_xla(
        lambda x, y, name: sigmoid_loss(x, y, 10.0, -10.0, backend=name),
        self.NAME, seed=8)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
  def test_b65536_matches_xla(self, dtype):
    rng = np.random.default_rng(44)
    x, y = rand_emb(rng, 65536, 768, dtype), rand_emb(rng, 65536, 768, dtype)
    t, b = jnp.float32(10.0), jnp.float32(-10.0)

    def run(backend):
      f = lambda x, y, t, b: sigmoid_loss(x, y, t, b, backend=backend)
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, y, t, b)

    (vp, gp), (vx, gx) = run(self.NAME), run("xla")
    # xla keeps float32 matmuls at "highest"; pallas defaults to TF32.
    assert_rel_close(vp, as64(vx), rtol=1e-2 if dtype == jnp.float32 else 1e-4,
                     what="loss")
    names = ("d image", "d text", "d scale", "d bias")
    for a, r, name in zip(gp, gx, names):
      assert_rel_close(a, as64(r), rtol=2e-2, atol=1e-6, what=name)
