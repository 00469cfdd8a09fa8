"""Softmax forward in the Triton language: row and column LSE in one sweep.

The same schedule as the Pallas-Triton kernel
(``kernels/pallas/lse_fwd.py``), whose docstring explains it: a persistent
grid of P programs, program p owning row blocks p, p + P, ...; for each it
walks every column block, accumulates the (BQ, BK) logit tile over D
(``common.tile_dot``), keeps the row statistics in registers and merges the
tile's column statistics into its own row of a (P, B_y) workspace, which the
wrapper merges in XLA. No logit leaves the chip; the workspace is linear in
B.

One exponential per logit where the tile allows it (every row's and
column's sum under the tile's own max stays >= 2^-64), otherwise the tile
is recomputed and takes the exact two-exponential update. Base 2
throughout (log2 e folded into scale and bias).

Groups (``backends.base``): with ``GROUPS`` (a compile-time switch) the
kernel also reads the rows' and columns' int32 group ids and sets related
pairs' logits to -inf (one compare and one select per logit); without it
the ids are never read (``common.group_ptrs``), so the kernel without
groups is the same program as it would be on its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from infcl_jax._math import LOG2E
from infcl_jax._math import lse2_of_partials
from infcl_jax.kernels.triton import common
from infcl_jax.kernels.triton import launch
from infcl_jax.kernels.triton.common import LN2
from infcl_jax.kernels.triton.common import MIN_SUM
from infcl_jax.kernels.triton.common import group_ptrs

F32 = jnp.float32


@triton.jit
def _logits(params_ptr, x_ptr, y_ptr, gx, gy_ptr, rb, j, N: tl.constexpr,
            M: tl.constexpr, D_PAD: tl.constexpr, BQ: tl.constexpr,
            BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
            GROUPS: tl.constexpr):
  """The (BQ, BK) base-2 logit tile of row block rb, column block j; -inf
  on padding and (``GROUPS``: ``gx`` the row block's group ids) on related
  pairs."""
  s, _ = common.logit_tile(params_ptr, x_ptr, y_ptr, rb * BQ, j * BK, D_PAD,
                           BQ, BK, BD, PREC)
  if GROUPS:
    gy = tl.load(gy_ptr + j * BK + tl.arange(0, BK))
    s = tl.where(gx[:, None] == gy[None, :], -float("inf"), s)
  if N % BQ != 0 or M % BK != 0:
    rows = rb * BQ + tl.arange(0, BQ)
    cols = j * BK + tl.arange(0, BK)
    valid = (rows < N)[:, None] & (cols < M)[None, :]
    s = tl.where(valid, s, -float("inf"))
  return s


@triton.jit
def _exact_update(s, m_i, l_i, cm_ptr, cl_ptr, ws, j, BK: tl.constexpr,
                  ROWS: tl.constexpr, COLS: tl.constexpr,
                  BARRIER: tl.constexpr):
  """Per-row and per-column shifts: two exponentials per logit."""
  if ROWS:
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    sh = common.safe_max(m_new)
    l_i = l_i * tl.exp2(m_i - sh) + tl.sum(tl.exp2(s - sh[:, None]), axis=1)
    m_i = m_new
  if COLS:
    offs = ws + j * BK + tl.arange(0, BK)
    old_m = tl.load(cm_ptr + offs)
    old_l = tl.load(cl_ptr + offs)
    new_m = tl.maximum(old_m, tl.max(s, axis=0))
    shc = common.safe_max(new_m)
    lc = tl.sum(tl.exp2(s - shc[None, :]), axis=0)
    tl.store(cl_ptr + offs, old_l * tl.exp2(old_m - shc) + lc)
    tl.store(cm_ptr + offs, new_m)
    if BARRIER:
      # The next row block re-reads this slice, possibly from other threads
      # of the program: make the stores visible to them.
      tl.debug_barrier()
  return m_i, l_i


@triton.jit
def _shared_update(big, lr, lc, m_i, l_i, cm_ptr, cl_ptr, ws, j,
                   BK: tl.constexpr, BARRIER: tl.constexpr):
  """Merges tile sums taken with one shift ``big`` for the whole tile."""
  m_new = tl.maximum(m_i, big)
  sh = common.safe_max(m_new)
  l_i = l_i * tl.exp2(m_i - sh) + lr * tl.exp2(big - sh)
  offs = ws + j * BK + tl.arange(0, BK)
  old_m = tl.load(cm_ptr + offs)
  old_l = tl.load(cl_ptr + offs)
  new_m = tl.maximum(old_m, big)
  shc = common.safe_max(new_m)
  tl.store(cl_ptr + offs, old_l * tl.exp2(old_m - shc) + lc * tl.exp2(big - shc))
  tl.store(cm_ptr + offs, new_m)
  if BARRIER:
    tl.debug_barrier()
  return m_new, l_i


@triton.jit
def _kernel(params_ptr, x_ptr, y_ptr, gx_ptr, gy_ptr, row_ptr, cm_ptr, cl_ptr,
            N: tl.constexpr, M: tl.constexpr, N_PAD: tl.constexpr,
            M_PAD: tl.constexpr, D_PAD: tl.constexpr, BQ: tl.constexpr,
            BK: tl.constexpr, BD: tl.constexpr, NPROG: tl.constexpr,
            ROWS: tl.constexpr, COLS: tl.constexpr, SINGLE_EXP: tl.constexpr,
            BARRIER: tl.constexpr, PREC: tl.constexpr, GROUPS: tl.constexpr):
  pid = tl.program_id(0)
  NRB: tl.constexpr = N_PAD // BQ
  NKB: tl.constexpr = M_PAD // BK
  ws = pid * M_PAD  # this program's row of the column workspace
  if COLS:
    for j in range(0, NKB):
      offs = ws + j * BK + tl.arange(0, BK)
      tl.store(cm_ptr + offs, tl.full((BK,), -float("inf"), tl.float32))
      tl.store(cl_ptr + offs, tl.zeros((BK,), tl.float32))
    if BARRIER:
      tl.debug_barrier()
  for rb in range(pid, NRB, NPROG):
    m_i = tl.full((BQ,), -float("inf"), tl.float32)
    l_i = tl.zeros((BQ,), tl.float32)
    if GROUPS:
      gx = tl.load(gx_ptr + rb * BQ + tl.arange(0, BQ))
    else:
      gx = 0
    for j in range(0, NKB):
      s = _logits(params_ptr, x_ptr, y_ptr, gx, gy_ptr, rb, j, N, M,
                  D_PAD, BQ, BK, BD, PREC, GROUPS)
      if SINGLE_EXP and ROWS and COLS:
        big = tl.max(s)
        p = tl.exp2(s - common.safe_max(big))
        lr = tl.sum(p, axis=1)
        lc = tl.sum(p, axis=0)
        ok = (tl.min(lr) >= MIN_SUM) & (tl.min(lc) >= MIN_SUM)
        if ok:
          m_i, l_i = _shared_update(big, lr, lc, m_i, l_i, cm_ptr, cl_ptr,
                                    ws, j, BK, BARRIER)
        else:
          # Recomputed rather than kept: holding s across the shared form
          # would double the tile's registers.
          s2 = _logits(params_ptr, x_ptr, y_ptr, gx, gy_ptr, rb, j, N, M,
                       D_PAD, BQ, BK, BD, PREC, GROUPS)
          m_i, l_i = _exact_update(s2, m_i, l_i, cm_ptr, cl_ptr, ws, j, BK,
                                   ROWS, COLS, BARRIER)
      else:
        m_i, l_i = _exact_update(s, m_i, l_i, cm_ptr, cl_ptr, ws, j, BK,
                                 ROWS, COLS, BARRIER)
    if ROWS:
      tl.store(row_ptr + rb * BQ + tl.arange(0, BQ),
               (m_i + tl.log2(l_i)) * LN2)


def lse_fwd(x, y, scale, bias, *, n, m, rows, cols, block_q, block_k,
            block_d, num_programs, num_warps, num_stages, precision,
            single_exp=True, groups=None):
  """Row / column LSE of the logits of padded x (n_pad, Dp), y (m_pad, Dp).

  The arguments are those of the Pallas-Triton ``lse_fwd`` (less
  ``interpret``: ``launch`` decides), ``groups`` included. Returns (row_lse (n,) or None,
  col_lse (m,) or None), float32, natural log.
  """
  n_pad, d_pad = x.shape
  m_pad = y.shape[0]
  nprog = max(1, min(num_programs, n_pad // block_q))
  params = jnp.stack([scale * LOG2E, bias * LOG2E]).astype(F32)
  ws = nprog * m_pad if cols else 1
  out_shape = [jax.ShapeDtypeStruct((n_pad if rows else 1,), F32),
               jax.ShapeDtypeStruct((ws,), F32),
               jax.ShapeDtypeStruct((ws,), F32)]
  row, cm, cl = launch.call(
      _kernel, params, x, y, *group_ptrs(groups, x), out_shape=out_shape,
      grid=(nprog,), num_warps=num_warps, num_stages=num_stages,
      name="infcl_triton_lse_fwd",
      N=n, M=m, N_PAD=n_pad, M_PAD=m_pad, D_PAD=d_pad, BQ=block_q,
      BK=block_k, BD=block_d, NPROG=nprog, ROWS=rows, COLS=cols,
      SINGLE_EXP=single_exp, BARRIER=cols and not launch.interpreting(),
      PREC=common.dot_precision(precision), GROUPS=groups is not None)
  row_lse = row[:n] if rows else None
  col_lse = None
  if cols:
    col_lse = lse2_of_partials(cm.reshape(nprog, m_pad)[:, :m],
                               cl.reshape(nprog, m_pad)[:, :m])
  return row_lse, col_lse
