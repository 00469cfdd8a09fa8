"""The Mosaic GPU backend (``backend="mosaic"``) against float64 references.

The backend contract tests of both families run against it by subclassing
(``NAME = "mosaic"``): ``TestMosaicSoftmaxInterpret`` /
``TestMosaicSigmoidInterpret`` run the Mosaic kernels in jax's Mosaic GPU
interpreter on the CPU (bf16 / f16 cases; the float32 cases exercise the
backend's float32 policy, the Triton path, in Triton's interpreter), and
their GPU twins compile them for Hopper (``@pytest.mark.gpu``).

Beyond the contract: larger odd shapes that give several CTA tiles, rounds
and panels, one-way directions with B_k > B_q, extreme logit ranges in bf16
(the forward's exact two-exponential fallback), NaN propagation, both
implementations of each stage (``STAGES``), shard_map (interpreted on one
device, and traced compiled on two), and the ring / gather strategies
(interpreted on a one-device axis: see ``_ring_mesh``).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes, contrastive_loss, sigmoid_loss
from infcl_jax.backends import registry
from tests import group_reference
from tests import np_reference
from tests import test_pallas
from tests import test_pallas_sigmoid
from tests.helpers import as64, assert_rel_close, kernel_calls, rand_emb, tol

ON_GPU = jax.default_backend() == "gpu"
# The smallest tiles the kernels take (64 rows, 2 x 64 columns, K-step 64):
# small problems still span several tiles, programs and panels. float32
# cases (Triton path) keep full float32 on a GPU.
SMALL = BlockSizes(block_q=64, block_k=128, block_d=64, num_programs=3,
                   bwd_block_q=64, bwd_block_k=128, panel_rows=128,
                   f32_precision="highest")
# The production tile shapes (128 x 2 x 128), few programs.
GPU_BLOCKS = dataclasses.replace(SMALL, block_q=128, block_k=256,
                                 bwd_block_q=128, bwd_block_k=256,
                                 panel_rows=256)


# After an exception the interpreter's global state must be reset.
pytestmark = pytest.mark.usefixtures("reset_mosaic_interpreter")


def hybrid_backend(monkeypatch, **stages):
  """Registers a MosaicBackend with some stages on Triton's kernels, under
  its own name (a loss traced for one backend name and block sizes is
  reused by JAX, so a changed ``STAGES`` alone would not be seen)."""
  from infcl_jax.backends import mosaic  # pylint: disable=import-outside-toplevel
  # The hybrids' Triton stages are Pallas-Triton's (the kernels these tests
  # name); the Triton-language path has its own test below.
  cls = type("MosaicHybrid", (mosaic.MosaicBackend,),
             {"STAGES": dict(mosaic.MosaicBackend.STAGES, **stages),
              "TRITON_PATH": "pallas"})
  name = "mosaic_test_" + "_".join(f"{k}_{v}" for k, v in sorted(
      stages.items()))
  monkeypatch.setitem(registry._TABLE, name, cls)  # pylint: disable=protected-access
  return name


def _mosaic_kernels(fn, *args):
  """Names of the Mosaic kernels ``fn`` traces."""
  return {n for n, _ in kernel_calls(jax.make_jaxpr(fn)(*args))
          if n.startswith("infcl_mosaic")}


# ----------------------------------------------------------------- softmax

SLOW = pytest.mark.slow


class TestMosaicSoftmaxInterpret(test_pallas.TestPallasSoftmaxInterpret):
  NAME = "mosaic"
  BLOCKS = SMALL

  # The contract's float32 cases run the Triton path (the float32 policy),
  # which tests/test_pallas.py covers: slow here, 16-bit ones fast.
  @pytest.mark.parametrize("bx,by,d,direction,dtype", [
      pytest.param(37, 37, 21, "both", jnp.float32, marks=SLOW),
      (37, 37, 21, "both", jnp.bfloat16),
      pytest.param(37, 37, 21, "both", jnp.float16, marks=SLOW),
      pytest.param(19, 50, 33, "image_to_text", jnp.float32, marks=SLOW),
      (50, 19, 33, "text_to_image", jnp.bfloat16),
  ])
  def test_loss_matches_float64(self, bx, by, d, direction, dtype):
    super().test_loss_matches_float64(bx, by, d, direction, dtype)

  @SLOW
  @pytest.mark.parametrize("single_exp", [True, False])
  def test_extreme_logits_take_exact_path(self, single_exp):
    super().test_extreme_logits_take_exact_path(single_exp)

  @SLOW
  def test_default_blocks_and_one_panel(self):
    super().test_default_blocks_and_one_panel()

  @SLOW
  def test_nan_input_gives_nan(self):
    super().test_nan_input_gives_nan()

  @pytest.mark.parametrize("dtype", [jnp.bfloat16,
                                     pytest.param(jnp.float16, marks=SLOW)])
  def test_seam_several_tiles_and_panels(self, dtype):
    """Odd n, m, D spanning 3 x 2 CTA tiles, 3 programs, 2 panels."""
    rng = np.random.default_rng(10)
    n, m, d = 150, 170, 77
    x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
    t, b = 12.5, -0.75
    be = self.backend()
    assert _mosaic_kernels(lambda x, y: be.lse(
        x, y, t, b, rows=True, cols=True, block_sizes=self.BLOCKS), x, y) == {
            "infcl_mosaic_lse_fwd"}
    r, c = jax.jit(lambda x, y: be.lse(x, y, t, b, rows=True, cols=True,
                                       block_sizes=self.BLOCKS))(x, y)
    rr, cr, _ = test_pallas.np_tile_ops(as64(x), as64(y), t, b, 0.0, 0.0)
    assert_rel_close(r, rr, rtol=2e-6, what="row lse")
    assert_rel_close(c, cr, rtol=2e-6, what="col lse")
    a_r, a_c = 0.3 / n, -1.7 / m
    out = jax.jit(lambda x, y, r, c: be.lse_grad(
        x, y, t, b, r, c, a_r, a_c, block_sizes=self.BLOCKS))(
            x, y, jnp.asarray(rr, jnp.float32), jnp.asarray(cr, jnp.float32))
    ref = test_pallas.np_tile_ops(as64(x), as64(y), t, b, a_r, a_c)[2]
    for o, e, what in zip(out, ref, ("dx", "dy", "dscale", "dbias")):
      assert o.dtype == jnp.float32
      assert_rel_close(o, e, rtol=tol(dtype), atol=1e-7, what=what)

  @SLOW
  def test_seam_one_statistic_16bit(self):
    """Rows only with B_k > B_q, cols only with B_q > B_k (bf16)."""
    rng = np.random.default_rng(11)
    be = self.backend()
    for n, m, rows in ((70, 200, True), (200, 70, False)):
      x = rand_emb(rng, n, 40, jnp.bfloat16)
      y = rand_emb(rng, m, 40, jnp.bfloat16)
      rr, cr, _ = test_pallas.np_tile_ops(as64(x), as64(y), 3.0, 0.5, 0., 0.)
      r, c = be.lse(x, y, 3.0, 0.5, rows=rows, cols=not rows,
                    block_sizes=self.BLOCKS)
      assert (c is None) == rows and (r is None) == (not rows)
      assert_rel_close(r if rows else c, rr if rows else cr, rtol=2e-6,
                       what="lse")
      stat = jnp.asarray(rr if rows else cr, jnp.float32)
      out = be.lse_grad(x, y, 3.0, 0.5, stat if rows else None,
                        None if rows else stat, 0.25 if rows else 0.0,
                        0.0 if rows else 0.25, block_sizes=self.BLOCKS)
      ref = test_pallas.np_tile_ops(as64(x), as64(y), 3.0, 0.5,
                                    0.25 if rows else 0.0,
                                    0.0 if rows else 0.25)[2]
      for o, e, what in zip(out, ref, ("dx", "dy", "dscale", "dbias")):
        assert_rel_close(o, e, rtol=2e-2, atol=1e-7, what=what)

  @pytest.mark.parametrize("single_exp", [True,
                                          pytest.param(False, marks=SLOW)])
  def test_extreme_logits_16bit(self, single_exp):
    """The Mosaic forward's exact fallback (logit span > 2^64 in a tile)."""
    x, y = test_pallas.extreme_logit_pair(jnp.bfloat16)
    bs = dataclasses.replace(self.BLOCKS, single_exp=single_exp)
    test_pallas.check_loss(x, y, 100.0, -5.0, "both", jnp.bfloat16, bs,
                           backend=self.NAME)

  def test_nan_input_gives_nan_16bit(self):
    rng = np.random.default_rng(4)
    x = rand_emb(rng, 20, 8, jnp.bfloat16).at[3, 2].set(jnp.nan)
    y = rand_emb(rng, 20, 8, jnp.bfloat16)
    val, dx, _, dt, _ = test_pallas._loss_and_grads(  # pylint: disable=protected-access
        x, y, jnp.float32(5.0), jnp.float32(0.0), "both", self.BLOCKS,
        self.NAME)
    assert np.isnan(float(val))
    assert np.isnan(np.asarray(dx, np.float32)).any() and np.isnan(float(dt))

  @SLOW
  @pytest.mark.parametrize("lse_impl,grad_impl", [("pallas", "mosaic"),
                                                  ("mosaic", "pallas")])
  def test_hybrid_stages(self, lse_impl, grad_impl, monkeypatch):
    """Either stage on Triton's kernel, the other on Mosaic's."""
    name = hybrid_backend(monkeypatch, lse=lse_impl, lse_grad=grad_impl)
    rng = np.random.default_rng(13)
    x, y = rand_emb(rng, 37, 21, jnp.bfloat16), rand_emb(rng, 37, 21,
                                                          jnp.bfloat16)
    bs = self.BLOCKS if not self.INTERPRET else dataclasses.replace(
        self.BLOCKS, block_q=32, block_k=32, block_d=32)
    loss = lambda x, y: contrastive_loss(x, y, 14.3, backend=name,
                                         block_sizes=bs)
    names = {n for n, _ in kernel_calls(jax.make_jaxpr(jax.grad(
        loss, argnums=(0, 1)))(x, y))}
    assert names == {
        "infcl_lse_fwd" if lse_impl == "pallas" else "infcl_mosaic_lse_fwd",
        "infcl_lse_bwd_panel" if grad_impl == "pallas"
        else "infcl_mosaic_lse_bwd_panel"}, names
    test_pallas.check_loss(x, y, 14.3, 0.4, "both", jnp.bfloat16, bs,
                           backend=name)

  def test_inside_shard_map_16bit(self):
    """The seam on a one-device mesh (check_vma=True): kernel outputs typed
    device-varying, the scan carry too."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    rng = np.random.default_rng(12)
    x = rand_emb(rng, 70, 20, jnp.bfloat16)
    y = rand_emb(rng, 70, 20, jnp.bfloat16)
    be = self.backend()

    def f(x, y, t):
      t = jax.lax.pcast(t, "d", to="varying")
      r, c = be.lse(x, y, t, 0.0, rows=True, cols=True,
                    block_sizes=self.BLOCKS)
      dx, dy, dt, db = be.lse_grad(x, y, t, 0.0, r, c, 0.5, 0.5,
                                   block_sizes=self.BLOCKS)
      return r, c, dx, dy, dt[None], db[None]

    out = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("d"), P("d"), P()),
        out_specs=(P("d"),) * 6))(x, y, jnp.float32(5.0))
    rr, cr, grads = test_pallas.np_tile_ops(as64(x), as64(y), 5.0, 0.0, 0.5,
                                            0.5)
    assert_rel_close(out[0], rr, rtol=2e-6, what="row lse")
    assert_rel_close(out[1], cr, rtol=2e-6, what="col lse")
    for o, e, what in zip(out[2:], grads, ("dx", "dy", "dscale", "dbias")):
      assert_rel_close(np.reshape(o, np.shape(e)), e, rtol=2e-2, atol=1e-6,
                       what=what)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestMosaicSoftmaxGpu(test_pallas.TestPallasSoftmaxGpu,
                           TestMosaicSoftmaxInterpret):
  NAME = "mosaic"
  INTERPRET = False
  BLOCKS = SMALL

  @pytest.mark.parametrize("n,m,d,direction", [
      (3001, 3001, 1000, "both"), (1000, 5000, 520, "image_to_text"),
      (5000, 1000, 520, "text_to_image")])
  def test_odd_shapes_default_blocks(self, n, m, d, direction):
    rng = np.random.default_rng(n + m)
    x, y = rand_emb(rng, n, d, jnp.bfloat16), rand_emb(rng, m, d,
                                                       jnp.bfloat16)
    test_pallas.check_loss(x, y, 14.3, -2.0, direction, jnp.bfloat16, None,
                           backend=self.NAME)

  def test_production_blocks(self):
    rng = np.random.default_rng(21)
    x, y = rand_emb(rng, 700, 300, jnp.float16), rand_emb(rng, 700, 300,
                                                          jnp.float16)
    test_pallas.check_loss(x, y, 14.3, -2.0, "both", jnp.float16, GPU_BLOCKS,
                           backend=self.NAME)


# ----------------------------------------------------------------- sigmoid

class TestMosaicSigmoidInterpret(test_pallas_sigmoid.TestPallasSigmoidInterpret):
  NAME = "mosaic"
  bs = SMALL

  # As for softmax: float32 (Triton path) and the bwd_impl="xla" panels
  # are covered by tests/test_pallas_sigmoid.py; slow here.
  @pytest.mark.parametrize("impl", [pytest.param("xla", marks=SLOW),
                                    "pallas"])
  @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16,
                                     pytest.param(jnp.float32, marks=SLOW)])
  def test_tiny_loss_keeps_relative_accuracy(self, dtype, impl):
    super().test_tiny_loss_keeps_relative_accuracy(dtype, impl)

  @SLOW
  def test_extreme_scale_and_bias(self):
    super().test_extreme_scale_and_bias()

  @SLOW
  @pytest.mark.parametrize("impl", ["xla", "pallas"])
  def test_backward_impls_and_one_panel(self, impl):
    super().test_backward_impls_and_one_panel(impl)

  @SLOW
  def test_inside_shard_map(self):
    super().test_inside_shard_map()

  @pytest.mark.parametrize("n,m,d,dtype,has_diagonal", [
      (150, 150, 77, jnp.bfloat16, True),
      pytest.param(150, 170, 77, jnp.float16, False, marks=SLOW),
  ])
  def test_tile_ops_several_tiles_and_panels(self, n, m, d, dtype,
                                             has_diagonal):
    rng = np.random.default_rng(n + m + d)
    x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
    be = self.backend()
    names = _mosaic_kernels(lambda x, y: be.sigmoid_grad(
        x, y, 10.0, -5.0, 0.37, has_diagonal=has_diagonal,
        block_sizes=self.bs), x, y)
    want = {"infcl_mosaic_sigmoid_g"}
    if dtype == jnp.float16:
      want.add("infcl_mosaic_sigmoid_max")
    assert names == want, names
    test_pallas_sigmoid.check_tile_ops(
        be, x, y, 10.0, -5.0, 0.37, has_diagonal, self.bs, rtol=tol(dtype),
        loss_rtol=2e-5)

  def test_loss_16bit(self):
    rng = np.random.default_rng(31)
    x, y = rand_emb(rng, 45, 7, jnp.bfloat16), rand_emb(rng, 45, 7,
                                                        jnp.bfloat16)
    test_pallas_sigmoid.check_loss(x, y, 14.3, -5.0, self.bs,
                                   rtol=tol(jnp.bfloat16), loss_rtol=2e-5,
                                   backend=self.NAME)

  @SLOW
  @pytest.mark.parametrize("sum_impl,grad_impl", [("pallas", "mosaic"),
                                                  ("mosaic", "pallas")])
  def test_hybrid_stages(self, sum_impl, grad_impl, monkeypatch):
    name = hybrid_backend(monkeypatch, sigmoid_sum=sum_impl,
                          sigmoid_grad=grad_impl)
    be = registry.get(name, "sigmoid",
                      platform="cpu" if self.INTERPRET else "gpu")
    rng = np.random.default_rng(32)
    x, y = rand_emb(rng, 33, 9, jnp.float16), rand_emb(rng, 33, 9,
                                                       jnp.float16)
    bs = self.bs if not self.INTERPRET else dataclasses.replace(
        self.bs, block_q=32, block_k=32, block_d=32, bwd_block_q=32,
        bwd_block_k=32, panel_rows=32)
    names = {n for n, _ in kernel_calls(jax.make_jaxpr(
        lambda x, y: (be.sigmoid_sum(x, y, 7.0, -4.0, has_diagonal=True,
                                     block_sizes=bs),
                      be.sigmoid_grad(x, y, 7.0, -4.0, 1.0, has_diagonal=True,
                                      block_sizes=bs)))(x, y))}
    assert ("infcl_sigmoid_fwd" if sum_impl == "pallas"
            else "infcl_mosaic_sigmoid_sum") in names, names
    assert ("infcl_sigmoid_bwd_g" if grad_impl == "pallas"
            else "infcl_mosaic_sigmoid_g") in names, names
    test_pallas_sigmoid.check_tile_ops(
        be, x, y, 7.0, -4.0, 1.0 / 33, True, bs, rtol=tol(jnp.float16),
        loss_rtol=2e-5)

  def test_inside_shard_map_16bit(self):
    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    rng = np.random.default_rng(12)
    x = rand_emb(rng, 70, 20, jnp.float16)
    y = rand_emb(rng, 70, 20, jnp.float16)
    be = self.backend()

    def f(x, y, t, b):
      t, b = jax.lax.pcast((t, b), "d", to="varying")
      total = be.sigmoid_sum(x, y, t, b, has_diagonal=True,
                             block_sizes=self.bs)
      dx, dy, dt, db = be.sigmoid_grad(x, y, t, b, 1.0, has_diagonal=True,
                                       block_sizes=self.bs)
      return total[None], dx, dy, dt[None], db[None]

    out = jax.jit(jax.shard_map(
        f, mesh=mesh, in_specs=(P("d"), P("d"), P(), P()),
        out_specs=(P("d"),) * 5))(x, y, jnp.float32(3.0), jnp.float32(-2.0))
    ref = test_pallas_sigmoid.np_sigmoid(as64(x), as64(y), 3.0, -2.0, True)
    for g, r, name in zip(out, ref, ("sum", "dx", "dy", "dscale", "dbias")):
      rt = 2e-5 if name == "sum" else 1e-2
      assert_rel_close(np.reshape(g, np.shape(r)), r, rtol=rt, atol=1e-6,
                       what=name)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestMosaicSigmoidGpu(test_pallas_sigmoid.TestPallasSigmoidGpu,
                           TestMosaicSigmoidInterpret):
  NAME = "mosaic"
  INTERPRET = False
  bs = SMALL

  def test_production_blocks(self):
    rng = np.random.default_rng(22)
    x, y = rand_emb(rng, 700, 300, jnp.float16), rand_emb(rng, 700, 300,
                                                          jnp.float16)
    test_pallas_sigmoid.check_loss(x, y, 10.0, -10.0, GPU_BLOCKS,
                                   rtol=tol(jnp.float16), loss_rtol=1e-4,
                                   backend=self.NAME)


# ------------------------------------------------ registry, policy, devices

def test_registered_and_auto_unchanged_on_cpu():
  for family in ("softmax", "sigmoid"):
    be = registry.get("mosaic", family, platform="cpu")
    assert be.name == "mosaic" and be.interpret
    assert registry.resolve("auto", family, platform="cpu") == "xla"


def test_float32_routes_to_triton_kernels():
  """The float32 policy: the Triton path, no Mosaic kernel."""
  x = jax.ShapeDtypeStruct((40, 24), jnp.float32)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  for loss in (lambda x, y, t: contrastive_loss(x, y, t, backend="mosaic"),
               lambda x, y, t: sigmoid_loss(x, y, t, -1.0, backend="mosaic")):
    calls = kernel_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(
        x, x, t))
    assert calls and not any(n.startswith("infcl_mosaic") for n, _ in calls)
    assert all(n.startswith("infcl_") for n, _ in calls), calls


def test_block_size_mapping():
  """Mosaic's own default tiles, and how a user's BlockSizes is rounded to
  the shapes its kernels take (written down)."""
  from infcl_jax.backends import mosaic  # pylint: disable=import-outside-toplevel
  be = mosaic.MosaicBackend(platform="cpu")
  assert be.default_block_sizes("gpu", jnp.bfloat16) == mosaic.GPU_TILES
  assert be.default_block_sizes("cpu", jnp.float16) == mosaic.INTERPRET_TILES
  # float32 takes the Triton path, with its defaults.
  assert be.default_block_sizes("gpu", jnp.float32) == BlockSizes(
      block_q=128, block_k=256, block_d=32, bwd_block_q=128, bwd_block_k=256,
      panel_rows=2048)
  # block_k / bwd_block_k: a CTA tile's columns (two consumer halves).
  shape = lambda mb: (mb.block_q, mb.block_k, mb.bwd_block_q, mb.bwd_block_k,
                      mb.block_d, mb.panel_rows)
  mb = mosaic.mosaic_blocks(mosaic.GPU_TILES)
  assert shape(mb) == (128, 256, 128, 256, 64, 4096)
  mb = mosaic.mosaic_blocks(mosaic.INTERPRET_TILES)
  assert shape(mb) == (64, 128, 64, 128, 64, 64)
  mb = mosaic.mosaic_blocks(test_pallas.TINY)
  assert shape(mb) == (64, 128, 64, 128, 64, 64)


def _compiled_mosaic_class():
  from infcl_jax.backends import mosaic  # pylint: disable=import-outside-toplevel

  class CompiledMosaic(mosaic.MosaicBackend):

    def __init__(self, platform=None):
      del platform
      super().__init__(platform="gpu")
      self.mosaic_ok = True  # As on a Hopper GPU, on any host.

  return CompiledMosaic


def _mesh2():
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (conftest.py sets XLA_FLAGS on CPU)")
  return Mesh(np.array(jax.devices()[:2]), ("data",))


def _ring_mesh():
  """Two devices compiled; one in the interpreter. The Mosaic GPU
  interpreter keeps one process-wide simulated GPU: two CPU devices running
  kernels at once trip its barrier bookkeeping ("Barrier remains
  allocated"), so interpreted kernels run the ring / gather code on a
  one-device axis (every collective, the carry typing, N = 1); the
  two-device ring is traced compiled above and run on GPUs."""
  if ON_GPU and len(jax.devices()) >= 2:
    return _mesh2()
  return Mesh(np.array(jax.devices()[:1]), ("data",))


@pytest.mark.parametrize("family,strategy,dtype", [
    ("softmax", "ring", jnp.bfloat16), ("softmax", "gather", jnp.bfloat16),
    ("sigmoid", "ring", jnp.float16)])
def test_compiled_grad_traces_inside_shard_map(family, strategy, dtype,
                                               monkeypatch):
  """The GPU configuration (compiled Mosaic kernels) traces under jax.grad
  inside shard_map with check_vma=True, for the ring and the gather."""
  mesh = _mesh2()
  name = "mosaic_compiled_for_test"
  monkeypatch.setitem(registry._TABLE, name, _compiled_mosaic_class())  # pylint: disable=protected-access
  if family == "softmax":
    loss = lambda x, y, t, b: contrastive_loss(
        x, y, t, logit_bias=b, axis_name="data", strategy=strategy,
        backend=name)
    want = {"infcl_mosaic_lse_fwd", "infcl_mosaic_lse_bwd_panel"}
  else:
    loss = lambda x, y, t, b: sigmoid_loss(x, y, t, b, axis_name="data",
                                           backend=name)
    want = {"infcl_mosaic_sigmoid_sum", "infcl_mosaic_sigmoid_max",
            "infcl_mosaic_sigmoid_g"}
  x = jax.ShapeDtypeStruct((2 * 24, 40), dtype)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  step = jax.shard_map(
      jax.grad(loss, argnums=(0, 1, 2, 3)), mesh=mesh,
      in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P("data"), P("data"), P(), P()))
  calls = kernel_calls(jax.make_jaxpr(step)(x, x, t, t))
  assert {n for n, _ in calls} == want, calls
  assert not any(interpret for _, interpret in calls), calls


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_softmax_ring_and_gather(strategy):
  """Mosaic kernels in the CLIP ring / gather (see ``_ring_mesh``)."""
  mesh = _ring_mesh()
  n = 70 * mesh.shape["data"]
  rng = np.random.default_rng(40)
  x = rand_emb(rng, n, 20, jnp.bfloat16)
  y = rand_emb(rng, n, 20, jnp.bfloat16)
  t, b = jnp.float32(10.0), jnp.float32(-1.5)

  def step(x, y, t, b):
    return jax.value_and_grad(
        lambda x, y, t, b: contrastive_loss(
            x, y, t, logit_bias=b, axis_name="data", strategy=strategy,
            backend="mosaic", block_sizes=SMALL),
        argnums=(0, 1, 2, 3))(x, y, t, b)

  val, grads = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P(), (P("data"), P("data"), P(), P()))))(x, y, t, b)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), 10.0, -1.5,
                                         "both")
  assert_rel_close(val, ref[0], rtol=2e-4, what="loss")
  for g, r, what in zip(grads[:3], ref[1:4], ("dx", "dy", "dscale")):
    assert_rel_close(g, r, rtol=2e-2, atol=1e-4, what=what)
  assert abs(float(grads[3]) - ref[4]) < 1e-3


@pytest.mark.parametrize("strategy,mode", [("ring", "mask"),
                                           ("gather", "mask"),
                                           ("ring", "positives")])
def test_softmax_ring_and_gather_with_groups(strategy, mode):
  """Grouped softmax tiles inside ``shard_map`` (the backend sorts each
  tile's rows and columns by id and puts the results back), against
  float64: pairs in random places and one group of five."""
  mesh = _ring_mesh()
  n = 70 * mesh.shape["data"]
  rng = np.random.default_rng(42)
  x = rand_emb(rng, n, 20, jnp.bfloat16)
  y = rand_emb(rng, n, 20, jnp.bfloat16)
  g = rng.permutation(n) // 2
  g[rng.choice(n, 5, replace=False)] = n
  g = jnp.asarray(g, jnp.int32)
  t, b = jnp.float32(10.0), jnp.float32(-1.5)

  def step(x, y, t, b, g):
    return jax.value_and_grad(
        lambda x, y, t, b: contrastive_loss(
            x, y, t, logit_bias=b, axis_name="data", strategy=strategy,
            backend="mosaic", block_sizes=SMALL, groups=g, group_mode=mode),
        argnums=(0, 1, 2, 3))(x, y, t, b)

  val, grads = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P("data"), P("data"), P(), P(), P("data")),
      out_specs=(P(), (P("data"), P("data"), P(), P()))))(x, y, t, b, g)
  ref = group_reference.clip_loss_and_grads(as64(x), as64(y), 10.0, -1.5,
                                            np.asarray(g), np.asarray(g),
                                            mode)
  assert_rel_close(val, ref[0], rtol=2e-4, what="loss")
  for a, r, what in zip(grads[:3], ref[1:4], ("dx", "dy", "dscale")):
    assert_rel_close(a, r, rtol=2e-2, atol=1e-4, what=what)
  assert abs(float(grads[3]) - ref[4]) < 1e-3


def test_sigmoid_ring():
  mesh = _ring_mesh()
  rng = np.random.default_rng(41)
  x = rand_emb(rng, 70 * mesh.shape["data"], 20, jnp.float16)
  y = rand_emb(rng, 70 * mesh.shape["data"], 20, jnp.float16)
  t, b = jnp.float32(10.0), jnp.float32(-10.0)

  def step(x, y, t, b):
    return jax.value_and_grad(
        lambda x, y, t, b: sigmoid_loss(x, y, t, b, axis_name="data",
                                        backend="mosaic", block_sizes=SMALL),
        argnums=(0, 1, 2, 3))(x, y, t, b)

  val, grads = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P(), (P("data"), P("data"), P(), P()))))(x, y, t, b)
  n = x.shape[0]
  ref = test_pallas_sigmoid.np_sigmoid(as64(x), as64(y), 10.0, -10.0, True)
  assert_rel_close(val, ref[0] / n, rtol=2e-5, what="loss")
  for g, r, what in zip(grads, ref[1:], ("dx", "dy", "dscale", "dbias")):
    assert_rel_close(g, np.asarray(r) / n, rtol=1e-2, atol=1e-5, what=what)


# ------------------------------- the Triton path on the Triton-language kernels

@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
@pytest.mark.parametrize("n,m,d,dtype,stages", [
    (4096, 4096, 768, jnp.float32, {}),
    (3001, 3001, 200, jnp.float32, {}),
    (37, 50, 21, jnp.float32, {}),
    # A 16-bit hybrid: one stage on the Triton path, the other on Mosaic.
    (333, 333, 70, jnp.bfloat16, "hybrid"),
])
def test_triton_path_on_the_triton_language_kernels(monkeypatch, family, n, m,
                                                    d, dtype, stages):
  """``TRITON_PATH = "triton"``: float32 inputs and "pallas" stages run the
  Triton-language kernels (and none of Pallas-Triton's), exact against
  float64 to TF32's tolerance (1e-3, as the contract's float32 default) or
  the 16-bit one. The loss too is held to 1e-3 in float32: the
  Triton-language TF32 products are coarser than Pallas-Triton's (5.9e-4 at
  37 x 50 x 21 on the H200), one reason the Pallas kernels stay the
  default path."""
  import jax_triton  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from infcl_jax.backends import mosaic  # pylint: disable=import-outside-toplevel
  if stages == "hybrid":
    stages = ({"lse": "pallas"} if family == "softmax"
              else {"sigmoid_grad": "pallas"})
  cls = type("MosaicTritonPath", (mosaic.MosaicBackend,), {
      "TRITON_PATH": "triton",
      "STAGES": dict(mosaic.MosaicBackend.STAGES, **stages)})
  name = "mosaic_test_triton_path_" + "_".join(sorted(stages)) + family
  monkeypatch.setitem(registry._TABLE, name, cls)  # pylint: disable=protected-access
  if family == "sigmoid":
    m = n
  rng = np.random.default_rng(n + d)
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
  direction = "both" if n == m else "image_to_text"
  if family == "softmax":
    loss = lambda x, y: contrastive_loss(x, y, 14.3, direction=direction,  # noqa: E731
                                         backend=name)
  else:
    loss = lambda x, y: sigmoid_loss(x, y, 10.0, -10.0, backend=name)  # noqa: E731
  names = {k for k, _ in kernel_calls(jax.make_jaxpr(jax.grad(
      loss, argnums=(0, 1)))(x, y))}
  assert any(k.startswith("infcl_triton_") for k in names), names
  assert not any(k.startswith(("infcl_lse", "infcl_sigmoid")) for k in names)
  rtol = 1e-3 if dtype == jnp.float32 else tol(dtype)
  if family == "softmax":
    test_pallas.check_loss(x, y, 14.3, 0.0, direction, dtype, None,
                           rtol=rtol, backend=name,
                           loss_rtol=1e-3 if dtype == jnp.float32 else 2e-4)
  else:
    test_pallas_sigmoid.check_loss(x, y, 10.0, -10.0, None, rtol=rtol,
                                   loss_rtol=1e-3, backend=name)
