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

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
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


class KernelBackend:
  """Plumbing of a kernel backend: interpret mode off the GPU, defaults.

  Off the GPU the kernels run through the Pallas interpreter: exact, but
  several times slower than ``backend="xla"``; the first kernel call in a
  process warns about it (``capability.InfclPerformanceWarning``). On the
  GPU the default ``BlockSizes`` follow the device's compute capability
  (``BlockSizes.get_default(..., capability=)``), so that they fit its
  shared memory.
  """

  name = "kernel"
  block_sizes_key = "pallas"  # BlockSizes.get_default's backend name.

  def __init__(self, platform: str | None = None):
    self.platform = platform or jax.default_backend()
    # Anything but a GPU runs the same kernels through the interpreter.
    self.interpret = self.platform != "gpu"

  def warn_if_interpreted(self):
    """Warns once per process when this backend's kernels are interpreted.

    Called on every kernel op (through ``_block_sizes``), not on
    construction, so that probing a backend (``registry.available``) is
    silent.
    """
    if self.interpret:
      capability.warn_once(
          "interpret",
          f"infcl_jax: backend={self.name!r} runs its Pallas kernels in "
          f"interpret mode on platform {self.platform!r} (they are GPU "
          f"kernels): exact, but several times slower than backend='xla'. "
          f"Use backend='auto' or 'xla' off the GPU.", stacklevel=4)

  def default_block_sizes(self, platform, dtype):
    cc = capability.device_capability() if platform == "gpu" else None
    return BlockSizes.get_default(self.block_sizes_key, platform, dtype,
                                  capability=cc)

  def _block_sizes(self, block_sizes, dtype):
    self.warn_if_interpreted()
    bs = block_sizes
    if bs is None:
      bs = self.default_block_sizes(self.platform, dtype)
    bs.check_pallas()
    return bs

  def _precision(self, bs, dtype):
    if (jnp.dtype(dtype) == jnp.float32
        and bs.resolved_f32_precision() == "highest"):
      return lax.Precision.HIGHEST
    # DEFAULT: bf16 / f16 tensor cores; TF32 for float32 on the GPU.
    return lax.Precision.DEFAULT
