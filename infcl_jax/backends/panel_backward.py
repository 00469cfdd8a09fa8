"""The panel backward that both kernel backends run, for both families.

Per panel of R rows, a kernel recomputes the logits once and writes the
gradient panel G (R x B, the input dtype), and the library GEMMs form
dx = G y and dy += G^T x. The loop over panels, its carry (typed
device-varying inside ``shard_map``) and the GEMMs are here; a family
supplies only the kernel that writes G (``softmax_grad``, ``sigmoid_grad``),
and ``bwd_impl="xla"`` forms the same panels in XLA.

Why not a fully fused dX / dY kernel: accumulating dX over D = 768 in one
program needs three 256-wide float32 accumulators and spilled on the H200;
writing G once in 16 bits costs ~2 bytes per logit of HBM
traffic and lets cuBLAS run both products near its peak.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import _math
from infcl_jax.backends.padding import MAX_INT32_ELEMS
from infcl_jax.backends.padding import pad1
from infcl_jax.backends.padding import pad_ids
from infcl_jax.backends.padding import pad2
from infcl_jax.backends.padding import round_up
from infcl_jax.backends.padding import row_ids

F32 = jnp.float32
dot = _math.dot


@dataclasses.dataclass(frozen=True)
class PanelLayout:
  """Shapes of the panel backward: ``n_panels`` panels of ``rows`` rows."""
  rows: int
  n_panels: int
  m_pad: int
  d_pad: int

  @property
  def n_pad(self):
    return self.rows * self.n_panels


def panel_layout(n, m, d, *, block_q, block_k, block_d,
                 panel_rows) -> PanelLayout:
  """At most ``panel_rows`` rows per panel (a multiple of the kernel's
  ``block_q``), few padded; columns padded to ``block_k``, D to
  ``block_d``. A panel stays below 2**31 elements."""
  m_pad = round_up(m, block_k)
  cap = max(block_q, (MAX_INT32_ELEMS // m_pad) // block_q * block_q)
  r = min(panel_rows, cap, round_up(n, block_q))
  n_panels = -(-n // r)
  # Spread the rows evenly so that the last panel is not mostly padding.
  r = round_up(-(-n // n_panels), block_q)
  return PanelLayout(r, n_panels, m_pad, round_up(d, block_d))


def scaled_half(a):
  """float32 (n, D) -> (float16 a / s, s): s per column, a power of two
  at least the column's largest |a| (so the quotient is exact but for the
  float16 rounding and never overflows), 1 for an all-zero or non-finite
  column (NaN and inf then reach the float16 copy as they are)."""
  amax = jnp.max(jnp.abs(a), axis=0)
  _, e = jnp.frexp(amax)  # amax < 2^e
  s = jnp.where((amax > 0) & jnp.isfinite(amax), jnp.ldexp(
      jnp.ones_like(amax), e), 1.0)
  return (a / s).astype(jnp.float16), s


def panel_backward(x, y, row_vec, g_panel, *, layout, precision, refs=(),
                   row_extras=(), panel_extras=(), gemm_dtype=None):
  """Sums (G y, G^T x, sum G * x y^T, sum G) over the panels of G.

  Args:
    x: (n, D), y: (m, D) unpadded inputs.
    row_vec: (layout.n_pad,) per-row input of the panel kernel, padded.
    g_panel: ``g_panel(x_p, yp, vec_p[, groups_p]) -> (g, g_mult, dsc,
      dbi)``: the panel G (R, m_pad) in the input dtype, a float32 scalar it
      was divided by (multiplied back after the GEMMs), and the panel's
      float32 sums of G * (x y^T) and of G.
    row_extras: further (layout.n_pad,) per-row arrays (the rows' int32
      group ids, ...), each split like ``row_vec`` and handed to
      ``g_panel`` after it.
    panel_extras: further arrays with one entry per panel (leading axis
      layout.n_panels), handed to ``g_panel`` after the row extras.
    layout: ``panel_layout(...)``.
    precision: matmul precision of the GEMMs.
    refs: further arrays the kernel reads (their varying axes type the
      carry inside ``shard_map``).
    gemm_dtype: None (the GEMMs take G and the inputs as they are) or
      float16: G is float16 and the GEMMs take float16 copies of x and y,
      each column scaled by a power of two (``scaled_half``, undone on the
      result's columns), on 16-bit tensor cores with float32 accumulation.

  Returns:
    float32 (dx (n, D), dy (m, D), dscale, dbias) before the caller's scale
    and coefficients.
  """
  n, d = x.shape
  m = y.shape[0]
  xp = pad2(x, layout.n_pad, layout.d_pad)
  yp = pad2(y, layout.m_pad, layout.d_pad)
  if gemm_dtype is None:
    xg, yg, sx, sy = xp, yp, None, None
  else:
    if jnp.dtype(gemm_dtype) != jnp.float16:
      raise ValueError(f"gemm_dtype must be None or float16, got {gemm_dtype}")
    (xg, sx), (yg, sy) = scaled_half(xp), scaled_half(yp)
    precision = lax.Precision.DEFAULT

  def panel(carry, inputs):
    dy, dsc, dbi = carry
    x_p = inputs[0]
    xg_p = x_p if gemm_dtype is None else inputs[1]
    g, g_mult, dsc_p, dbi_p = g_panel(x_p, yp, *inputs[2:])
    dx_p = dot(g, yg, ((1,), (0,)), precision) * g_mult
    dy = dy + dot(g, xg_p, ((0,), (0,)), precision) * g_mult
    return (dy, dsc + dsc_p, dbi + dbi_p), dx_p

  init = (jnp.zeros((layout.m_pad, layout.d_pad), F32), jnp.zeros((), F32),
          jnp.zeros((), F32))
  # Inside shard_map the carry must vary over the same mesh axes as what the
  # panels add to it.
  init = _axes.vary_like(init, xp, yp, row_vec, *refs)
  per_panel = lambda v: v.reshape(layout.n_panels, layout.rows)
  by_panel = lambda a: a.reshape(layout.n_panels, layout.rows, layout.d_pad)
  scanned = (by_panel(xp), by_panel(xg) if gemm_dtype else None,
             per_panel(row_vec))
  scanned = scanned + tuple(per_panel(v) for v in row_extras) + tuple(
      panel_extras)
  (dy, dsc, dbi), dx = lax.scan(panel, init, scanned)
  dx = dx.reshape(layout.n_pad, layout.d_pad)
  if gemm_dtype is not None:
    dx, dy = dx * sy, dy * sx
  return dx[:n, :d], dy[:m, :d], dsc, dbi


def usable_max(g_max):
  """The divisor of a float16 panel: its max |G|, or 1 if that is 0 / NaN.

  |G| <= 1, so dividing never overflows. An all-zero (or all-padding) panel
  keeps 1; a NaN panel keeps 1 too, and its NaN G still reaches the result.
  """
  return jnp.where((g_max > 0) & jnp.isfinite(g_max), g_max, 1.0).astype(F32)


def _padded_groups(groups, layout):
  """The row and column group ids padded to the layout (``pad_ids``)."""
  if groups is None:
    return None, None
  gx, gy = groups
  return pad_ids(gx, layout.n_pad), pad_ids(gy, layout.m_pad)


def softmax_grad(x, y, scale, bias, row_lse, col_lse, row_coef, col_coef, *,
                 layout, precision, panel=None, groups=None, group_tiles=None,
                 gemm_dtype=None):
  """``lse_grad`` of a kernel backend: (dx, dy, dscale, dbias), float32.

  Probabilities are in [0, 1] and the coefficients (~1/B) are applied after
  the GEMMs, so that a 16-bit G does not underflow: G is stored as
  a_r P^r + a_c P^c with the larger |coefficient| normalised to 1.
  ``panel(x_p, yp, r_p, c2, params, rows=, cols=, mask=)`` writes one panel
  of G in x's dtype and returns it with its sums of G * x y^T and of G;
  params = [scale log2 e, bias log2 e, a_r, a_c], r_p / c2 the base-2
  statistics (+inf on padding). ``panel=None`` forms the panel in XLA.
  With ``groups`` (``base``: related pairs have G = 0) the panel is also
  given ``groups=(gx_p, gy)``: the panel rows' and all columns' padded
  int32 group ids; and with ``group_tiles(gx, gy, rows)`` (all padded
  ids, the rows per panel) -> per-panel arrays (leading axis: the panels),
  ``tiles=`` their entries of the panel: what a kernel derives from the
  ids once for every panel, outside the panel loop.

  ``gemm_dtype`` float16 (float32 inputs on TF32 tiles): ``panel`` writes G
  in float16 and the GEMMs run on 16-bit tensor cores (``panel_backward``).
  |G| <= 2 and the coefficients come after the GEMMs, so float16 holds G to
  a relative 2^-11 (5e-4) down to 6e-5 and to 6e-8 absolute below, which
  the gradients carry as ~3e-4 of their summed terms: beside TF32's logit
  error, and a third of the float32 GEMMs' time (TF32 runs at half the
  16-bit rate and G's bytes halve). It holds float16 copies of x and y
  (2 bytes per element each) beside them.
  """
  n = x.shape[0]
  m = y.shape[0]
  rows, cols = row_lse is not None, col_lse is not None
  scale = jnp.asarray(scale, F32)
  bias = jnp.asarray(bias, F32)
  a_r, a_c, norm = _math.unit_coefs(row_coef if rows else None,
                                    col_coef if cols else None)
  # Base-2 statistics, +inf on padding; an unused direction gets zeros
  # (its exp term is compiled out) but keeps +inf on padding for masking.
  r2 = (row_lse.astype(F32) * _math.LOG2E) if rows else jnp.zeros((n,), F32)
  c2 = (col_lse.astype(F32) * _math.LOG2E) if cols else jnp.zeros((m,), F32)
  r2 = pad1(r2, layout.n_pad, jnp.inf)
  c2 = pad1(c2, layout.m_pad, jnp.inf)
  params = jnp.stack([scale * _math.LOG2E, bias * _math.LOG2E, a_r,
                      a_c]).astype(F32)
  mask = layout.n_pad != n or layout.m_pad != m
  panel = panel or functools.partial(_xla_softmax_panel, precision=precision,
                                     g_dtype=gemm_dtype)
  gx, gy = _padded_groups(groups, layout)

  tiles = () if group_tiles is None or groups is None else tuple(
      group_tiles(gx, gy, layout.rows))

  def g_panel(x_p, yp, r_p, gx_p=None, *tiles_p):
    kw = {} if groups is None else {"groups": (gx_p, gy)}
    if tiles_p:
      kw["tiles"] = tiles_p
    g, dsc, dbi = panel(x_p, yp, r_p, c2, params, rows=rows, cols=cols,
                        mask=mask, **kw)
    return g, jnp.ones((), F32), dsc, dbi

  dx, dy, dsc, dbi = panel_backward(
      x, y, r2, g_panel, layout=layout, precision=precision,
      refs=(c2, params) + (() if groups is None else (gy,)),
      row_extras=() if groups is None else (gx,), panel_extras=tiles,
      gemm_dtype=gemm_dtype)
  return dx * (scale * norm), dy * (scale * norm), dsc * norm, dbi * norm


def sigmoid_grad(x, y, scale, bias, coef, *, has_diagonal, layout, precision,
                 panel=None, groups=None, group_mode="mask",
                 diagonal_outside=False):
  """``sigmoid_grad`` of a kernel backend: (dx, dy, dscale, dbias), float32.

  G = (-z) sigmoid(-z s) lies in [-1, 1]; coef (~1/B) is applied after the
  GEMMs. bfloat16 has float32's exponent range, float16 does not (below
  ~6e-8 it flushes to 0), so a float16 panel is first scanned for its
  largest |G| (a second recompute) and stored divided by it.
  ``panel(x_p, yp, rid_p, params, mode, m=, mask=, scaled=, has_diagonal=)``:
  mode "max"
  returns the panel's largest |G|; mode "g" writes G (times params[2] when
  ``scaled``) in x's dtype and returns it with its float32 sums of
  G * x y^T and of G; params = [scale, bias, g_scale, 0], rid_p the rows'
  global indices (-1 on padding). ``panel=None`` forms the panel in XLA.
  With ``groups`` the panel is also given ``groups=(gx_p, gy)`` (as in
  ``softmax_grad``) and ``group_mode`` (``base``).

  ``diagonal_outside`` (grouped, a block pair with a diagonal): the panel
  kernel runs without the diagonal (one compare and two selects fewer per
  logit, which a latency-bound panel pays in full) and the diagonal's G is
  written here afterwards, with the scalar sums corrected by the
  difference: O(B * D) beside the panels' O(B^2 * D).
  """
  n, d = x.shape
  m = y.shape[0]
  scale = jnp.asarray(scale, F32)
  bias = jnp.asarray(bias, F32)
  coef = jnp.asarray(coef, F32)
  rescale = jnp.dtype(x.dtype) == jnp.float16
  rid = row_ids(n, layout.n_pad)
  kw = dict(m=m, mask=layout.n_pad != n or layout.m_pad != m, scaled=rescale,
            has_diagonal=has_diagonal)
  panel = panel or functools.partial(_xla_sigmoid_panel, precision=precision)
  gx, gy = _padded_groups(groups, layout)
  outside = diagonal_outside and has_diagonal and groups is not None
  row_extras = () if groups is None else (gx,)
  if outside:
    kw["has_diagonal"] = False
    g_diag, dsc_fix, dbi_fix = _diagonal_fix(x, y, scale, bias, groups,
                                             group_mode)
    row_extras = (gx, pad1(g_diag, layout.n_pad, 0.0))

  def g_panel(x_p, yp, rid_p, gx_p=None, gd_p=None):
    pkw = dict(kw) if groups is None else dict(
        kw, groups=(gx_p, gy), group_mode=group_mode)
    g_max = jnp.ones((), F32)
    if rescale:
      unit = jnp.stack([scale, bias, 1.0, 0.0]).astype(F32)
      g_max = panel(x_p, yp, rid_p, unit, "max", **pkw)
      if gd_p is not None:
        g_max = jnp.maximum(g_max, jnp.max(jnp.abs(gd_p)))
      g_max = usable_max(g_max)
    params = jnp.stack([scale, bias, 1.0 / g_max, 0.0]).astype(F32)
    g, dsc, dbi = panel(x_p, yp, rid_p, params, "g", **pkw)
    if gd_p is not None:
      # Padded rows (-1) point past the end and are dropped.
      cols = jnp.where(rid_p >= 0, rid_p, g.shape[1])
      val = gd_p * params[2] if rescale else gd_p
      g = g.at[jnp.arange(g.shape[0]), cols].set(val.astype(g.dtype),
                                                 mode="drop")
    return g, g_max, dsc, dbi

  dx, dy, dsc, dbi = panel_backward(
      x, y, rid, g_panel, layout=layout, precision=precision,
      refs=(scale, bias) + (() if groups is None else (gy,)),
      row_extras=row_extras)
  if outside:
    dsc, dbi = dsc + dsc_fix, dbi + dbi_fix
  return dx * (scale * coef), dy * (scale * coef), dsc * coef, dbi * coef


def _diagonal_logits(x, y, scale, bias):
  """(x_i . y_i, s_ii) of a square block pair, float32 row dot products."""
  s0 = jnp.sum(x.astype(F32) * y[:x.shape[0]].astype(F32), axis=1)
  return s0, s0 * scale + bias


def _diagonal_related(groups, n):
  return groups[0][:n] == groups[1][:n]


def _on_diagonal(related, group_mode, positive, negative):
  """What tiles run without their diagonal put on the pair (i, i): on a
  related pair the related pairs' treatment (dropped, 0, for "mask"; the
  positive's ``positive`` for "positives"), on any other a negative's
  ``negative``."""
  on_related = 0.0 if group_mode == "mask" else positive
  return jnp.where(related, on_related, negative)


def _diagonal_fix(x, y, scale, bias, groups, group_mode):
  """For a grouped panel run without its diagonal: each row's diagonal G
  (-sigmoid(-s_ii), the positive's), and the corrections of the sums of
  G * x y^T and of G for what the kernel put there instead
  (``_on_diagonal``). float32, from the rows' exact float32 dot
  products."""
  s0, s = _diagonal_logits(x, y, scale, bias)
  g_true = -jax.nn.sigmoid(-s)
  g_kernel = _on_diagonal(_diagonal_related(groups, x.shape[0]), group_mode,
                          g_true, jax.nn.sigmoid(s))
  delta = g_true - g_kernel
  return g_true, jnp.sum(delta * s0), jnp.sum(delta)


def diagonal_sum_fix(x, y, scale, bias, groups, group_mode="mask"):
  """For grouped sigmoid tiles summed without their diagonal: the
  positives' terms softplus(-s_ii), less what the tiles put there instead
  (``_on_diagonal``). float32 scalar."""
  _, s = _diagonal_logits(x, y, scale, bias)
  related = _diagonal_related(groups, x.shape[0])
  kernel = _on_diagonal(related, group_mode, _math.softplus(-s),
                        _math.softplus(s))
  return jnp.sum(_math.softplus(-s) - kernel)


# ``bwd_impl="xla"``: the same panels from XLA's GEMM and a fusion. They
# materialise the (R, B) float32 logits of a panel (more memory and HBM
# traffic than the kernels); a user's escape hatch where a panel kernel
# does not compile, and the measure of what the kernels save.

def _xla_softmax_panel(x_p, yp, r2, c2, params, *, rows, cols, mask,
                       precision, groups=None, g_dtype=None):
  s0 = dot(x_p, yp, ((1,), (1,)), precision)
  s = s0 * params[0] + params[1]
  g = jnp.zeros_like(s)
  if rows:
    g = g + params[2] * jnp.exp2(s - r2[:, None])
  if cols:
    g = g + params[3] * jnp.exp2(s - c2[None, :])
  if mask:
    g = jnp.where((r2 != jnp.inf)[:, None] & (c2 != jnp.inf)[None, :], g, 0.0)
  if groups is not None:
    g = jnp.where(groups[0][:, None] == groups[1][None, :], 0.0, g)
  return g.astype(g_dtype or x_p.dtype), jnp.sum(g * s0), jnp.sum(g)


def _xla_sigmoid_panel(x_p, yp, rid, params, mode, *, m, mask, scaled,
                       precision, has_diagonal, groups=None,
                       group_mode="mask"):
  s0 = dot(x_p, yp, ((1,), (1,)), precision)
  s = s0 * params[0] + params[1]
  cid = jnp.arange(yp.shape[0], dtype=jnp.int32)
  pos = (rid[:, None] == cid[None, :]) if has_diagonal else jnp.zeros((), bool)
  drop = jnp.zeros((), bool)
  if groups is not None:
    rel = groups[0][:, None] == groups[1][None, :]
    if group_mode == "positives":
      pos = pos | rel
    else:
      drop = rel & ~pos
  g = jnp.where(pos, -1.0 / (1.0 + jnp.exp(s)), 1.0 / (1.0 + jnp.exp(-s)))
  if groups is not None:
    g = jnp.where(drop, 0.0, g)
  if mask:
    g = jnp.where((rid >= 0)[:, None] & (cid < m)[None, :], g, 0.0)
  if mode == "max":
    return jnp.max(jnp.abs(g))
  gs = g * params[2] if scaled else g
  return gs.astype(x_p.dtype), jnp.sum(g * s0), jnp.sum(g)
