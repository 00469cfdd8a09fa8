"""The Mosaic GPU kernels (``infcl_jax.kernels.mosaic``) against float64 numpy.

Self-contained: the kernels take padded arrays, so these tests pad, call the
kernel, and compare with a float64 reference computed from the same
(bf16 / f16-rounded) inputs.

* ``TestInterpret`` runs every kernel through jax's Mosaic GPU interpreter
  (``plgpu.InterpretGPUParams``) on the CPU: the real kernel bodies, with
  their three warpgroups as concurrent CPU threads, the TMA copies, the
  mbarriers and wgmma simulated. Sizes are small and off the block grid
  (padding of B and D, masking), with several persistent programs and
  rounds.
* ``TestGpu`` (``@pytest.mark.gpu``) compiles them for Hopper at real sizes
  and skips without a GPU.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax.kernels.mosaic import g_panel as mosaic_g_panel
from infcl_jax.kernels.mosaic import lse_fwd as mosaic_lse_fwd

ON_GPU = jax.default_backend() == "gpu"
LOG2E = math.log2(math.e)
BQ, BK, BD = 128, 128, 64          # the kernels' blocks (y rows pad to 2*BK)


def _round_up(v, k):
  return -(-v // k) * k


def _pad(a, rows, cols):
  return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _lse(a, axis):
  mx = a.max(axis=axis, keepdims=True)
  return (mx + np.log(np.exp(a - mx).sum(axis=axis, keepdims=True))
          ).squeeze(axis)


def _inputs(n, m, d, dtype, seed, spread=1.0):
  kx, ky = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (n, d), jnp.float32) * spread / math.sqrt(d)
  y = jax.random.normal(ky, (m, d), jnp.float32) * spread / math.sqrt(d)
  x, y = x.astype(dtype), y.astype(dtype)
  d_pad = _round_up(d, BD)
  xp = _pad(x, _round_up(n, BQ), d_pad)
  yp = _pad(y, _round_up(m, 2 * BK), d_pad)
  s0 = np.asarray(x, np.float64) @ np.asarray(y, np.float64).T
  return xp, yp, s0


def _rel(out, ref):
  out = np.asarray(out, np.float64)
  assert np.all(np.isfinite(out)), "non-finite output"
  return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def check_fwd(n, m, d, dtype, rows, cols, interpret, num_programs=None,
              scale=10.0, bias=-2.0, seed=0, tol=1e-5):
  xp, yp, s0 = _inputs(n, m, d, dtype, seed)
  s = scale * s0 + bias
  fn = jax.jit(lambda a, b: mosaic_lse_fwd.lse_fwd(
      a, b, scale, bias, n=n, m=m, rows=rows, cols=cols,
      num_programs=num_programs, interpret=interpret))
  r, c = fn(xp, yp)
  assert (r is None) != rows and (c is None) != cols
  if rows:
    assert r.shape == (n,) and r.dtype == jnp.float32
    err = _rel(r, _lse(s, 1))
    assert err < tol, f"row LSE rel err {err}"
  if cols:
    assert c.shape == (m,) and c.dtype == jnp.float32
    err = _rel(c, _lse(s, 0))
    assert err < tol, f"col LSE rel err {err}"


def check_panel(n, m, d, dtype, rows, cols, interpret, num_programs=None,
                scale=10.0, bias=-2.0, seed=1, tol=1e-2, a_r=0.5, a_c=0.5):
  xp, yp, s0 = _inputs(n, m, d, dtype, seed)
  n_pad, m_pad = xp.shape[0], yp.shape[0]
  s = scale * s0 + bias
  r, c = _lse(s, 1), _lse(s, 0)
  a_r = a_r if rows else 0.0
  a_c = a_c if cols else 0.0
  # An unused direction gets a finite placeholder, +inf still on padding.
  r2 = np.pad(r * LOG2E if rows else np.zeros(n), (0, n_pad - n),
              constant_values=np.inf)
  c2 = np.pad(c * LOG2E if cols else np.zeros(m), (0, m_pad - m),
              constant_values=np.inf)
  params = jnp.asarray([scale * LOG2E, bias * LOG2E, a_r, a_c], jnp.float32)
  mask = n_pad != n or m_pad != m
  fn = jax.jit(lambda a, b, rr, cc: mosaic_g_panel.g_panel(
      a, b, rr, cc, params, rows=rows, cols=cols, mask=mask,
      num_programs=num_programs, interpret=interpret))
  g, dsc, dbi = fn(xp, yp, jnp.asarray(r2, jnp.float32),
                   jnp.asarray(c2, jnp.float32))
  assert g.shape == (n_pad, m_pad) and g.dtype == xp.dtype
  ref = np.zeros((n, m))
  if rows:
    ref = ref + a_r * np.exp(s - r[:, None])
  if cols:
    ref = ref + a_c * np.exp(s - c[None, :])
  g64 = np.asarray(g, np.float64)
  err = _rel(g64[:n, :m], ref)
  assert err < tol, f"G rel err {err}"
  # Padding is exactly zero (the GEMMs after the kernel rely on it).
  assert np.all(g64[n:] == 0) and np.all(g64[:, m:] == 0)
  ref_dsc, ref_dbi = np.sum(ref * s0), np.sum(ref)
  assert abs(float(dsc) - ref_dsc) <= tol * np.sum(np.abs(ref * s0)) + 1e-6
  assert abs(float(dbi) - ref_dbi) <= tol * ref_dbi


@pytest.fixture(autouse=False)
def _reset_interpreter():
  yield
  # After an exception the interpreter's global state must be reset.
  try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    interpret_pallas_call.reset_gpu_interpret_mode_state()
  except Exception:  # pylint: disable=broad-except
    pass


@pytest.mark.usefixtures("_reset_interpreter")
class TestInterpret:
  """Mosaic GPU interpreter on the CPU; small, padded sizes."""

  # n, m, d: off the (128, 256, 64) block grid; num_programs 2 with 3 row
  # blocks gives one program two rounds.
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_fwd_both(self, dtype):
    check_fwd(300, 270, 100, dtype, True, True, True, num_programs=2)

  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_fwd_one_way(self, rows, cols):
    # B_k > B_q (image_to_text) and B_q > B_k.
    n, m = (130, 520) if rows else (390, 200)
    check_fwd(n, m, 72, jnp.bfloat16, rows, cols, True, num_programs=3)

  def test_fwd_no_padding(self):
    check_fwd(256, 256, 128, jnp.bfloat16, True, True, True, num_programs=1)

  def test_fwd_large_logit_range(self):
    # scale 100: a row's LSE is dominated by one term, exp2 of the rest
    # underflows; the running max must carry it.
    check_fwd(140, 300, 64, jnp.bfloat16, True, True, True, scale=100.0,
              num_programs=1)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_panel_both(self, dtype):
    check_panel(300, 270, 100, dtype, True, True, True, num_programs=2)

  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_panel_one_way(self, rows, cols):
    check_panel(130, 520, 72, jnp.bfloat16, rows, cols, True, num_programs=3)

  def test_panel_no_padding(self):
    check_panel(256, 256, 128, jnp.bfloat16, True, True, True,
                num_programs=1)

  def test_check_fails_on_wrong_answer(self):
    # The comparison can fail: a perturbed scale must be caught.
    xp, yp, s0 = _inputs(130, 200, 64, jnp.bfloat16, 3)
    r, _ = mosaic_lse_fwd.lse_fwd(xp, yp, 10.0, 0.0, n=130, m=200, rows=True,
                                  cols=False, interpret=True)
    assert _rel(r, _lse(10.01 * s0, 1)) > 1e-5


class TestLowering:
  """Both kernels lower to a Mosaic GPU module for CUDA on any host.

  The interpreter ignores layouts; the Pallas -> Mosaic GPU lowering (run
  here without a GPU through ``lower(lowering_platforms=("cuda",))``)
  checks them, and catches what only the compiled path rejects (e.g. a
  select with an implicit scalar broadcast). PTX is not produced here.
  """

  @pytest.mark.parametrize("rows,cols,n,m", [(True, True, 300, 270),
                                             (True, False, 256, 512),
                                             (False, True, 130, 250)])
  def test_fwd_lowers(self, rows, cols, n, m):
    xp, yp, _ = _inputs(n, m, 100, jnp.bfloat16, 0)
    fn = lambda a, b: mosaic_lse_fwd.lse_fwd(a, b, 2.0, 0.5, n=n, m=m,
                                             rows=rows, cols=cols,
                                             num_programs=2)
    text = jax.jit(fn).trace(xp, yp).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text

  @pytest.mark.parametrize("mask", [True, False])
  def test_panel_lowers(self, mask):
    xp, yp, _ = _inputs(256, 512, 128, jnp.float16, 0)
    params = jnp.ones((4,), jnp.float32)
    r2 = jnp.zeros((xp.shape[0],), jnp.float32)
    c2 = jnp.zeros((yp.shape[0],), jnp.float32)
    fn = lambda a, b, rr, cc: mosaic_g_panel.g_panel(
        a, b, rr, cc, params, rows=True, cols=True, mask=mask)
    text = jax.jit(fn).trace(xp, yp, r2, c2).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestGpu:
  """Compiled for Hopper; float64 references at B = 4096 and odd shapes."""

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_fwd_4096(self, dtype):
    check_fwd(4096, 4096, 768, dtype, True, True, False)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_panel_4096(self, dtype):
    check_panel(4096, 4096, 768, dtype, True, True, False)

  def test_fwd_odd(self):
    check_fwd(3001, 2777, 1000, jnp.bfloat16, True, True, False,
              num_programs=7)

  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_fwd_one_way(self, rows, cols):
    n, m = (1000, 5000) if rows else (5000, 1000)
    check_fwd(n, m, 520, jnp.bfloat16, rows, cols, False)

  def test_panel_odd(self):
    check_panel(3001, 2777, 1000, jnp.bfloat16, True, True, False,
                num_programs=7)

  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_panel_one_way(self, rows, cols):
    check_panel(1000, 5000, 520, jnp.float16, rows, cols, False)
