"""Backward gradient-panel kernel of the sigmoid family, for R rows.

The backward is a hybrid, like the softmax one (``lse_bwd``): this kernel
recomputes each (bwd_block_q, bwd_block_k) logit tile of a panel of R rows
once (matmul over D in ``block_d`` steps), forms

    G_ij = (-z_ij) * sigmoid(-z_ij * s_ij)        (in [-1, 1])

and writes ``G * g_scale`` to HBM in the input dtype, together with each
tile's partial sums of G * (x y^T) and of G (the scale and bias gradients,
from the float32 G). The library GEMMs then form dx = G y and dy += G^T x
(``infcl_jax.backends.pallas``). The same design reasons apply as for
the softmax panel: a fully fused dX / dY kernel at D = 768 spills its
float32 accumulators, and writing G once lets cuBLAS run both products.

``mode="max"`` runs the same recompute but writes only each tile's largest
|G| (no panel): the float16 pre-pass that picks ``g_scale`` so that a panel
whose every |G| is tiny (a well-separated batch, tiny loss) does not flush
to zero in float16's 5-bit exponent.

Positives and padding are located by global indices: ``row_ids`` holds each
panel row's global row index (-1 on padding rows), and columns are
``j * block_k + lane``, valid below ``m``. Padding must be masked here (a
zero row's logit is the bias, whose sigmoid is not zero).

Groups (``backends.base``): with the panel rows' and the columns' int32
group ids (blocked like ``row_ids``), related pairs get G = 0 ("mask", the
diagonal stays a positive) or the label z = +1 ("positives").
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from infcl_jax.kernels.pallas import interpret_vma
from infcl_jax.kernels.pallas import panel_call
from infcl_jax.kernels.pallas import tile_dot

F32 = jnp.float32
MODES = ("g", "max")


def _kernel(*refs, interpret, **kw):
  interpret_vma.run_body(functools.partial(_body, **kw), refs, num_ids=2,
                         interpret=interpret)


def _body(i, j, params_ref, x_ref, y_ref, rid_ref, *out_refs, bq, bk, bd, nd,
          m, mask, has_diagonal, mode, scaled, precision, group_mode):
  if group_mode is not None:
    gx_ref, gy_ref, *out_refs = out_refs
  scale = params_ref[0]
  bias = params_ref[1]

  s0 = tile_dot.tile_dot(x_ref, y_ref, i * bq, j * bk, bq=bq, bk=bk,
                         bd=bd, nd=nd, precision=precision)
  s = s0 * scale + bias
  rid = rid_ref[...]  # (bq,) global row index, -1 on padding
  cid = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
  pos = (rid[:, None] == cid[None, :]) if has_diagonal else None
  u = s
  if group_mode is not None:
    rel = gx_ref[...][:, None] == gy_ref[...][None, :]
    if group_mode == "positives":
      pos = rel if pos is None else pos | rel
    else:
      # sigmoid(-inf) = 0 is a dropped pair's G; the diagonal's select
      # overrides it (as the forward).
      u = jnp.where(rel, -jnp.inf, s)
  # sigmoid(u) = 1 / (1 + e^-u): exact to rounding for any u (e^-u
  # overflows to inf for u << 0 and gives 0, never NaN).
  if pos is not None:
    sg = 1.0 / (1.0 + jnp.exp(-jnp.where(pos, -s, u)))
    g = jnp.where(pos, -sg, sg)
  else:
    g = 1.0 / (1.0 + jnp.exp(-u))
  if mask:
    g = jnp.where((rid >= 0)[:, None] & (cid < m)[None, :], g, 0.0)
  # Triton reduces one axis at a time.
  if mode == "max":
    (max_ref,) = out_refs
    max_ref[...] = jnp.max(jnp.max(jnp.abs(g), axis=1), axis=0)
    return
  g_ref, dsc_ref, dbi_ref = out_refs
  # The scalar partials come from the unscaled float32 G.
  dsc_ref[...] = jnp.sum(jnp.sum(g * s0, axis=1), axis=0)
  dbi_ref[...] = jnp.sum(jnp.sum(g, axis=1), axis=0)
  if scaled:
    g = g * params_ref[2]
  g_ref[...] = g.astype(g_ref.dtype)


def g_panel(x, y, row_ids, params, *, m, mask, has_diagonal, mode, g_dtype,
            scaled, block_q, block_k, block_d, num_warps, num_stages, precision,
            interpret, groups=None, group_mode="mask"):
  """The (R, m_pad) gradient panel and its scalar partials, or its max |G|.

  Args:
    x: (R, Dp) panel of zero-padded image rows.
    y: (m_pad, Dp) zero-padded text rows.
    row_ids: (R,) int32 global row index of each panel row, -1 on padding.
    params: (4,) float32 [scale, bias, g_scale, unused].
    m: valid rows of y (static).
    mask: whether any row or column padding exists (static).
    has_diagonal: whether the pairs (i, i) are the positives (static).
    mode: "g" for the panel, "max" for its largest |G| only.
    scaled: whether to multiply G by g_scale before the cast (static; only
      float16 panels need it).
    groups: None, or int32 group ids (gx (R,), gy (m_pad,)) of the panel
      rows and the columns; related pairs are treated by ``group_mode``
      ("mask" or "positives", ``backends.base``).

  Returns:
    mode "g": G * g_scale (R, m_pad) of ``g_dtype``, and the sums of
    G * (x y^T) and of G (float32 scalars, unscaled).
    mode "max": the largest |G| of the panel (float32 scalar).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  nd = x.shape[1] // block_d
  kernel = functools.partial(_kernel, bq=block_q, bk=block_k, bd=block_d,
                             nd=nd, m=m, mask=mask, has_diagonal=has_diagonal,
                             mode=mode, scaled=scaled, precision=precision,
                             group_mode=None if groups is None else group_mode,
                             interpret=interpret)
  row_vecs, col_vecs = (row_ids,), ()
  if groups is not None:
    row_vecs, col_vecs = (row_ids, groups[0]), (groups[1],)
  outs = panel_call.panel_call(
      kernel, params, x, y, row_vecs=row_vecs, col_vecs=col_vecs,
      g_dtype=None if mode == "max" else g_dtype,
      num_partials=1 if mode == "max" else 2, block_q=block_q,
      block_k=block_k, num_warps=num_warps, num_stages=num_stages,
      interpret=interpret, name=f"infcl_sigmoid_bwd_{mode}")
  if mode == "max":
    return jnp.max(outs[0])
  g, dsc, dbi = outs
  return g, jnp.sum(dsc), jnp.sum(dbi)
