"""What the kernel backends share, for both loss families.

* Padding: the kernels take B and D padded to block multiples and mask the
  padding themselves, so any shape works.
* Indexing past 2**31 elements: Pallas' Triton lowering switches a ref's
  element offsets to 64 bits when the array exceeds 4 GiB, so inputs and
  panels of any size are indexed correctly (tested on the GPU past 2**31).
  What stays int32 is index arithmetic a kernel does itself on a flat
  buffer (the forward's column workspace); ``check_int32`` guards that.
* The panel backward: per panel of R rows, a kernel recomputes the logits
  once and writes the gradient panel G (R x B, the input dtype), and the
  library GEMMs form dx = G y and dy += G^T x. The loop over panels, its
  carry (typed device-varying inside ``shard_map``) and the GEMMs are here;
  a family supplies only the kernel that writes G.
* ``KernelBackend``: platform -> interpret mode (with a one-time warning),
  default block sizes by the GPU's compute capability, the matmul precision
  of float32 inputs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import _math
from infcl_jax.backends import base
from infcl_jax.backends import capability
from infcl_jax.block_sizes import BlockSizes

F32 = jnp.float32
MAX_INT32_ELEMS = 2**31 - 1


def round_up(v, k):
  return -(-v // k) * k


def pad2(a, rows, cols):
  r, c = a.shape
  if (r, c) == (rows, cols):
    return a
  return jnp.pad(a, ((0, rows - r), (0, cols - c)))


def pad1(v, n, fill):
  if v.shape[0] == n:
    return v
  return jnp.pad(v, (0, n - v.shape[0]), constant_values=fill)


def dot(a, b, contract, precision):
  return lax.dot_general(a, b, (contract, ((), ())),
                         preferred_element_type=F32, precision=precision)


def check_int32(backend, **sizes):
  """A flat buffer that a kernel indexes with its own int32 arithmetic must
  have fewer than 2**31 elements."""
  for what, elems in sizes.items():
    if elems > MAX_INT32_ELEMS:
      raise ValueError(
          f"backend={backend!r}: {what} has {elems} elements (padded), over "
          f"the 2**31 that the kernels' int32 indexing allows; use "
          f"backend='xla' or shard the batch (axis_name)")


def num_sms():
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except RuntimeError:
    return 132


def pad_inputs(x, y, block_q, block_k, block_d):
  """x, y zero-padded to (block_q | block_k) x block_d multiples."""
  d_pad = round_up(x.shape[1], block_d)
  xp = pad2(x, round_up(x.shape[0], block_q), d_pad)
  yp = pad2(y, round_up(y.shape[0], block_k), d_pad)
  return xp, yp


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


def panel_layout(bs, n, m, d) -> PanelLayout:
  """At most ``bs.panel_rows`` rows per panel, few padded; a panel stays
  below 2**31 elements."""
  bq = bs.bwd_block_q
  m_pad = round_up(m, bs.bwd_block_k)
  cap = max(bq, (MAX_INT32_ELEMS // m_pad) // bq * bq)
  r = min(bs.panel_rows, cap, round_up(n, bq))
  n_panels = -(-n // r)
  # Spread the rows evenly so that the last panel is not mostly padding.
  r = round_up(-(-n // n_panels), bq)
  return PanelLayout(r, n_panels, m_pad, round_up(d, bs.block_d))


def panel_backward(x, y, row_vec, g_panel, *, layout, precision, refs=()):
  """Sums (G y, G^T x, sum G * x y^T, sum G) over the panels of G.

  Args:
    x: (n, D), y: (m, D) unpadded inputs.
    row_vec: (layout.n_pad,) per-row input of the panel kernel, padded.
    g_panel: ``g_panel(x_p, yp, vec_p) -> (g, g_mult, dsc, dbi)``: the panel
      G (R, m_pad) in the input dtype, a float32 scalar it was divided by
      (multiplied back after the GEMMs), and the panel's float32 sums of
      G * (x y^T) and of G.
    layout: ``panel_layout(...)``.
    precision: matmul precision of the GEMMs.
    refs: further arrays the kernel reads (their varying axes type the
      carry inside ``shard_map``).

  Returns:
    float32 (dx (n, D), dy (m, D), dscale, dbias) before the caller's scale
    and coefficients.
  """
  n, d = x.shape
  m = y.shape[0]
  xp = pad2(x, layout.n_pad, layout.d_pad)
  yp = pad2(y, layout.m_pad, layout.d_pad)

  def panel(carry, inputs):
    dy, dsc, dbi = carry
    x_p, v_p = inputs
    g, g_mult, dsc_p, dbi_p = g_panel(x_p, yp, v_p)
    dx_p = dot(g, yp, ((1,), (0,)), precision) * g_mult
    dy = dy + dot(g, x_p, ((0,), (0,)), precision) * g_mult
    return (dy, dsc + dsc_p, dbi + dbi_p), dx_p

  init = (jnp.zeros((layout.m_pad, layout.d_pad), F32), jnp.zeros((), F32),
          jnp.zeros((), F32))
  # Inside shard_map the carry must vary over the same mesh axes as what the
  # panels add to it.
  init = _axes.vary_like(init, xp, yp, row_vec, *refs)
  (dy, dsc, dbi), dx = lax.scan(
      panel, init, (xp.reshape(layout.n_panels, layout.rows, layout.d_pad),
                    row_vec.reshape(layout.n_panels, layout.rows)))
  dx = dx.reshape(layout.n_pad, layout.d_pad)[:n, :d]
  return dx, dy[:m, :d], dsc, dbi


def usable_max(g_max):
  """The divisor of a float16 panel: its max |G|, or 1 if that is 0 / NaN.

  |G| <= 1, so dividing never overflows. An all-zero (or all-padding) panel
  keeps 1; a NaN panel keeps 1 too, and its NaN G still reaches the result.
  """
  return jnp.where((g_max > 0) & jnp.isfinite(g_max), g_max, 1.0).astype(F32)


def softmax_grad(x, y, scale, bias, row_lse, col_lse, row_coef, col_coef, *,
                 layout, precision, panel=None):
  """``lse_grad`` of a kernel backend: (dx, dy, dscale, dbias), float32.

  Probabilities are in [0, 1] and the coefficients (~1/B) are applied after
  the GEMMs, so that a 16-bit G does not underflow: G is stored as
  a_r P^r + a_c P^c with the larger |coefficient| normalised to 1.
  ``panel(x_p, yp, r_p, c2, params, rows=, cols=, mask=)`` writes one panel
  of G in x's dtype and returns it with its sums of G * x y^T and of G;
  params = [scale log2 e, bias log2 e, a_r, a_c], r_p / c2 the base-2
  statistics (+inf on padding). ``panel=None`` forms the panel in XLA.
  """
  n, d = x.shape
  m = y.shape[0]
  rows, cols = row_lse is not None, col_lse is not None
  scale = jnp.asarray(scale, F32)
  bias = jnp.asarray(bias, F32)
  row_coef = jnp.asarray(row_coef if rows else 0.0, F32)
  col_coef = jnp.asarray(col_coef if cols else 0.0, F32)
  norm = jnp.maximum(jnp.abs(row_coef), jnp.abs(col_coef))
  norm = jnp.where(norm == 0, 1.0, norm)
  # Base-2 statistics, +inf on padding; an unused direction gets zeros
  # (its exp term is compiled out) but keeps +inf on padding for masking.
  r2 = (row_lse.astype(F32) * _math.LOG2E) if rows else jnp.zeros((n,), F32)
  c2 = (col_lse.astype(F32) * _math.LOG2E) if cols else jnp.zeros((m,), F32)
  r2 = pad1(r2, layout.n_pad, jnp.inf)
  c2 = pad1(c2, layout.m_pad, jnp.inf)
  params = jnp.stack([scale * _math.LOG2E, bias * _math.LOG2E,
                      row_coef / norm, col_coef / norm]).astype(F32)
  mask = layout.n_pad != n or layout.m_pad != m
  panel = panel or functools.partial(_xla_softmax_panel, precision=precision)

  def g_panel(x_p, yp, r_p):
    g, dsc, dbi = panel(x_p, yp, r_p, c2, params, rows=rows, cols=cols,
                        mask=mask)
    return g, jnp.ones((), F32), dsc, dbi

  dx, dy, dsc, dbi = panel_backward(x, y, r2, g_panel, layout=layout,
                                    precision=precision, refs=(c2, params))
  return dx * (scale * norm), dy * (scale * norm), dsc * norm, dbi * norm


def sigmoid_grad(x, y, scale, bias, coef, *, has_diagonal, layout, precision,
                 panel=None):
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
  """
  n, d = x.shape
  m = y.shape[0]
  scale = jnp.asarray(scale, F32)
  bias = jnp.asarray(bias, F32)
  coef = jnp.asarray(coef, F32)
  rescale = jnp.dtype(x.dtype) == jnp.float16
  ids = jnp.arange(layout.n_pad, dtype=jnp.int32)
  row_ids = jnp.where(ids < n, ids, -1)
  kw = dict(m=m, mask=layout.n_pad != n or layout.m_pad != m, scaled=rescale,
            has_diagonal=has_diagonal)
  panel = panel or functools.partial(_xla_sigmoid_panel, precision=precision)

  def g_panel(x_p, yp, rid_p):
    g_max = jnp.ones((), F32)
    if rescale:
      unit = jnp.stack([scale, bias, 1.0, 0.0]).astype(F32)
      g_max = usable_max(panel(x_p, yp, rid_p, unit, "max", **kw))
    params = jnp.stack([scale, bias, 1.0 / g_max, 0.0]).astype(F32)
    g, dsc, dbi = panel(x_p, yp, rid_p, params, "g", **kw)
    return g, g_max, dsc, dbi

  dx, dy, dsc, dbi = panel_backward(x, y, row_ids, g_panel, layout=layout,
                                    precision=precision, refs=(scale, bias))
  return dx * (scale * coef), dy * (scale * coef), dsc * coef, dbi * coef


# ``bwd_impl="xla"``: the same panels from XLA's GEMM and a fusion. They
# materialise the (R, B) float32 logits of a panel (more memory and HBM
# traffic than the kernels) and are kept to measure the difference.

def _xla_softmax_panel(x_p, yp, r2, c2, params, *, rows, cols, mask,
                       precision):
  s0 = dot(x_p, yp, ((1,), (1,)), precision)
  s = s0 * params[0] + params[1]
  g = jnp.zeros_like(s)
  if rows:
    g = g + params[2] * jnp.exp2(s - r2[:, None])
  if cols:
    g = g + params[3] * jnp.exp2(s - c2[None, :])
  if mask:
    g = jnp.where((r2 != jnp.inf)[:, None] & (c2 != jnp.inf)[None, :], g, 0.0)
  return g.astype(x_p.dtype), jnp.sum(g * s0), jnp.sum(g)


def _xla_sigmoid_panel(x_p, yp, rid, params, mode, *, m, mask, scaled,
                       precision, has_diagonal):
  s0 = dot(x_p, yp, ((1,), (1,)), precision)
  s = s0 * params[0] + params[1]
  cid = jnp.arange(yp.shape[0], dtype=jnp.int32)
  g = 1.0 / (1.0 + jnp.exp(-s))
  if has_diagonal:
    g = jnp.where(rid[:, None] == cid[None, :], -1.0 / (1.0 + jnp.exp(s)), g)
  if mask:
    g = jnp.where((rid >= 0)[:, None] & (cid < m)[None, :], g, 0.0)
  if mode == "max":
    return jnp.max(jnp.abs(g))
  gs = g * params[2] if scaled else g
  return gs.astype(x_p.dtype), jnp.sum(g * s0), jnp.sum(g)


class KernelBackend(base.TileBackend):
  """A kernel backend: interpret mode off the GPU, defaults by the GPU.

  Off the GPU the kernels run through the Pallas interpreter: exact, but
  several times slower than ``backend="xla"``; the first kernel call in a
  process warns about it (``capability.InfclPerformanceWarning``). On the
  GPU the default ``BlockSizes`` follow the device's compute capability
  (``default_block_sizes``), so that they fit its shared memory.
  """

  name = "kernel"
  F32_DEFAULT = "tf32"  # Speed, as XLA's own GEMMs (backends.precision).

  def __init__(self, platform: str | None = None):
    super().__init__(platform)
    # Anything but a GPU runs the same kernels through the interpreter.
    self.interpret = self.platform != "gpu"

  def warn_if_interpreted(self):
    """Warns once per process when this backend's kernels are interpreted.

    Called on every kernel op (through ``block_sizes``), not on
    construction, so that probing a backend (``registry.available``) is
    silent.
    """
    if self.interpret:
      capability.warn_once(
          "interpret",
          f"infcl_jax: backend={self.name!r} runs its Pallas kernels in "
          f"interpret mode on platform {self.platform!r} (they are GPU "
          f"kernels): exact, but several times slower than backend='xla'. "
          f"Use backend='auto' or 'xla' off the GPU.", stacklevel=5)

  def default_block_sizes(self, platform, dtype):
    cc = capability.device_capability() if platform == "gpu" else None
    return BlockSizes.get_default("pallas", platform, dtype, capability=cc)

  def block_sizes(self, block_sizes, dtype):
    self.warn_if_interpreted()
    bs = super().block_sizes(block_sizes, dtype)
    bs.check_pallas()
    return bs
