"""The Pallas softmax tiles against float64 numpy references.

``TestPallasSoftmaxInterpret`` (``INTERPRET = True``) runs the kernels with
``interpret=True`` on any platform, with tiny blocks so that padding of B
and D, several persistent programs and rounds of the forward, several
backward panels, and both the shared-shift and the exact exponential paths
are exercised. ``TestPallasSoftmaxGpu`` (``INTERPRET = False``,
``@pytest.mark.gpu``) compiles them through Triton at real sizes and skips
without a GPU.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import BlockSizes, contrastive_loss
from infcl_jax.backends import registry
from tests import np_reference
from tests.helpers import (as64, assert_rel_close, default_tiles,
                           check_past_int32_against_xla, rand_emb, tol)

# Every size below is off this block grid. num_programs=3 gives several
# rounds of row blocks per program; panel_rows=32 several backward panels.
# "highest" keeps float32 exact when these run compiled on a GPU; the
# interpreter is exact either way.
TINY = BlockSizes(block_q=16, block_k=32, block_d=16, num_programs=3,
                  bwd_block_q=16, bwd_block_k=32, panel_rows=32,
                  f32_precision="highest")
ON_GPU = jax.default_backend() == "gpu"
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def np_tile_ops(x, y, t, b, row_coef, col_coef):
  """Float64 row / column LSE and lse_grad outputs of one block pair."""
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  s0 = x @ y.T
  s = t * s0 + b
  r = np_reference._lse(s, 1)  # pylint: disable=protected-access
  c = np_reference._lse(s, 0)  # pylint: disable=protected-access
  g = row_coef * np.exp(s - r[:, None]) + col_coef * np.exp(s - c[None, :])
  return r, c, (t * g @ y, t * g.T @ x, np.sum(g * s0), np.sum(g))


def _loss_and_grads(x, y, t, b, direction, block_sizes, backend="pallas"):
  def f(x, y, t, b):
    return contrastive_loss(x, y, t, logit_bias=b, direction=direction,
                            backend=backend, block_sizes=block_sizes)
  val, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, y, t, b)
  return (val,) + grads


def check_loss(x, y, t, b, direction, dtype, block_sizes, rtol=None,
               backend="pallas", loss_rtol=2e-4):
  """Loss and all four grads of a tiled backend vs float64 numpy."""
  val, dx, dy, dt, db = _loss_and_grads(x, y, jnp.float32(t), jnp.float32(b),
                                        direction, block_sizes, backend)
  assert val.dtype == jnp.float32 and dx.dtype == x.dtype
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), t, b, direction)
  r = rtol or tol(dtype)
  assert_rel_close(val, ref[0], rtol=min(r, loss_rtol), atol=1e-6,
                   what="loss")
  # Absolute floor as in test_contrastive: rounding relative to the gross
  # size of the terms, where the true gradient cancels.
  eps = 1e-5 if dtype == jnp.float32 else 1e-3
  gross = 2 * abs(t) / np.sqrt(min(x.shape[0], y.shape[0]))
  assert_rel_close(dx, ref[1], rtol=r, atol=eps * gross, what="d image")
  assert_rel_close(dy, ref[2], rtol=r, atol=eps * gross, what="d text")
  assert_rel_close(dt, ref[3], rtol=r, atol=eps * 2 * x.shape[1] ** 0.5,
                   what="d scale")
  # Exactly 0 for softmax; rounding leaves ~eps.
  assert abs(float(db) - ref[4]) < (1e-5 if dtype == jnp.float32 else 1e-3)


def extreme_logit_pair(dtype):
  """(40, 16) near-duplicate and opposite unit vectors: at scale 100 their
  logits reach +-100 (base-2 span ~290) inside one tile."""
  rng = np.random.default_rng(2)
  d = 16
  base = rng.standard_normal(d)
  x = base + 1e-2 * rng.standard_normal((40, d))
  y = base + 1e-2 * rng.standard_normal((40, d))
  y[::2] *= -1
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  return jnp.asarray(x, dtype), jnp.asarray(y, dtype)


class TestPallasSoftmaxInterpret:
  """The softmax contract of a kernel backend. A new kernel backend
  subclasses this with its NAME (and BLOCKS), and a GPU twin with
  INTERPRET = False."""
  NAME = "pallas"
  INTERPRET = True
  BLOCKS = TINY

  def backend(self):
    # Interpret mode on any platform when INTERPRET; compiled otherwise.
    return registry.get(self.NAME, "softmax",
                        platform="cpu" if self.INTERPRET else "gpu")

  @pytest.mark.parametrize("dtype", DTYPES)
  def test_seam_lse_and_grad(self, dtype):
    """lse / lse_grad directly on the seam: odd n, m, D; both directions."""
    rng = np.random.default_rng(0)
    n, m, d = 45, 70, 37
    x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
    t, b = 12.5, -0.75
    be = self.backend()
    r, c = jax.jit(lambda x, y: be.lse(x, y, t, b, rows=True, cols=True,
                                       block_sizes=self.BLOCKS))(x, y)
    rr, cr, _ = np_tile_ops(as64(x), as64(y), t, b, 0.0, 0.0)
    # The statistics are f32 sums of f32 products of (exact) inputs.
    assert_rel_close(r, rr, rtol=2e-6, what="row lse")
    assert_rel_close(c, cr, rtol=2e-6, what="col lse")
    # Global (reference) statistics and arbitrary coefficients, as the ring
    # passes them.
    a_r, a_c = 0.3 / n, -1.7 / m
    out = jax.jit(lambda x, y, r, c: be.lse_grad(
        x, y, t, b, r, c, a_r, a_c, block_sizes=self.BLOCKS))(
            x, y, jnp.asarray(rr, jnp.float32), jnp.asarray(cr, jnp.float32))
    ref = np_tile_ops(as64(x), as64(y), t, b, a_r, a_c)[2]
    assert all(o.dtype == jnp.float32 for o in out)
    rtol = 2e-5 if dtype == jnp.float32 else tol(dtype)
    for o, e, what in zip(out, ref, ("dx", "dy", "dscale", "dbias")):
      assert_rel_close(o, e, rtol=rtol, atol=1e-7, what=what)

  def test_seam_one_statistic(self):
    """rows only / cols only, and a None lse meaning a zero coefficient."""
    rng = np.random.default_rng(1)
    x = rand_emb(rng, 20, 19, jnp.float32)
    y = rand_emb(rng, 41, 19, jnp.float32)
    be = self.backend()
    rr, cr, _ = np_tile_ops(as64(x), as64(y), 3.0, 0.5, 0.0, 0.0)
    r, c = be.lse(x, y, 3.0, 0.5, rows=True, cols=False, block_sizes=self.BLOCKS)
    assert c is None
    assert_rel_close(r, rr, rtol=2e-6, what="row lse")
    r, c = be.lse(x, y, 3.0, 0.5, rows=False, cols=True, block_sizes=self.BLOCKS)
    assert r is None
    assert_rel_close(c, cr, rtol=2e-6, what="col lse")
    out = be.lse_grad(x, y, 3.0, 0.5, None, jnp.asarray(cr, jnp.float32),
                      0.0, 0.25, block_sizes=self.BLOCKS)
    ref = np_tile_ops(as64(x), as64(y), 3.0, 0.5, 0.0, 0.25)[2]
    for o, e, what in zip(out, ref, ("dx", "dy", "dscale", "dbias")):
      assert_rel_close(o, e, rtol=2e-5, atol=1e-7, what=what)

  @pytest.mark.parametrize("bx,by,d,direction,dtype", [
      (37, 37, 21, "both", jnp.float32),
      (37, 37, 21, "both", jnp.bfloat16),
      (37, 37, 21, "both", jnp.float16),
      (19, 50, 33, "image_to_text", jnp.float32),
      (50, 19, 33, "text_to_image", jnp.bfloat16),
  ])
  def test_loss_matches_float64(self, bx, by, d, direction, dtype):
    rng = np.random.default_rng(bx * 1000 + by)
    x, y = rand_emb(rng, bx, d, dtype), rand_emb(rng, by, d, dtype)
    check_loss(x, y, 14.3, 0.4, direction, dtype, self.BLOCKS,
               backend=self.NAME)

  @pytest.mark.parametrize("single_exp", [True, False])
  def test_extreme_logits_take_exact_path(self, single_exp):
    """Logits spanning > 2^64 inside a tile, both exponential paths.

    Near-duplicate and opposite unit vectors at scale 100 put logits at
    +-100 (base-2 span ~290) in the same tile: the shared shift would
    underflow, so the kernels must detect it and use the exact form.
    """
    x, y = extreme_logit_pair(jnp.float32)
    bs = dataclasses.replace(self.BLOCKS, single_exp=single_exp)
    check_loss(x, y, 100.0, -5.0, "both", jnp.float32, bs, backend=self.NAME)

  def test_default_blocks_and_one_panel(self):
    """The platform's default BlockSizes (None) and a single panel."""
    rng = np.random.default_rng(3)
    x, y = rand_emb(rng, 33, 24, jnp.float32), rand_emb(rng, 33, 24, jnp.float32)
    bs = None if self.INTERPRET else TINY
    check_loss(x, y, 8.0, 0.0, "both", jnp.float32, bs, backend=self.NAME)

  def test_nan_input_gives_nan(self):
    rng = np.random.default_rng(4)
    x = np.array(rand_emb(rng, 20, 8, jnp.float32))
    x[3, 2] = np.nan
    y = rand_emb(rng, 20, 8, jnp.float32)
    val, dx, _, dt, _ = _loss_and_grads(jnp.asarray(x), y, jnp.float32(5.0),
                                        jnp.float32(0.0), "both", self.BLOCKS,
                                        self.NAME)
    assert np.isnan(float(val))
    assert np.isnan(np.asarray(dx)).any() and np.isnan(float(dt))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestPallasSoftmaxGpu(TestPallasSoftmaxInterpret):
  INTERPRET = False

  @pytest.mark.parametrize("dtype,f32_precision,rtol", [
      (jnp.bfloat16, "tf32", 2e-2), (jnp.float16, "tf32", 1e-2),
      # TF32 products carry a 2^-11 relative error: the default float32
      # mode is held to 1e-3, "highest" to the float32 tolerance.
      (jnp.float32, "tf32", 1e-3), (jnp.float32, "highest", 5e-5)])
  def test_b4096_default_blocks(self, dtype, f32_precision, rtol):
    rng = np.random.default_rng(5)
    x, y = rand_emb(rng, 4096, 768, dtype), rand_emb(rng, 4096, 768, dtype)
    bs = dataclasses.replace(default_tiles(self.NAME, dtype),
                             f32_precision=f32_precision)
    check_loss(x, y, 14.3, -2.0, "both", dtype, bs, rtol=rtol,
               backend=self.NAME)

  def test_past_2_to_the_31_matches_xla(self):
    """B * D > 2**31 elements per input: the kernels' offsets must not wrap."""
    check_past_int32_against_xla(
        lambda x, y, name: contrastive_loss(x, y, 10.0, backend=name),
        self.NAME, seed=7)

  def test_b65536_matches_xla(self):
    rng = np.random.default_rng(6)
    x = rand_emb(rng, 65536, 768, jnp.bfloat16)
    y = rand_emb(rng, 65536, 768, jnp.bfloat16)
    out = {}
    for backend in (self.NAME, "xla"):
      def f(x, y, t, b, backend=backend):
        return contrastive_loss(x, y, t, logit_bias=b, backend=backend)
      out[backend] = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(
          x, y, jnp.float32(20.0), jnp.float32(0.5))
    (vp, gp), (vx, gx) = out[self.NAME], out["xla"]
    assert_rel_close(vp, np.asarray(vx), rtol=1e-5, what="loss")
    for a, e, what in zip(gp[:3], gx[:3], ("dx", "dy", "dscale")):
      assert_rel_close(a, np.asarray(jnp.asarray(e, jnp.float32)),
                       rtol=2e-3, what=what)


def test_auto_never_picks_pallas_on_cpu():
  """The backend builds on any platform; "auto" never picks it on CPU."""
  assert registry.get("pallas", "softmax", platform="cpu").interpret
  assert registry.resolve("auto", "softmax", platform="cpu") == "xla"


def test_block_sizes_validation():
  with pytest.raises(ValueError, match="block_k must be a power of two"):
    BlockSizes(16, 24).check_pallas()
  with pytest.raises(ValueError, match="panel_rows"):
    BlockSizes(16, 32, panel_rows=40).check_pallas()
  with pytest.raises(ValueError, match="f32_precision"):
    BlockSizes(16, 32, f32_precision="tf16")
  x = jnp.zeros((8, 4), jnp.float32)
  with pytest.raises(ValueError, match="power of two"):
    contrastive_loss(x, x, 1.0, backend="pallas",
                     block_sizes=BlockSizes(16, 24))
  for dt in DTYPES:
    for platform in ("cpu", "gpu"):
      default_tiles("pallas", dt, platform).check_pallas()
      default_tiles("mosaic", dt, platform).check_pallas()
  assert default_tiles("xla", jnp.float32) == BlockSizes(2048, 8192)
  assert default_tiles("xla", jnp.float32, "cpu") == BlockSizes(512, 2048)


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_both_families_trace_past_2_to_the_31_elements(family):
  """Inputs over 2**31 elements are not refused by either family: Pallas'
  Triton lowering indexes arrays over 4 GiB with 64-bit offsets (the GPU
  test ``test_past_2_to_the_31_matches_xla`` checks the values)."""
  be = registry.get("pallas", family, platform="cpu")
  big = jax.ShapeDtypeStruct((3_000_000, 768), jnp.bfloat16)
  r = jax.ShapeDtypeStruct((3_000_000,), jnp.float32)
  if family == "softmax":
    fwd = lambda x: be.lse(x, x, 1.0, 0.0, rows=True, cols=True)
    bwd = lambda x, r: be.lse_grad(x, x, 1.0, 0.0, r, r, 0.5, 0.5)
  else:
    fwd = lambda x: be.sigmoid_sum(x, x, 1.0, 0.0, has_diagonal=True)
    bwd = lambda x, r: be.sigmoid_grad(x, x, 1.0, 0.0, 1.0, has_diagonal=True)
  jax.eval_shape(fwd, big)
  dx = jax.eval_shape(bwd, big, r)[0]
  assert dx.shape == big.shape


def test_column_workspace_past_int32_is_a_clear_error():
  """The forward's column workspace (programs x B floats) is indexed by the
  kernel's own int32 arithmetic: past 2**31 it is refused by name."""
  be = registry.get("pallas", "softmax", platform="cpu")
  bs = BlockSizes(block_q=128, block_k=256, num_programs=256)
  x = jax.ShapeDtypeStruct((2**23 + 256, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"backend='pallas': column_workspace "
                     r"has \d+ elements \(padded\), over the 2\*\*31"):
    jax.eval_shape(lambda x: be.lse(x, x, 1.0, 0.0, rows=True, cols=True,
                                    block_sizes=bs), x)
