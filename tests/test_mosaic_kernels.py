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
import inspect
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
              scale=10.0, bias=-2.0, seed=0, tol=1e-5, **kernel_kw):
  xp, yp, s0 = _inputs(n, m, d, dtype, seed)
  s = scale * s0 + bias
  fn = jax.jit(lambda a, b: mosaic_lse_fwd.lse_fwd(
      a, b, scale, bias, n=n, m=m, rows=rows, cols=cols,
      num_programs=num_programs, interpret=interpret, **kernel_kw))
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
                scale=10.0, bias=-2.0, seed=1, tol=1e-2, a_r=0.5, a_c=0.5,
                **kernel_kw):
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
      num_programs=num_programs, interpret=interpret, **kernel_kw))
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


def check_rerun_path(interpret, n=200, m=300, d=64):
  """Tiles the per-tile test would send to the exact path: the unchecked
  pass must flag them (NaN), and the default (``check="rerun"``) must still
  be exact, as must ``check="tile"``."""
  xp, yp, s0 = _dominated_inputs(n, m, d, jnp.bfloat16, 5, boost=8.0)
  scale, bias = 20.0, -1.0
  s = scale * s0 + bias
  kw = dict(n=n, m=m, rows=True, cols=True, num_programs=1,
            interpret=interpret)
  once = {k: p.default for k, p in inspect.signature(
      mosaic_lse_fwd.lse_fwd).parameters.items()
          if p.kind == p.KEYWORD_ONLY and k not in kw and k != "check"}
  r, c = mosaic_lse_fwd._lse_fwd_once(xp, yp, scale, bias, check="rerun",  # pylint: disable=protected-access
                                      **kw, **once)
  assert np.isnan(np.asarray(r)).any() or np.isnan(np.asarray(c)).any()
  for check in ("rerun", "tile"):
    r, c = mosaic_lse_fwd.lse_fwd(xp, yp, scale, bias, check=check, **kw)
    assert _rel(r, _lse(s, 1)) < 1e-5, check
    assert _rel(c, _lse(s, 0)) < 1e-5, check


@pytest.mark.usefixtures("reset_mosaic_interpreter")
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


def _dominated_inputs(n, m, d, dtype, seed, boost):
  """Row 0 of x aligned with y row 0 and ``boost`` times longer: its logits
  dwarf the others', so in row block 0 the other rows' (and in column block
  0 the other columns') tile sums fall far below the tile max."""
  xp, yp, _ = _inputs(n, m, d, dtype, seed)
  x = np.asarray(xp, np.float32)
  x[0] = np.asarray(yp, np.float32)[0] * boost
  xp = jnp.asarray(x).astype(dtype)
  s0 = (np.asarray(xp, np.float64)[:n] @ np.asarray(yp, np.float64)[:m].T)
  return xp, yp, s0


@pytest.mark.usefixtures("reset_mosaic_interpreter")
class TestInterpretPaths:
  """The forward's exactness paths in the interpreter (small, padded)."""

  @pytest.mark.parametrize("check", ["rerun", "tile"])
  def test_fwd_large_logit_range(self, check):
    check_fwd(140, 300, 64, jnp.bfloat16, True, True, True, scale=100.0,
              num_programs=1, check=check)

  @pytest.mark.parametrize("check", ["rerun", "tile"])
  def test_fwd_merges(self, check):
    # Unpadded row blocks, one program: every column value is merged into a
    # finite running one three times on the shared path (the padded tests
    # merge there only into -inf).
    check_fwd(512, 256, 64, jnp.bfloat16, True, True, True, num_programs=1,
              check=check)

  def test_fwd_single_exp_off(self):
    check_fwd(300, 270, 100, jnp.bfloat16, True, True, True, num_programs=2,
              single_exp=False)

  def test_fwd_rerun_path(self):
    check_rerun_path(interpret=True)

  def test_panel_no_padding_f16(self):
    check_panel(256, 256, 128, jnp.float16, True, True, True, num_programs=1)


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

  def test_panel_four_stages_do_not_fit(self):
    # Two rings of 4 stages (256 KB) exceed the 227 KB of SMEM (the lowering
    # checks it): why the panel runs 3.
    xp, yp, _ = _inputs(256, 512, 128, jnp.bfloat16, 0)
    params = jnp.ones((4,), jnp.float32)
    r2 = jnp.zeros((xp.shape[0],), jnp.float32)
    c2 = jnp.zeros((yp.shape[0],), jnp.float32)
    fn = lambda a, b, rr, cc: mosaic_g_panel.g_panel(
        a, b, rr, cc, params, rows=True, cols=True, mask=True, num_stages=4)
    with pytest.raises(ValueError, match="shared memory"):
      jax.jit(fn).trace(xp, yp, r2, c2).lower(lowering_platforms=("cuda",))

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

  def test_fwd_4096_tile_check(self):
    check_fwd(4096, 4096, 768, jnp.bfloat16, True, True, False, check="tile")

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

  def test_fwd_rerun_path(self):
    # A dominated row block forces the exact retry; the NaN flags must
    # survive the compiled merges.
    check_rerun_path(interpret=False, n=1000, m=1500, d=256)


def test_drop_varying_types_replicated_and_moves_nothing():
  """``_axes.drop_varying`` (operands of the split rings' kernels inside
  shard_map): same values, no varying type, and no op left after XLA."""
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from infcl_jax import _axes  # pylint: disable=g-import-not-at-top
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  seen = {}

  def f(x):
    (y,) = _axes.drop_varying(x)
    seen["before"], seen["after"] = (_axes.varying_axes(x),
                                     _axes.varying_axes(y))
    return _axes.vary_like(y * 2, x)

  fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("d"),
                             out_specs=P("d")))
  x = jnp.arange(8, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(x) * 2)
  assert seen == {"before": frozenset({"d"}), "after": frozenset()}
  assert "bitcast-convert" not in fn.lower(x).compile().as_text()
  # Outside shard_map: the arrays themselves.
  assert _axes.drop_varying(x)[0] is x


def check_sigmoid(n, m, d, dtype, mode, interpret, num_programs=None,
                  scale=10.0, bias=-5.0, seed=3, **kernel_kw):
  """``sigmoid_tiles`` (sum or g) of one row panel against float64, with the
  positives on the diagonal (row id == column)."""
  from infcl_jax.kernels.mosaic import sigmoid as mosaic_sigmoid  # pylint: disable=g-import-not-at-top
  xp, yp, s0 = _inputs(n, m, d, dtype, seed)
  n_pad = xp.shape[0]
  s = scale * s0 + bias
  z = -np.ones((n, m))
  z[np.arange(min(n, m)), np.arange(min(n, m))] = 1.0
  ids = np.where(np.arange(n_pad) < n, np.arange(n_pad), -1).astype(np.int32)
  params = jnp.asarray([scale, bias, 1.0, 0.0], jnp.float32)
  mask = n_pad != n or yp.shape[0] != m
  fn = jax.jit(lambda a, b, r: mosaic_sigmoid.sigmoid_tiles(
      a, b, r, params, mode=mode, m=m, mask=mask, has_diagonal=True,
      num_programs=num_programs, interpret=interpret, **kernel_kw))
  out = fn(xp, yp, jnp.asarray(ids))
  if mode == "sum":
    ref = np.sum(np.logaddexp(0.0, -z * s))
    assert abs(float(out) - ref) <= 1e-5 * ref, (float(out), ref)
    return
  g, dsc, dbi = out
  ref = -z / (1.0 + np.exp(z * s))
  g64 = np.asarray(g, np.float64)
  assert _rel(g64[:n, :m], ref) < 1e-2
  assert np.all(g64[n:] == 0) and np.all(g64[:, m:] == 0)
  assert abs(float(dsc) - np.sum(ref * s0)) <= 1e-2 * np.sum(np.abs(ref * s0))
  assert abs(float(dbi) - np.sum(ref)) <= 1e-2 * np.sum(np.abs(ref)) + 1e-6


@pytest.mark.usefixtures("reset_mosaic_interpreter")
class TestInterpretSigmoid:
  """The sigmoid kernel's modes in the interpreter."""

  def test_sum(self):
    check_sigmoid(300, 270, 100, jnp.bfloat16, "sum", True, num_programs=2)

  def test_g(self):
    check_sigmoid(130, 520, 72, jnp.float16, "g", True, num_programs=3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestGpuSigmoid:

  @pytest.mark.parametrize("n,m,d", [(4096, 4096, 768), (3001, 2777, 1000)])
  def test_sum(self, n, m, d):
    check_sigmoid(n, m, d, jnp.bfloat16, "sum", False)
