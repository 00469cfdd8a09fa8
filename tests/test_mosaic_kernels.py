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

from benchmarks import bench_mosaic_kernels as bench_variants
from infcl_jax.backends import mosaic as mosaic_backend
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


def check_rerun_path(col_merge, interpret, n=200, m=300, d=64, **kernel_kw):
  """Tiles the per-tile check would send to the exact path: the unchecked
  pass must flag them (NaN), and ``check="rerun"`` must still be exact."""
  xp, yp, s0 = _dominated_inputs(n, m, d, jnp.bfloat16, 5, boost=8.0)
  scale, bias = 20.0, -1.0
  s = scale * s0 + bias
  # The unchecked pass alone, with lse_fwd's defaults for the rest.
  kw = {k: p.default for k, p in inspect.signature(
      mosaic_lse_fwd.lse_fwd).parameters.items()
        if p.kind == p.KEYWORD_ONLY and k != "check"}
  kw.update(kernel_kw)
  kw.pop("check", None)
  kw.update(n=n, m=m, rows=True, cols=True, num_programs=1,
            interpret=interpret, col_merge=col_merge)
  r, c = mosaic_lse_fwd._lse_fwd_once(xp, yp, scale, bias, check="rerun",
                                      **kw)
  assert np.isnan(np.asarray(r)).any() or np.isnan(np.asarray(c)).any()
  r, c = mosaic_lse_fwd.lse_fwd(xp, yp, scale, bias, check="rerun", **kw)
  assert _rel(r, _lse(s, 1)) < 1e-5
  assert _rel(c, _lse(s, 0)) < 1e-5


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


# Variants behind keyword arguments (defaults unchanged); each must match the
# float64 reference like the default. See docs/mosaic_notes.md.
FWD_VARIANTS = {
    "rmw2": dict(col_merge="rmw2"),
    "deferred": dict(col_merge="deferred"),
    "private_nopp": dict(private_scratch=True, pingpong=False),
    "private_pp": dict(private_scratch=True, pingpong=True),
    "rerun": dict(check="rerun"),
    "all": dict(check="rerun", col_merge="rmw2", private_scratch=True,
                pingpong=False, reduction_scratch_bytes=16384),
    "all_deferred": dict(check="rerun", col_merge="deferred",
                         private_scratch=True, pingpong=False),
    "split_rings": dict(rings="split", num_stages=3),
    "split_rings_all": dict(rings="split", num_stages=3, check="rerun",
                            col_merge="rmw2", private_scratch=True,
                            pingpong=True, reduction_scratch_bytes=16384),
    "split_rings_all_nopp": dict(rings="split", num_stages=3, check="rerun",
                                 col_merge="rmw2", private_scratch=True,
                                 pingpong=False),
    # What backend="mosaic" runs.
    "in_use": mosaic_backend.LSE_FWD_KERNEL,
}
PANEL_VARIANTS = {
    "split2": dict(epilogue_split=2),
    "split2_st4": dict(epilogue_split=2, num_stages=4,
                       reduction_scratch_bytes=0),
    "fused": dict(single_exp=True),
    "fused_split2_st4": dict(single_exp=True, epilogue_split=2, num_stages=4,
                             reduction_scratch_bytes=0),
    "rings_pp": dict(rings="split", num_stages=3, epilogue_split=2,
                     reduction_scratch_bytes=0, pingpong=True),
    "rings_pp_fused": dict(rings="split", num_stages=3, epilogue_split=2,
                           reduction_scratch_bytes=0, pingpong=True,
                           single_exp=True),
    "rings_st2_pp_fused": dict(rings="split", num_stages=2, pingpong=True,
                               single_exp=True),
    "in_use": mosaic_backend.G_PANEL_KERNEL,
}
# The kernels' own defaults and the settings the backend uses.
SETTINGS = ["default", "in_use"]


def _fwd_kw(name):
  return {} if name == "default" else FWD_VARIANTS[name]


def _panel_kw(name):
  return {} if name == "default" else PANEL_VARIANTS[name]


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
class TestInterpretVariants:
  """The keyword-argument variants in the interpreter (small, padded)."""

  @pytest.mark.parametrize("name", ["rmw2", "deferred", "rerun",
                                    "private_nopp", "split_rings_all",
                                    "in_use"])
  def test_fwd_both(self, name):
    check_fwd(300, 270, 100, jnp.bfloat16, True, True, True, num_programs=2,
              **FWD_VARIANTS[name])

  @pytest.mark.parametrize("name", ["all", "all_deferred", "in_use"])
  def test_fwd_large_logit_range(self, name):
    check_fwd(140, 300, 64, jnp.bfloat16, True, True, True, scale=100.0,
              num_programs=1, **FWD_VARIANTS[name])

  @pytest.mark.parametrize("name", ["rmw2", "split_rings_all_nopp"])
  def test_fwd_merges(self, name):
    # Unpadded row blocks, one program: every column value is merged into a
    # finite running one three times on the shared path (the padded tests
    # above merge there only into -inf).
    check_fwd(512, 256, 64, jnp.bfloat16, True, True, True, num_programs=1,
              **FWD_VARIANTS[name])

  @pytest.mark.parametrize("name", ["deferred", "private_nopp",
                                    "split_rings_all", "in_use"])
  def test_fwd_cols_only(self, name):
    check_fwd(390, 200, 72, jnp.bfloat16, False, True, True, num_programs=3,
              **FWD_VARIANTS[name])

  @pytest.mark.parametrize("col_merge", ["rmw", "rmw2"])
  def test_fwd_rerun_path(self, col_merge):
    check_rerun_path(col_merge, interpret=True)

  def test_fwd_rerun_path_in_use(self):
    kw = dict(FWD_VARIANTS["in_use"])
    check_rerun_path(kw.pop("col_merge"), interpret=True, **kw)

  @pytest.mark.parametrize("name", ["split2_st4", "fused", "rings_pp_fused",
                                    "rings_st2_pp_fused", "in_use"])
  def test_panel_both(self, name):
    check_panel(300, 270, 100, jnp.bfloat16, True, True, True,
                num_programs=2, **PANEL_VARIANTS[name])

  @pytest.mark.parametrize("name", ["split2_st4", "fused_split2_st4",
                                    "rings_pp_fused"])
  def test_panel_no_padding(self, name):
    check_panel(256, 256, 128, jnp.float16, True, True, True, num_programs=1,
                **PANEL_VARIANTS[name])

  @pytest.mark.parametrize("name", ["rings_pp_fused", "in_use"])
  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_panel_one_way_split(self, rows, cols, name):
    check_panel(130, 520, 72, jnp.bfloat16, rows, cols, True, num_programs=3,
                **PANEL_VARIANTS[name])

  @pytest.mark.parametrize("name", ["split_rings", "in_use"])
  def test_fwd_rows_only_split_rings(self, name):
    check_fwd(130, 520, 72, jnp.bfloat16, True, False, True, num_programs=3,
              **FWD_VARIANTS[name])

  def test_panel_fused_fallback(self):
    """Row block 0's statistics are pushed 300 (base 2) up, so its tiles
    span > FUSED_SPAN and take the two-exponential form, row block 1 the
    fused one; G (any finite r, c define it) must match in both."""
    n, m, d = 256, 512, 64
    xp, yp, s0 = _inputs(n, m, d, jnp.bfloat16, 6)
    scale, bias = 10.0, 0.0
    s = scale * s0 + bias
    r, c = _lse(s, 1), _lse(s, 0)
    r[:BQ] += 300.0 / LOG2E
    r2 = jnp.asarray(r * LOG2E, jnp.float32)
    c2 = jnp.asarray(c * LOG2E, jnp.float32)
    tab = np.asarray(mosaic_g_panel._shift_table(r2, c2, BQ, BK))
    assert np.isinf(tab[:m // BK]).all() and np.isfinite(tab[m // BK:]).all()
    params = jnp.asarray([scale * LOG2E, bias * LOG2E, 0.5, 0.5], jnp.float32)
    g, _, dbi = mosaic_g_panel.g_panel(xp, yp, r2, c2, params, rows=True,
                                       cols=True, mask=False, single_exp=True,
                                       epilogue_split=2, num_programs=2,
                                       interpret=True)
    ref = 0.5 * np.exp(s - r[:, None]) + 0.5 * np.exp(s - c[None, :])
    g64 = np.asarray(g, np.float64)
    for rows_ in (slice(0, BQ), slice(BQ, n)):
      assert _rel(g64[rows_], ref[rows_]) < 1e-2
    assert abs(float(dbi) - ref.sum()) <= 1e-2 * ref.sum()

  def test_shift_table_bounds(self):
    # Padding (+inf) and wide spans get +inf; narrow spans the shift.
    r2 = jnp.asarray([0.0] * 128 + [0.0] * 127 + [jnp.inf], jnp.float32)
    c2 = jnp.asarray([1.0] * 128 + [10.0] * 127 + [200.0], jnp.float32)
    tab = np.asarray(mosaic_g_panel._shift_table(r2, c2, 128, 128))
    assert tab.shape == (4,)
    assert tab[0] == mosaic_g_panel.FUSED_SHIFT
    assert np.isinf(tab[1:]).all()


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

  @pytest.mark.parametrize("name", list(bench_variants.VARIANTS))
  def test_variant_lowers(self, name):
    """Every variant the GPU benchmark runs (``--variants all``), with the
    benchmark's stage depths, at a small shape."""
    stage, kw = bench_variants.VARIANTS[name]
    xp, yp, _ = _inputs(256, 256, 128, jnp.bfloat16, 0)
    if stage == "fwd":
      kw = {**bench_variants.FWD_BASE, **kw}
      fn = lambda a, b: mosaic_lse_fwd.lse_fwd(a, b, 2.0, 0.5, n=256, m=256,
                                               rows=True, cols=True, **kw)
      lowered = jax.jit(fn).trace(xp, yp).lower(lowering_platforms=("cuda",))
    else:
      kw = {**bench_variants.PANEL_BASE, **kw}
      params = jnp.ones((4,), jnp.float32)
      r2 = jnp.zeros((256,), jnp.float32)
      fn = lambda a, b, rr, cc: mosaic_g_panel.g_panel(
          a, b, rr, cc, params, rows=True, cols=True, mask=False, **kw)
      lowered = jax.jit(fn).trace(xp, yp, r2, r2).lower(
          lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()

  def test_panel_stages4_needs_split(self):
    # 4 stages with whole-tile G buffers exceed the 227 KB of SMEM (the
    # lowering checks it); 64-column sub-tiles (and no reduction scratch)
    # fit: test_panel_variant_lowers[split2_st4].
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


class TestBenchVariants:
  """``benchmarks/bench_mosaic_kernels.py --variants``: the script's
  pipeline in the interpreter (what it compiles is lowered in
  ``TestLowering.test_variant_lowers``)."""

  @pytest.mark.slow
  def test_variants_dry_run(self, tmp_path):
    import json  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(root, "benchmarks",
                                        "bench_mosaic_kernels.py"),
           "--interpret", "1", "--b", "512", "--check_b", "256", "--panel",
           "256", "--d", "64", "--reps", "1", "--inner", "1",
           "--variants", "fwd_rerun_rmw2_rsb16k,fwd:bogus=1",
           "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.load(open(tmp_path / "mosaic_variants.json"))["variants"]
    for name in ("fwd_default", "fwd_rerun_rmw2_rsb16k", "fwd_default#again"):
      assert res[name]["status"] == "OK", (name, res[name])
    assert res["fwd_rerun_rmw2_rsb16k"]["check"] == "PASS"
    assert res["fwd_rerun_rmw2_rsb16k"]["col_rel_err"] < 1e-5
    # A variant that raises is reported, and the run goes on.
    assert res["fwd:bogus=1"]["status"] == "ERROR"
    assert "PASS" in proc.stdout and "ERROR" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestGpu:
  """Compiled for Hopper; float64 references at B = 4096 and odd shapes."""

  @pytest.mark.parametrize("setting", SETTINGS)
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_fwd_4096(self, dtype, setting):
    check_fwd(4096, 4096, 768, dtype, True, True, False, **_fwd_kw(setting))

  @pytest.mark.parametrize("setting", SETTINGS)
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_panel_4096(self, dtype, setting):
    check_panel(4096, 4096, 768, dtype, True, True, False,
                **_panel_kw(setting))

  @pytest.mark.parametrize("setting", SETTINGS)
  def test_fwd_odd(self, setting):
    check_fwd(3001, 2777, 1000, jnp.bfloat16, True, True, False,
              num_programs=7, **_fwd_kw(setting))

  @pytest.mark.parametrize("setting", SETTINGS)
  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_fwd_one_way(self, rows, cols, setting):
    n, m = (1000, 5000) if rows else (5000, 1000)
    check_fwd(n, m, 520, jnp.bfloat16, rows, cols, False, **_fwd_kw(setting))

  @pytest.mark.parametrize("setting", SETTINGS)
  def test_panel_odd(self, setting):
    check_panel(3001, 2777, 1000, jnp.bfloat16, True, True, False,
                num_programs=7, **_panel_kw(setting))

  @pytest.mark.parametrize("setting", SETTINGS)
  @pytest.mark.parametrize("rows,cols", [(True, False), (False, True)])
  def test_panel_one_way(self, rows, cols, setting):
    check_panel(1000, 5000, 520, jnp.float16, rows, cols, False,
                **_panel_kw(setting))

  def test_fwd_in_use_rerun_path(self):
    # A dominated row block forces the in-use settings' exact retry.
    kw = dict(_fwd_kw("in_use"))
    check_rerun_path(kw.pop("col_merge"), interpret=False, n=1000, m=1500,
                     d=256, **kw)

  @pytest.mark.parametrize("name", sorted(FWD_VARIANTS))
  def test_fwd_variant_4096(self, name):
    check_fwd(4096, 4096, 768, jnp.bfloat16, True, True, False,
              **FWD_VARIANTS[name])

  @pytest.mark.parametrize("col_merge", ["rmw", "rmw2", "deferred"])
  def test_fwd_rerun_path(self, col_merge):
    # NaN flags must survive the compiled merges (max.NaN etc.).
    check_rerun_path(col_merge, interpret=False, n=1000, m=1500, d=256)

  @pytest.mark.parametrize("name", sorted(PANEL_VARIANTS))
  def test_panel_variant_4096(self, name):
    check_panel(4096, 4096, 768, jnp.bfloat16, True, True, False,
                **PANEL_VARIANTS[name])


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
  """The sigmoid kernel's ring settings in the interpreter."""

  @pytest.mark.parametrize("kw", [{}, dict(num_stages=3, rings="split"),
                                  mosaic_backend.SIGMOID_SUM_KERNEL],
                           ids=["shared", "split", "in_use"])
  def test_sum(self, kw):
    check_sigmoid(300, 270, 100, jnp.bfloat16, "sum", True, num_programs=2,
                  **kw)

  def test_g_split_rings_two_stages(self):
    check_sigmoid(130, 520, 72, jnp.float16, "g", True, num_programs=3,
                  rings="split", num_stages=2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestGpuSigmoid:

  @pytest.mark.parametrize("kw", [{}, mosaic_backend.SIGMOID_SUM_KERNEL],
                           ids=["shared", "in_use"])
  @pytest.mark.parametrize("n,m,d", [(4096, 4096, 768), (3001, 2777, 1000)])
  def test_sum(self, kw, n, m, d):
    check_sigmoid(n, m, d, jnp.bfloat16, "sum", False, **kw)
