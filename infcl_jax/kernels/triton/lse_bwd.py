"""Softmax backward panel in the Triton language: G = a_r P^r + a_c P^c.

The kernel of the panel backward (``backends/panel_backward.py``), as the
Pallas-Triton ``kernels/pallas/lse_bwd.py`` (whose docstring gives the
design): program (i, j) recomputes the (BQ, BK) logit tile of a panel of R
rows once, forms G_ij = a_r 2^(s_ij - r_i) + a_c 2^(s_ij - c_j), writes it
in the input dtype, and writes the tile's sums of G * (x y^T) and of G (the
scale and bias gradients). The library GEMMs then form dx and dy.

One exponential per logit with both statistics:
G = 2^(s - K) (a_r 2^(K - r_i) + a_c 2^(K - c_j)) with K the tile's largest
statistic, exact to float32 rounding while the tile's statistics span at
most 2^64 (checked per tile from r and c); otherwise the two-exponential
form. Padding: statistics of padded rows / columns are +inf, and a masked
tile zeroes both terms there (``!= inf`` keeps NaN statistics NaN).

Groups (``backends.base``): with ``GROUPS`` (a compile-time switch) the
kernel also reads the panel rows' and the columns' int32 group ids and
selects G = 0 on related pairs, after the exponentials (a row of related
pairs only has LSE -inf, whose exp(s - lse) is inf). Without it the ids
are never read (``common.group_ptrs``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from infcl_jax.kernels.triton import common
from infcl_jax.kernels.triton import launch
from infcl_jax.kernels.triton.common import MAX_SPREAD
from infcl_jax.kernels.triton.common import group_ptrs

F32 = jnp.float32


@triton.jit
def _exact(s, r, c, a_r, a_c, BQ: tl.constexpr, BK: tl.constexpr,
           ROWS: tl.constexpr, COLS: tl.constexpr, MASK: tl.constexpr):
  g = tl.zeros((BQ, BK), dtype=tl.float32)
  if ROWS:
    g += a_r * tl.exp2(s - r[:, None])
  if COLS:
    g += a_c * tl.exp2(s - c[None, :])
  if MASK:
    keep = (r != float("inf"))[:, None] & (c != float("inf"))[None, :]
    g = tl.where(keep, g, 0.0)
  return g


@triton.jit
def _kernel(params_ptr, x_ptr, y_ptr, r_ptr, c_ptr, gx_ptr, gy_ptr, g_ptr,
            dsc_ptr, dbi_ptr, M_PAD: tl.constexpr, D_PAD: tl.constexpr,
            BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
            ROWS: tl.constexpr, COLS: tl.constexpr, MASK: tl.constexpr,
            SINGLE_EXP: tl.constexpr, PREC: tl.constexpr, GROUPS: tl.constexpr):
  i = tl.program_id(0)
  j = tl.program_id(1)
  a_r = tl.load(params_ptr + 2)
  a_c = tl.load(params_ptr + 3)
  s, s0 = common.logit_tile(params_ptr, x_ptr, y_ptr, i * BQ, j * BK, D_PAD,
                            BQ, BK, BD, PREC)
  rows = i * BQ + tl.arange(0, BQ)
  cols = j * BK + tl.arange(0, BK)
  r = tl.load(r_ptr + rows)  # base-2 row LSE, +inf on padding
  c = tl.load(c_ptr + cols)  # base-2 column LSE, +inf on padding
  if ROWS and COLS and SINGLE_EXP:
    hi = tl.maximum(tl.max(r), tl.max(c))
    lo = tl.minimum(tl.min(r), tl.min(c))
    if hi - lo <= MAX_SPREAD:
      u = a_r * tl.exp2(hi - r)
      v = a_c * tl.exp2(hi - c)
      g = tl.exp2(s - hi) * (u[:, None] + v[None, :])
    else:
      g = _exact(s, r, c, a_r, a_c, BQ, BK, ROWS, COLS, MASK)
  else:
    g = _exact(s, r, c, a_r, a_c, BQ, BK, ROWS, COLS, MASK)
  if GROUPS:
    gx = tl.load(gx_ptr + rows)
    gy = tl.load(gy_ptr + cols)
    g = tl.where(gx[:, None] == gy[None, :], 0.0, g)
  offs = rows.to(tl.int64)[:, None] * M_PAD + cols[None, :]
  tl.store(g_ptr + offs, g.to(g_ptr.dtype.element_ty))
  common.store_tile_sums(dsc_ptr, dbi_ptr, g, s0, i, j, M_PAD, BK)


def g_panel(x, y, r2, c2, params, *, rows, cols, mask, g_dtype, block_q,
            block_k, block_d, num_warps, num_stages, precision,
            single_exp=True, groups=None):
  """The (R, m_pad) probability panel and the sums of G * (x y^T) and of G:
  the contract of the Pallas-Triton ``lse_bwd.g_panel`` (less
  ``interpret``), ``groups`` included."""
  r_rows, d_pad = x.shape
  m_pad = y.shape[0]
  ni, nj = r_rows // block_q, m_pad // block_k
  g, dsc, dbi = launch.call(
      _kernel, params, x, y, r2, c2, *group_ptrs(groups, x),
      out_shape=[jax.ShapeDtypeStruct((r_rows, m_pad), g_dtype),
                 jax.ShapeDtypeStruct((ni * nj,), F32),
                 jax.ShapeDtypeStruct((ni * nj,), F32)],
      # Axis 0 (row blocks) varies fastest: consecutive programs share one
      # y tile, and the whole x panel stays in L2.
      grid=(ni, nj), num_warps=num_warps, num_stages=num_stages,
      name="infcl_triton_lse_bwd_panel", M_PAD=m_pad, D_PAD=d_pad,
      BQ=block_q, BK=block_k, BD=block_d, ROWS=rows, COLS=cols, MASK=mask,
      SINGLE_EXP=single_exp, PREC=common.dot_precision(precision),
      GROUPS=groups is not None)
  return g, jnp.sum(dsc), jnp.sum(dbi)
