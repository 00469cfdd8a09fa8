"""Fused forward kernel of the sigmoid family: per-row sums of softplus(-z s).

For logits s = t * x y^T + b and z_ij = +1 on the positives (the global
diagonal, when the block pair has one) and -1 elsewhere, this kernel returns

    out_i = sum_j softplus(-z_ij * s_ij)

for every row i, and no tile of logits ever leaves the chip. The wrapper sums
the rows in XLA.

Schedule. A grid of (row blocks) x (column splits). Program (i, c) owns row
block i and the contiguous run of column blocks of split c; it accumulates
each (block_q, block_k) logit tile over D in ``block_d`` steps (Triton
pipelines that inner loop), adds the tile's softplus row sums to a
(block_q,) float32 register accumulator, and writes it once. Unlike the
softmax forward there is no column statistic to merge, so programs share
nothing and need no barrier. Column splits exist only to fill the GPU when
there are few row blocks (a ring shard of a few thousand rows); the output
is ``splits`` x n_pad floats, linear in B.

Each term is computed on its own with the stable identity
softplus(u) = max(u, 0) + log1p(exp(-|u|)); never as softplus(s) - s, and
never as log(sigmoid(.)), so that a tiny loss keeps its relative accuracy.

Groups (``backends.base``): with the rows' and columns' int32 group ids, a
related pair is dropped ("mask": its term is 0, the diagonal stays a
positive) or labelled z = +1 ("positives"); one compare and one select per
logit.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from infcl_jax._axes import out_struct
from infcl_jax._math import softplus
from infcl_jax.kernels.pallas import interpret_vma
from infcl_jax.kernels.grid import column_splits
from infcl_jax.kernels.pallas import tile_dot

F32 = jnp.float32


def _kernel(*refs, interpret, **kw):
  interpret_vma.run_body(functools.partial(_body, **kw), refs, num_ids=2,
                         interpret=interpret)


def _body(i, c, params_ref, x_ref, y_ref, *refs, n, m, bq, bk, bd, nd,
          nkb, per, has_diagonal, precision, group_mode):
  if group_mode is None:
    (out_ref,) = refs
  else:
    gx_ref, gy_ref, out_ref = refs
  scale = params_ref[0]
  bias = params_ref[1]
  mask_rows = n % bq != 0
  mask_cols = m % bk != 0
  j0 = c * per
  # The last split may own fewer column blocks; a loop from 0 to a dynamic
  # count (like the softmax forward's) lowers to one scf.for.
  count = jnp.minimum(per, nkb - j0)
  # 1-D indices, broadcast where compared: a (bq, bk) int32 tile would
  # stay live across the loop and cost registers.
  row_ids = i * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
  gx = gx_ref[...] if group_mode is not None else None  # (bq,) row groups

  def col_step(t, acc):
    j = j0 + t
    s0 = tile_dot.tile_dot(x_ref, y_ref, i * bq, j * bk, bq=bq, bk=bk,
                           bd=bd, nd=nd, precision=precision)
    s = s0 * scale + bias
    col_ids = j * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0)
    # -z * s: softplus(-s) on the positives, softplus(s) on the negatives.
    pos = (row_ids[:, None] == col_ids[None, :]) if has_diagonal else None
    u = s
    if group_mode is not None:
      rel = gx[:, None] == gy_ref[pl.ds(j * bk, bk)][None, :]
      if group_mode == "positives":
        pos = rel if pos is None else pos | rel
      else:
        # A dropped pair's argument is -inf (softplus(-inf) = 0); the
        # diagonal's select below overrides it. No mask stays live across
        # the softplus.
        u = jnp.where(rel, -jnp.inf, s)
    if pos is not None:
      u = jnp.where(pos, -s, u)
    sp = softplus(u)
    if mask_rows or mask_cols:
      # Padded rows / columns are zeros, whose logit is the bias: mask them.
      valid = None
      if mask_rows:
        valid = (row_ids < n)[:, None]
      if mask_cols:
        cv = (col_ids < m)[None, :]
        valid = cv if valid is None else valid & cv
      sp = jnp.where(valid, sp, 0.0)
    return acc + jnp.sum(sp, axis=1)

  acc = lax.fori_loop(0, count, col_step, jnp.zeros((bq,), F32))
  out_ref[...] = acc


def sigmoid_row_sums(x, y, scale, bias, *, n, m, has_diagonal, block_q,
                     block_k, block_d, target_programs, num_warps, num_stages,
                     precision, interpret, groups=None, group_mode="mask"):
  """Per-row sums of softplus(-z s) for padded x (n_pad, Dp), y (m_pad, Dp).

  Args:
    x, y: zero-padded inputs: rows to multiples of block_q / block_k, D to a
      multiple of block_d. ``n`` and ``m`` are the valid row counts.
    scale, bias: float32 scalars.
    has_diagonal: whether the pairs (i, i) are the positives (static).
    target_programs: the column range is split so that the grid has about
      this many programs (at least one split, at most one per column block).
    groups: None, or the padded int32 group ids (gx (n_pad,), gy (m_pad,))
      of the rows and columns; related pairs (gx[i] == gy[j]) are treated
      by ``group_mode`` ("mask" or "positives", ``backends.base``).

  Returns:
    (splits, n_pad) float32 partial row sums; padded rows are 0.
  """
  n_pad, d_pad = x.shape
  m_pad = y.shape[0]
  nrb, nkb, nd = n_pad // block_q, m_pad // block_k, d_pad // block_d
  splits, per = column_splits(nrb, nkb, target_programs)
  params = jnp.stack([scale, bias]).astype(F32)
  kernel = functools.partial(
      _kernel, n=n, m=m, bq=block_q, bk=block_k, bd=block_d, nd=nd, nkb=nkb,
      per=per, has_diagonal=has_diagonal, precision=precision,
      group_mode=None if groups is None else group_mode, interpret=interpret)
  ins = (params, x, y)
  in_specs = [
      pl.BlockSpec((2,), lambda i, c: (0,)),
      pl.BlockSpec((n_pad, d_pad), lambda i, c: (0, 0)),
      pl.BlockSpec((m_pad, d_pad), lambda i, c: (0, 0)),
  ]
  if groups is not None:
    ins += tuple(groups)
    in_specs += [pl.BlockSpec((block_q,), lambda i, c: (i,)),
                 pl.BlockSpec((m_pad,), lambda i, c: (0,))]
  # Grid axis 0 (row blocks) varies fastest: concurrently running programs
  # walk the same column blocks of y, which then stay in L2.
  out = pl.pallas_call(
      kernel,
      out_shape=out_struct((splits * n_pad,), F32, *ins),
      grid=(nrb, splits),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((block_q,), lambda i, c: (c * nrb + i,)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name="infcl_sigmoid_fwd",
  )(*ins)
  return out.reshape(splits, n_pad)
