"""Sigmoid backward panel in the Triton language: G = (-z) sigmoid(-z s).

As the Pallas-Triton ``kernels/sigmoid_bwd.py`` (its docstring gives the
design): program (i, j) recomputes the (BQ, BK) logit tile of a panel of R
rows once and writes ``G * g_scale`` in the input dtype with the tile's
float32 sums of G * (x y^T) and of G; ``_max_kernel`` runs the same
recompute and writes only the tile's largest |G| (the float16 pre-pass of
``panel_backward.sigmoid_grad``). Positives and padding come from global
indices: ``rid`` holds each panel row's global index (-1 on padding),
columns are ``j * BK + lane``, valid below M.

Groups (``backends.base``): the ``*_groups`` entry points also read the
panel rows' and the columns' int32 group ids; related pairs get G = 0
("mask": the diagonal stays a positive) or the label z = +1
(``POSITIVES``). The entry points share one tile (``_g_tile``, ``GROUPS``
a compile-time switch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from infcl_jax.kernels.triton import common
from infcl_jax.kernels.triton import launch

F32 = jnp.float32
MODES = ("g", "max")


@triton.jit
def _g_tile(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, i, j,
            M: tl.constexpr, D_PAD: tl.constexpr, BQ: tl.constexpr,
            BK: tl.constexpr, BD: tl.constexpr, MASK: tl.constexpr,
            HAS_DIAG: tl.constexpr, PREC: tl.constexpr,
            GROUPS: tl.constexpr, POSITIVES: tl.constexpr):
  """(G, s0): the tile's float32 gradient and its raw dot products."""
  scale = tl.load(params_ptr)
  bias = tl.load(params_ptr + 1)
  s0 = common.tile_dot(x_ptr, y_ptr, i * BQ, j * BK, D_PAD, BQ, BK, BD, PREC)
  s = s0 * scale + bias
  rid = tl.load(rid_ptr + i * BQ + tl.arange(0, BQ))
  cid = j * BK + tl.arange(0, BK)
  if GROUPS:
    gx = tl.load(gx_ptr + i * BQ + tl.arange(0, BQ))
    rel = gx[:, None] == tl.load(gy_ptr + cid)[None, :]
    if POSITIVES:
      pos = rel
      if HAS_DIAG:
        pos = pos | (rid[:, None] == cid[None, :])
      sg = common.sigmoid(tl.where(pos, -s, s))
      g = tl.where(pos, -sg, sg)
    else:
      # sigmoid(-inf) = 0 is a dropped pair's G; the diagonal's select
      # overrides it (as the forward).
      u = tl.where(rel, -float("inf"), s)
      if HAS_DIAG:
        pos = rid[:, None] == cid[None, :]
        sg = common.sigmoid(tl.where(pos, -s, u))
        g = tl.where(pos, -sg, sg)
      else:
        g = common.sigmoid(u)
  elif HAS_DIAG:
    pos = rid[:, None] == cid[None, :]
    sg = common.sigmoid(tl.where(pos, -s, s))
    g = tl.where(pos, -sg, sg)
  else:
    g = common.sigmoid(s)
  if MASK:
    g = tl.where((rid >= 0)[:, None] & (cid < M)[None, :], g, 0.0)
  return g, s0


@triton.jit
def _kernel(params_ptr, x_ptr, y_ptr, rid_ptr, g_ptr, dsc_ptr, dbi_ptr,
            M: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr,
            BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
            MASK: tl.constexpr, HAS_DIAG: tl.constexpr, SCALED: tl.constexpr,
            PREC: tl.constexpr):
  # No group ids: rid_ptr stands in for them, never read.
  _write_g(params_ptr, x_ptr, y_ptr, rid_ptr, rid_ptr, rid_ptr, g_ptr,
           dsc_ptr, dbi_ptr, M, M_PAD, D_PAD, BQ, BK, BD, MASK, HAS_DIAG,
           SCALED, PREC, False, False)


@triton.jit
def _kernel_groups(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, g_ptr,
                   dsc_ptr, dbi_ptr, M: tl.constexpr, M_PAD: tl.constexpr,
                   D_PAD: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                   BD: tl.constexpr, MASK: tl.constexpr,
                   HAS_DIAG: tl.constexpr, SCALED: tl.constexpr,
                   PREC: tl.constexpr, POSITIVES: tl.constexpr):
  _write_g(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, g_ptr, dsc_ptr,
           dbi_ptr, M, M_PAD, D_PAD, BQ, BK, BD, MASK, HAS_DIAG, SCALED, PREC,
           True, POSITIVES)


@triton.jit
def _write_g(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, g_ptr,
             dsc_ptr, dbi_ptr, M: tl.constexpr, M_PAD: tl.constexpr,
             D_PAD: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
             BD: tl.constexpr, MASK: tl.constexpr, HAS_DIAG: tl.constexpr,
             SCALED: tl.constexpr, PREC: tl.constexpr, GROUPS: tl.constexpr,
             POSITIVES: tl.constexpr):
  i = tl.program_id(0)
  j = tl.program_id(1)
  NJ: tl.constexpr = M_PAD // BK
  g, s0 = _g_tile(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, i, j, M,
                  D_PAD, BQ, BK, BD, MASK, HAS_DIAG, PREC, GROUPS, POSITIVES)
  # The scalar partials come from the unscaled float32 G.
  tl.store(dsc_ptr + i * NJ + j, tl.sum(g * s0))
  tl.store(dbi_ptr + i * NJ + j, tl.sum(g))
  if SCALED:
    g = g * tl.load(params_ptr + 2)
  rows = (i * BQ + tl.arange(0, BQ)).to(tl.int64)
  cols = j * BK + tl.arange(0, BK)
  tl.store(g_ptr + rows[:, None] * M_PAD + cols[None, :],
           g.to(g_ptr.dtype.element_ty))


@triton.jit
def _max_kernel(params_ptr, x_ptr, y_ptr, rid_ptr, max_ptr, M: tl.constexpr,
                M_PAD: tl.constexpr, D_PAD: tl.constexpr, BQ: tl.constexpr,
                BK: tl.constexpr, BD: tl.constexpr, MASK: tl.constexpr,
                HAS_DIAG: tl.constexpr, PREC: tl.constexpr):
  _write_max(params_ptr, x_ptr, y_ptr, rid_ptr, rid_ptr, rid_ptr, max_ptr, M,
             M_PAD, D_PAD, BQ, BK, BD, MASK, HAS_DIAG, PREC, False, False)


@triton.jit
def _max_kernel_groups(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr,
                       max_ptr, M: tl.constexpr, M_PAD: tl.constexpr,
                       D_PAD: tl.constexpr, BQ: tl.constexpr,
                       BK: tl.constexpr, BD: tl.constexpr, MASK: tl.constexpr,
                       HAS_DIAG: tl.constexpr, PREC: tl.constexpr,
                       POSITIVES: tl.constexpr):
  _write_max(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, max_ptr, M,
             M_PAD, D_PAD, BQ, BK, BD, MASK, HAS_DIAG, PREC, True, POSITIVES)


@triton.jit
def _write_max(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, max_ptr,
               M: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr,
               BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
               MASK: tl.constexpr, HAS_DIAG: tl.constexpr, PREC: tl.constexpr,
               GROUPS: tl.constexpr, POSITIVES: tl.constexpr):
  i = tl.program_id(0)
  j = tl.program_id(1)
  NJ: tl.constexpr = M_PAD // BK
  g, _ = _g_tile(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, i, j, M,
                 D_PAD, BQ, BK, BD, MASK, HAS_DIAG, PREC, GROUPS, POSITIVES)
  tl.store(max_ptr + i * NJ + j, tl.max(tl.abs(g)))


def g_panel(x, y, row_ids, params, *, m, mask, has_diagonal, mode, g_dtype,
            scaled, block_q, block_k, block_d, num_warps, num_stages,
            precision, groups=None, group_mode="mask"):
  """The gradient panel and its scalar partials (mode "g"), or its largest
  |G| (mode "max"): the contract of the Pallas-Triton ``sigmoid_bwd.g_panel``
  (less ``interpret``), ``groups`` and ``group_mode`` included."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  r_rows, d_pad = x.shape
  m_pad = y.shape[0]
  ni, nj = r_rows // block_q, m_pad // block_k
  scalar = jax.ShapeDtypeStruct((ni * nj,), F32)
  common_kw = dict(
      grid=(ni, nj), num_warps=num_warps, num_stages=num_stages, M=m,
      M_PAD=m_pad, D_PAD=d_pad, BQ=block_q, BK=block_k, BD=block_d,
      MASK=mask, HAS_DIAG=has_diagonal, PREC=common.dot_precision(precision))
  ins = (params, x, y, row_ids)
  g_kernel, max_kernel = _kernel, _max_kernel
  if groups is not None:
    ins += tuple(groups)
    g_kernel, max_kernel = _kernel_groups, _max_kernel_groups
    common_kw["POSITIVES"] = group_mode == "positives"
  if mode == "max":
    (mx,) = launch.call(max_kernel, *ins, out_shape=[scalar],
                        name="infcl_triton_sigmoid_bwd_max", **common_kw)
    return jnp.max(mx)
  g, dsc, dbi = launch.call(
      g_kernel, *ins,
      out_shape=[jax.ShapeDtypeStruct((r_rows, m_pad), g_dtype), scalar,
                 scalar],
      name="infcl_triton_sigmoid_bwd_g", SCALED=scaled, **common_kw)
  return g, jnp.sum(dsc), jnp.sum(dbi)
