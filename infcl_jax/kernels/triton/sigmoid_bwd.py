"""Sigmoid backward panel in the Triton language: G = (-z) sigmoid(-z s).

As the Pallas-Triton ``kernels/pallas/sigmoid_bwd.py`` (its docstring gives
the design): program (i, j) recomputes the (BQ, BK) logit tile of a panel
of R rows once and writes ``G * g_scale`` in the input dtype with the tile's
float32 sums of G * (x y^T) and of G; ``_max_kernel`` runs the same
recompute and writes only the tile's largest |G| (the float16 pre-pass of
``panel_backward.sigmoid_grad``). Positives and padding come from global
indices: ``rid`` holds each panel row's global index (-1 on padding),
columns are ``j * BK + lane``, valid below M.

Groups (``backends.base``): with ``GROUPS`` (a compile-time switch) both
kernels also read the panel rows' and the columns' int32 group ids;
related pairs get G = 0 ("mask": the diagonal stays a positive) or the
label z = +1 (``POSITIVES``). Without it the ids are never read
(``common.group_ptrs``). Both kernels share one tile (``_g_tile``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from infcl_jax.kernels.triton import common
from infcl_jax.kernels.triton import launch
from infcl_jax.kernels.triton.common import group_ptrs

F32 = jnp.float32
MODES = ("g", "max")


@triton.jit
def _positive_g(pos, s, u):
  """G with the label z = +1 where ``pos``: -sigmoid(-s) there, sigmoid(u)
  elsewhere (u: the logit, -inf on dropped pairs)."""
  sg = common.sigmoid(tl.where(pos, -s, u))
  return tl.where(pos, -sg, sg)


@triton.jit
def _g_tile(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, i, j,
            M: tl.constexpr, D_PAD: tl.constexpr, BQ: tl.constexpr,
            BK: tl.constexpr, BD: tl.constexpr, MASK: tl.constexpr,
            HAS_DIAG: tl.constexpr, PREC: tl.constexpr,
            GROUPS: tl.constexpr, POSITIVES: tl.constexpr):
  """(G, s0): the tile's float32 gradient and its raw dot products."""
  s, s0 = common.logit_tile(params_ptr, x_ptr, y_ptr, i * BQ, j * BK, D_PAD,
                            BQ, BK, BD, PREC)
  rid = tl.load(rid_ptr + i * BQ + tl.arange(0, BQ))
  cid = j * BK + tl.arange(0, BK)
  u = s
  if GROUPS:
    gx = tl.load(gx_ptr + i * BQ + tl.arange(0, BQ))
    rel = gx[:, None] == tl.load(gy_ptr + cid)[None, :]
    if not POSITIVES:
      # sigmoid(-inf) = 0 is a dropped pair's G; the diagonal's select
      # overrides it (as the forward).
      u = tl.where(rel, -float("inf"), s)
  # POSITIVES implies GROUPS (``g_panel``).
  if HAS_DIAG:
    pos = rid[:, None] == cid[None, :]
    if POSITIVES:
      pos = pos | rel
    g = _positive_g(pos, s, u)
  elif POSITIVES:
    g = _positive_g(rel, s, u)
  else:
    g = common.sigmoid(u)
  if MASK:
    g = tl.where((rid >= 0)[:, None] & (cid < M)[None, :], g, 0.0)
  return g, s0


@triton.jit
def _kernel(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, g_ptr, dsc_ptr,
            dbi_ptr, M: tl.constexpr, M_PAD: tl.constexpr, D_PAD: tl.constexpr,
            BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
            MASK: tl.constexpr, HAS_DIAG: tl.constexpr, SCALED: tl.constexpr,
            PREC: tl.constexpr, GROUPS: tl.constexpr, POSITIVES: tl.constexpr):
  i = tl.program_id(0)
  j = tl.program_id(1)
  g, s0 = _g_tile(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, i, j, M,
                  D_PAD, BQ, BK, BD, MASK, HAS_DIAG, PREC, GROUPS, POSITIVES)
  # The scalar partials come from the unscaled float32 G.
  common.store_tile_sums(dsc_ptr, dbi_ptr, g, s0, i, j, M_PAD, BK)
  if SCALED:
    g = g * tl.load(params_ptr + 2)
  rows = (i * BQ + tl.arange(0, BQ)).to(tl.int64)
  cols = j * BK + tl.arange(0, BK)
  tl.store(g_ptr + rows[:, None] * M_PAD + cols[None, :],
           g.to(g_ptr.dtype.element_ty))


@triton.jit
def _max_kernel(params_ptr, x_ptr, y_ptr, rid_ptr, gx_ptr, gy_ptr, max_ptr,
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
      MASK=mask, HAS_DIAG=has_diagonal, PREC=common.dot_precision(precision),
      GROUPS=groups is not None,
      POSITIVES=groups is not None and group_mode == "positives")
  ins = (params, x, y, row_ids, *group_ptrs(groups, x))
  if mode == "max":
    (mx,) = launch.call(_max_kernel, *ins, out_shape=[scalar],
                        name="infcl_triton_sigmoid_bwd_max", **common_kw)
    return jnp.max(mx)
  g, dsc, dbi = launch.call(
      _kernel, *ins,
      out_shape=[jax.ShapeDtypeStruct((r_rows, m_pad), g_dtype), scalar,
                 scalar],
      name="infcl_triton_sigmoid_bwd_g", SCALED=scaled, **common_kw)
  return g, jnp.sum(dsc), jnp.sum(dbi)
