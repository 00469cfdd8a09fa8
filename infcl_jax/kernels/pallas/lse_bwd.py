"""Backward probability-panel kernel: G = a_r * P^r + a_c * P^c for R rows.

The backward of the softmax family is a hybrid: this kernel recomputes each
(bwd_block_q, bwd_block_k) logit tile of a panel of R rows once (matmul over
D in ``block_d`` steps, like the forward), forms

    G_ij = a_r * exp(s_ij - r_i) + a_c * exp(s_ij - c_j)

and writes it to HBM in the input dtype (the (R, B) panel is the only
O(R * B) buffer), together with each tile's partial sums of G * (x y^T) and
G, the scale and bias gradients. The library GEMMs then form dx = G y and
dy += G^T x (see ``infcl_jax.backends.pallas``).

Why not a fully fused dX / dY kernel: accumulating dX over D = 768 in one
Triton program needs three 256-wide float32 accumulators and spilled on the
H200 (82-180 ms for dX alone); splitting D across programs recomputes s
three times. Writing G once in bf16 costs ~2 bytes per logit of HBM traffic
and lets cuBLAS run the two big products near its peak.

One exponential per logit: with both statistics, G factors as
2^(s - K) * (a_r 2^(K - r_i) + a_c 2^(K - c_j)) for a per-tile K, which is
exact to float32 rounding whenever the tile's statistics span at most 2^64;
the kernel checks that per tile (from the r and c vectors alone) and uses
the two-exponential form otherwise.

Padding: the row / column statistics of padded rows / columns arrive as
+inf, which makes exp(s - lse) vanish there; a masked tile also zeroes the
other term's contribution.

Groups (``backends.base``): with the panel rows' and the columns' int32
group ids (blocked like the statistics), G is 0 on related pairs, selected
after the exponentials, so that a row or column of related pairs only (LSE
-inf, whose exp(s - lse) is inf) gives 0, never NaN.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from infcl_jax.kernels.pallas import interpret_vma
from infcl_jax.kernels.pallas import panel_call
from infcl_jax.kernels.pallas import tile_dot

F32 = jnp.float32
_MAX_SPREAD = 64.0


def _kernel(*refs, interpret, **kw):
  interpret_vma.run_body(functools.partial(_body, **kw), refs, num_ids=2,
                         interpret=interpret)


def _body(i, j, params_ref, x_ref, y_ref, *refs, bq, bk, bd, nd, rows, cols,
          mask, precision, single_exp, groups):
  if groups:
    r_ref, gx_ref, c_ref, gy_ref, g_ref, dsc_ref, dbi_ref = refs
  else:
    r_ref, c_ref, g_ref, dsc_ref, dbi_ref = refs
  scale2 = params_ref[0]  # scale * log2(e)
  bias2 = params_ref[1]   # bias * log2(e)
  a_r = params_ref[2]
  a_c = params_ref[3]

  s0 = tile_dot.tile_dot(x_ref, y_ref, i * bq, j * bk, bq=bq, bk=bk,
                         bd=bd, nd=nd, precision=precision)
  s = s0 * scale2 + bias2
  r = r_ref[...]  # (bq,) base-2 row LSE, +inf on padding
  c = c_ref[...]  # (bk,) base-2 column LSE, +inf on padding

  def exact():
    g = jnp.zeros((bq, bk), F32)
    if rows:
      g = g + a_r * jnp.exp2(s - r[:, None])
    if cols:
      g = g + a_c * jnp.exp2(s - c[None, :])
    if mask:
      # `!= inf` rather than `< inf` keeps NaN statistics NaN.
      g = jnp.where((r != jnp.inf)[:, None] & (c != jnp.inf)[None, :], g, 0.0)
    return g

  if rows and cols and single_exp:
    # G = 2^(s - K) * (a_r 2^(K - r_i) + a_c 2^(K - c_j)): one exponential
    # per logit. With K the largest statistic of the tile, 2^(s - K) <= 1
    # (an LSE bounds every logit of its row / column) and the vector factors
    # are <= 2^spread, so nothing overflows; where 2^(s - K) underflows the
    # true term is below 2^(spread - 126), negligible for spread <= 64.
    # Padding (+inf), NaN or a wider spread take the exact form.
    hi = jnp.maximum(jnp.max(r, axis=0), jnp.max(c, axis=0))
    lo = jnp.minimum(jnp.min(r, axis=0), jnp.min(c, axis=0))

    def shared():
      u = a_r * jnp.exp2(hi - r)
      v = a_c * jnp.exp2(hi - c)
      return jnp.exp2(s - hi) * (u[:, None] + v[None, :])

    g = lax.cond(hi - lo <= _MAX_SPREAD, shared, exact)
  else:
    g = exact()
  if groups:
    g = jnp.where(gx_ref[...][:, None] == gy_ref[...][None, :], 0.0, g)
  g_ref[...] = g.astype(g_ref.dtype)
  # Triton reduces one axis at a time.
  dsc_ref[...] = jnp.sum(jnp.sum(g * s0, axis=1), axis=0)
  dbi_ref[...] = jnp.sum(jnp.sum(g, axis=1), axis=0)


def g_panel(x, y, r2, c2, params, *, rows, cols, mask, g_dtype, block_q,
            block_k, block_d, num_warps, num_stages, precision, interpret,
            single_exp=True, groups=None):
  """The (R, m_pad) probability panel and its per-tile scalar partials.

  Args:
    x: (R, Dp) panel of zero-padded image rows.
    y: (m_pad, Dp) zero-padded text rows.
    r2, c2: (R,), (m_pad,) base-2 row / column LSE, +inf on padding (or
      any finite placeholder for an unused direction, still +inf on padding).
    params: (4,) float32 [scale * log2 e, bias * log2 e, a_r, a_c].
    mask: whether any padding exists (static).
    single_exp: one exponential per logit where the tile's statistics span
      at most 2^64 (exact two-exponential form otherwise).
    groups: None, or int32 group ids (gx (R,), gy (m_pad,)) of the panel
      rows and the columns: G is 0 where gx[i] == gy[j].

  Returns:
    g (R, m_pad) of ``g_dtype``, and the sums of G * (x y^T) and of G
    (float32 scalars).
  """
  nd = x.shape[1] // block_d
  kernel = functools.partial(_kernel, bq=block_q, bk=block_k, bd=block_d,
                             nd=nd, rows=rows, cols=cols, mask=mask,
                             precision=precision, single_exp=single_exp,
                             groups=groups is not None, interpret=interpret)
  row_vecs, col_vecs = (r2,), (c2,)
  if groups is not None:
    row_vecs, col_vecs = (r2, groups[0]), (c2, groups[1])
  g, dsc, dbi = panel_call.panel_call(
      kernel, params, x, y, row_vecs=row_vecs, col_vecs=col_vecs,
      g_dtype=g_dtype,
      num_partials=2, block_q=block_q, block_k=block_k, num_warps=num_warps,
      num_stages=num_stages, interpret=interpret, name="infcl_lse_bwd_panel")
  return g, jnp.sum(dsc), jnp.sum(dbi)
