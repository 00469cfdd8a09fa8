"""Sigmoid forward in the Triton language: per-row sums of softplus(-z s).

As the Pallas-Triton ``kernels/pallas/sigmoid_fwd.py`` (its docstring gives
the design): a grid of (row blocks) x (column splits); program (i, c) walks
the column blocks of split c, accumulates each (BQ, BK) logit tile over D,
adds the tile's softplus row sums to a (BQ,) register accumulator and
writes it once. Programs share nothing. Each term is computed on its own
(``common.softplus``), so that a tiny loss keeps its relative accuracy.

Groups (``backends.base``): with ``GROUPS`` (a compile-time switch) the
kernel also reads the rows' and columns' int32 group ids; related pairs
are dropped ("mask": the diagonal stays a positive) or labelled z = +1
(``POSITIVES``). Without it the ids are never read (``common.group_ptrs``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from infcl_jax.kernels.grid import column_splits
from infcl_jax.kernels.triton import common
from infcl_jax.kernels.triton import launch
from infcl_jax.kernels.triton.common import group_ptrs

F32 = jnp.float32


@triton.jit
def _kernel(params_ptr, x_ptr, y_ptr, gx_ptr, gy_ptr, out_ptr, N: tl.constexpr,
            M: tl.constexpr, N_PAD: tl.constexpr, D_PAD: tl.constexpr,
            BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
            NKB: tl.constexpr, PER: tl.constexpr, HAS_DIAG: tl.constexpr,
            PREC: tl.constexpr, GROUPS: tl.constexpr, POSITIVES: tl.constexpr):
  i = tl.program_id(0)
  c = tl.program_id(1)
  rows = i * BQ + tl.arange(0, BQ)
  j0 = c * PER
  j1 = tl.minimum(j0 + PER, NKB)
  acc = tl.zeros((BQ,), dtype=tl.float32)
  if GROUPS:
    gx = tl.load(gx_ptr + rows)
  else:
    gx = 0
  for j in range(j0, j1):
    s, _ = common.logit_tile(params_ptr, x_ptr, y_ptr, i * BQ, j * BK, D_PAD,
                             BQ, BK, BD, PREC)
    cols = j * BK + tl.arange(0, BK)
    # -z * s: softplus(-s) on the positives, softplus(s) on the negatives.
    if GROUPS:
      rel = gx[:, None] == tl.load(gy_ptr + cols)[None, :]
      if POSITIVES:
        if HAS_DIAG:
          rel = rel | (rows[:, None] == cols[None, :])
        s = tl.where(rel, -s, s)
      else:
        # A dropped pair's argument is -inf (softplus(-inf) = 0); the
        # diagonal's select overrides it. No mask stays live across the
        # softplus.
        u = tl.where(rel, -float("inf"), s)
        if HAS_DIAG:
          u = tl.where(rows[:, None] == cols[None, :], -s, u)
        s = u
    elif HAS_DIAG:
      s = tl.where(rows[:, None] == cols[None, :], -s, s)
    sp = common.softplus(s)
    if N % BQ != 0 or M % BK != 0:
      # Padded rows / columns are zeros, whose logit is the bias: mask them.
      sp = tl.where((rows < N)[:, None] & (cols < M)[None, :], sp, 0.0)
    acc += tl.sum(sp, axis=1)
  tl.store(out_ptr + c * N_PAD + rows, acc)


def sigmoid_row_sums(x, y, scale, bias, *, n, m, has_diagonal, block_q,
                     block_k, block_d, target_programs, num_warps, num_stages,
                     precision, groups=None, group_mode="mask"):
  """(splits, n_pad) float32 partial row sums of softplus(-z s) for padded
  x (n_pad, Dp), y (m_pad, Dp); padded rows are 0. The contract of the
  Pallas-Triton ``sigmoid_row_sums`` (less ``interpret``), ``groups`` and
  ``group_mode`` included."""
  n_pad, d_pad = x.shape
  m_pad = y.shape[0]
  nrb, nkb = n_pad // block_q, m_pad // block_k
  splits, per = column_splits(nrb, nkb, target_programs)
  params = jnp.stack([scale, bias]).astype(F32)
  (out,) = launch.call(
      _kernel, params, x, y, *group_ptrs(groups, x),
      out_shape=[jax.ShapeDtypeStruct((splits * n_pad,), F32)],
      # Axis 0 (row blocks) varies fastest: concurrently running programs
      # walk the same column blocks of y, which then stay in L2.
      grid=(nrb, splits), num_warps=num_warps, num_stages=num_stages,
      name="infcl_triton_sigmoid_fwd", N=n, M=m, N_PAD=n_pad, D_PAD=d_pad,
      BQ=block_q, BK=block_k, BD=block_d, NKB=nkb, PER=per,
      HAS_DIAG=has_diagonal, PREC=common.dot_precision(precision),
      GROUPS=groups is not None,
      POSITIVES=groups is not None and group_mode == "positives")
  return out.reshape(splits, n_pad)
