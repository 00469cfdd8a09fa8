"""Fused forward kernel: row and column log-sum-exp of s = t * x y^T + b.

One sweep over the tiles gives both statistics (both CLIP directions), and no
tile of logits ever leaves the chip.

Schedule. A persistent grid of ``P`` programs; program p owns the row blocks
p, p + P, p + 2P, ... For each of its row blocks it walks every column block:
the (block_q, block_k) logit tile is accumulated over D in ``block_d`` steps
(Triton pipelines that inner loop), then

* the row statistics (running max, running sum) stay in registers and are
  written once per row block, already as an LSE;
* the column statistics of the tile are merged into the program's own row of
  a (P, B_y) workspace (read-modify-write of 2 * block_k floats per tile,
  nothing next to the tile's 2 * block_q * block_k * D flops).

Different programs never touch the same workspace row, so there are no races
and no atomics; the wrapper merges the P partial rows with a stable
log-sum-exp in XLA. The workspace is P * B_y, linear in B.

Exponentials: the row and the column statistics need different shifts, so
the plain update takes two exponentials per logit. Where the tile allows it
(every row's and column's maximum within ~64 binary orders of magnitude of
the tile's maximum, checked per tile from the sums), one shared shift, the
tile max, serves both, with one exponential per logit; otherwise the tile is
recomputed and takes the exact two-exponential path.

Everything is in base 2 (exp2 / log2 with log2(e) folded into scale and
bias), which is what the GPU's special-function unit computes natively.

Groups (``backends.base``): with the rows' and columns' int32 group ids, a
related pair's logit is -inf before either statistic sees it (one compare
and one select per logit; the ids are two int32 vectors per tile). A tile
with a row or column of related pairs only fails the shared-shift check
and takes the exact path, where such a row / column ends at -inf.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from infcl_jax._axes import out_struct
from infcl_jax._math import LN2
from infcl_jax._math import LOG2E
from infcl_jax._math import lse2_of_partials
from infcl_jax._math import MIN_SUM as _MIN_SUM
from infcl_jax._math import safe_max as _safe
from infcl_jax.kernels.pallas import interpret_vma
from infcl_jax.kernels.pallas import tile_dot

F32 = jnp.float32


def _kernel(*refs, interpret, **kw):
  interpret_vma.run_body(functools.partial(_body, **kw), refs, num_ids=1,
                         interpret=interpret)


def _body(pid, params_ref, x_ref, y_ref, *refs, n, m, bq, bk, bd, nd, nrb,
          nkb, nprog, m_pad, rows, cols, precision, barrier, single_exp,
          groups):
  # The group ids' refs (inputs) come first, then the outputs'.
  gx_ref, gy_ref = refs[:2] if groups else (None, None)
  out_refs = list(refs[2:] if groups else refs)
  row_ref = out_refs.pop(0) if rows else None
  cm_ref, cl_ref = (out_refs if cols else (None, None))
  scale2 = params_ref[0]  # scale * log2(e)
  bias2 = params_ref[1]   # bias * log2(e)
  ws = pid * m_pad        # this program's row of the column workspace
  mask_rows = n % bq != 0
  mask_cols = m % bk != 0

  def sync():
    if barrier:
      # The next row block re-reads the workspace slice just written,
      # possibly from other threads of the program: make the stores
      # visible to them.
      plgpu.debug_barrier()

  if cols:
    def init(j, c):
      sl = pl.ds(ws + j * bk, bk)
      cm_ref[sl] = jnp.full((bk,), -jnp.inf, F32)
      cl_ref[sl] = jnp.zeros((bk,), F32)
      return c
    lax.fori_loop(0, nkb, init, 0)
    sync()

  def tile(rb, j, gx):
    """The (bq, bk) base-2 logit tile of row block rb, column block j;
    -inf on padding and (``gx``: the row block's group ids) related pairs."""
    s0 = tile_dot.tile_dot(x_ref, y_ref, rb * bq, j * bk, bq=bq, bk=bk,
                           bd=bd, nd=nd, precision=precision)
    s = s0 * scale2 + bias2
    if groups:
      gy = gy_ref[pl.ds(j * bk, bk)]
      s = jnp.where(gx[:, None] == gy[None, :], -jnp.inf, s)
    if mask_rows or mask_cols:
      valid = None
      if mask_rows:
        valid = (rb * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)) < n
      if mask_cols:
        cv = (j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)) < m
        valid = cv if valid is None else valid & cv
      s = jnp.where(valid, s, -jnp.inf)
    return s

  def row_block(t, c):
    rb = pid + t * nprog
    gx = gx_ref[pl.ds(rb * bq, bq)] if groups else None

    def exact_update(s, j, m_i, l_i):
      """Per-row and per-column shifts: two exponentials per logit."""
      if rows:
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        sh = _safe(m_new)
        l_i = l_i * jnp.exp2(m_i - sh) + jnp.sum(jnp.exp2(s - sh[:, None]),
                                                axis=1)
        m_i = m_new
      if cols:
        sl = pl.ds(ws + j * bk, bk)
        old_m = cm_ref[sl]
        old_l = cl_ref[sl]
        new_m = jnp.maximum(old_m, jnp.max(s, axis=0))
        sh = _safe(new_m)
        lc = jnp.sum(jnp.exp2(s - sh[None, :]), axis=0)
        cl_ref[sl] = old_l * jnp.exp2(old_m - sh) + lc
        cm_ref[sl] = new_m
        sync()
      return m_i, l_i

    def shared_update(j, m_i, l_i, big, lr, lc):
      """Merges tile sums taken with one shift ``big`` for the whole tile."""
      m_new = jnp.maximum(m_i, big)
      sh = _safe(m_new)
      l_i = l_i * jnp.exp2(m_i - sh) + lr * jnp.exp2(big - sh)
      sl = pl.ds(ws + j * bk, bk)
      old_m = cm_ref[sl]
      old_l = cl_ref[sl]
      new_m = jnp.maximum(old_m, big)
      shc = _safe(new_m)
      cl_ref[sl] = old_l * jnp.exp2(old_m - shc) + lc * jnp.exp2(big - shc)
      cm_ref[sl] = new_m
      sync()
      return m_new, l_i

    def col_step(j, carry):
      m_i, l_i = carry
      s = tile(rb, j, gx)
      if not (single_exp and rows and cols):
        return exact_update(s, j, m_i, l_i)
      # One exponential per logit: shift the whole tile by its max. Exact
      # (to float32 rounding) as long as every row's and every column's
      # largest term stays far above the underflow threshold, which the
      # sums show: each is >= 2^-64 iff that row's / column's max is within
      # ~64 + log2(tile) of the tile max. Otherwise (rare: an extreme logit
      # range inside one tile, or padding) recompute the tile and take the
      # exact two-exponential path.
      big = jnp.max(jnp.max(s, axis=1), axis=0)
      p = jnp.exp2(s - _safe(big))
      lr = jnp.sum(p, axis=1)
      lc = jnp.sum(p, axis=0)
      ok = (jnp.min(lr, axis=0) >= _MIN_SUM) & (jnp.min(lc, axis=0) >= _MIN_SUM)
      return lax.cond(
          ok, lambda: shared_update(j, m_i, l_i, big, lr, lc),
          lambda: exact_update(tile(rb, j, gx), j, m_i, l_i))

    init = (jnp.full((bq,), -jnp.inf, F32), jnp.zeros((bq,), F32))
    m_i, l_i = lax.fori_loop(0, nkb, col_step, init)
    if rows:
      row_ref[pl.ds(rb * bq, bq)] = (m_i + jnp.log2(l_i)) * LN2
    return c

  # Row blocks pid, pid + nprog, ... below nrb.
  n_rounds = lax.div(nrb - pid + nprog - 1, nprog)
  lax.fori_loop(0, n_rounds, row_block, 0)


def lse_fwd(x, y, scale, bias, *, n, m, rows, cols, block_q, block_k,
            block_d, num_programs, num_warps, num_stages, precision,
            interpret, single_exp=True, groups=None):
  """Row / column LSE of the logits of padded x (n_pad, Dp), y (m_pad, Dp).

  Args:
    x, y: zero-padded inputs: rows to multiples of block_q / block_k, D to a
      multiple of block_d. ``n`` and ``m`` are the valid row counts.
    scale, bias: float32 scalars.
    rows, cols: which statistics to compute (static).
    num_programs: persistent programs (clipped to the number of row blocks).
    single_exp: with both statistics, one exponential per logit (a shared
      tile shift) where that is exact, two otherwise.
    groups: None, or the padded int32 group ids (gx (n_pad,), gy (m_pad,))
      of the rows and columns: related pairs (gx[i] == gy[j]) are left out
      of both statistics (a row / column of only those has LSE -inf).

  Returns:
    (row_lse (n,) or None, col_lse (m,) or None), float32, natural log.
  """
  n_pad, d_pad = x.shape
  m_pad = y.shape[0]
  nrb, nkb, nd = n_pad // block_q, m_pad // block_k, d_pad // block_d
  nprog = max(1, min(num_programs, nrb))
  params = jnp.stack([scale * LOG2E, bias * LOG2E]).astype(F32)
  ins = (params, x, y) + (() if groups is None else tuple(groups))
  out_shape = []
  if rows:
    out_shape.append(out_struct((n_pad,), F32, *ins))
  if cols:
    out_shape += [out_struct((nprog * m_pad,), F32, *ins)] * 2
  kernel = functools.partial(
      _kernel, n=n, m=m, bq=block_q, bk=block_k, bd=block_d, nd=nd, nrb=nrb,
      nkb=nkb, nprog=nprog, m_pad=m_pad, rows=rows, cols=cols,
      precision=precision, barrier=cols and not interpret,
      single_exp=single_exp, groups=groups is not None, interpret=interpret)
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(nprog,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name="infcl_lse_fwd",
  )(*ins)
  outs = list(outs)
  row_lse = outs.pop(0)[:n] if rows else None
  col_lse = None
  if cols:
    cm = outs[0].reshape(nprog, m_pad)[:, :m]
    cl = outs[1].reshape(nprog, m_pad)[:, :m]
    col_lse = lse2_of_partials(cm, cl)
  return row_lse, col_lse
