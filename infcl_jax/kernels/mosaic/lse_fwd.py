"""Mosaic GPU forward: row and column log-sum-exp of s = t * x y^T + b.

Same contract as ``infcl_jax.kernels.pallas.lse_fwd.lse_fwd`` (padded inputs
in, natural-log LSE vectors out), written for Hopper with TMA + wgmma.

Schedule. A persistent grid of P CTAs; CTA p owns the row blocks p, p + P,
... (``block_q`` rows each). Each CTA is three warpgroups (see
``common``): a TMA producer and two wgmma consumers, consumer w taking
columns [w * block_k, (w + 1) * block_k) of every 2 * block_k column block.
For each of its row blocks, a consumer walks all column blocks; each
(block_q, block_k) float32 logit tile is accumulated over D in ``block_d``
chunks from the consumer's own shared-memory ring (split rings: one
consumer's wgmmas run while the other runs its epilogue), then

* the row statistics (running max, running sum) stay in registers across the
  column blocks and are written once per row block, as a base-2 LSE, to the
  consumer's own row of a (2, n_pad) output (the two consumers' halves are
  merged in XLA);
* the column statistics of the tile (complete: the consumer holds all
  block_q rows of its columns) are merged into the CTA's own row of a
  (P, m_pad) base-2 LSE workspace: read before the tile's matmul (the load's
  latency hides behind it), merged, written back. No two CTAs touch the
  same workspace row, so there are no atomics; XLA merges the P rows. The
  column reductions cross warps through one shared scratch buffer, so the
  two consumers take turns in the epilogue (``common.Turns``).

One exponential per logit where exact: the whole tile shifted by its max,
with no per-tile test. A row or column whose tile sum falls below
``MIN_SUM`` (where the shared shift is not exact) turns NaN instead, and a
call with any NaN output is redone with the per-tile test, which sends such
tiles to the exact two-exponential path (``check``). Extreme logit ranges
and NaN inputs pay a second forward; every other call none.

Everything is in base 2 (exp2 / log2 with log2(e) folded into the scale and
bias). Padded rows / columns (index >= n / m) are masked to -inf.

The padding mask is built only in the tiles that hold padding (the last
row block, the last column block), behind a runtime branch on the tile;
the other tiles pay one scalar test. Building it in every tile (two
(bq, bk) iotas in the WGMMA layout, a compare and a select) halved the
forward's rate at B = 50,000 on an H200.

Groups (``groups=(gx, gy)``, a static switch: without them the kernel is
the ungrouped one, unchanged). Related pairs (gx_i == gy_j) are masked to
-inf like padding, one compare and one select per logit, but only in the
column blocks whose id range overlaps the row block's
(``group_tiles.dirty_spans``, computed in XLA and loaded as two scalars
per round): a round walks its column blocks in three loops, the masked
span between two unmasked ones. The backend hands the kernel ids sorted
(``backends.mosaic.GroupOrder``), so a span is the one or two column
blocks that hold the row block's ids. Inside the span the one-exponential
update must tell "no term in this tile" from "terms too small for the
shared shift": a row with no unrelated logit in the tile (its max is
-inf) keeps its running statistics; a column with none, which cannot be
seen without a cross-warp reduction, is recognised from its id (``lo`` ==
``hi`` == gy_j, the row block's smallest and largest valid id, two more
scalars per round) and keeps its workspace value. Outside it every pair
is unrelated.

A row or column with no unrelated pair at all ends at -inf.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from infcl_jax import _device
from infcl_jax import _math
from infcl_jax.kernels.mosaic import common
from infcl_jax.kernels.mosaic import group_tiles

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)   # (block_q,) vector: one value per row
COL = plgpu.Layout.WGMMA.reduce(0)   # (block_k,) vector: one value per column


def merge_shift_sum(old, big, lc):
  """log2(2^old + lc * 2^big) per column: one exp2 and one log2.

  ``old`` is the running column value (base-2 LSE, -inf before the first
  tile), ``big`` the tile's finite shift, ``lc`` its column sums (>= 2^-64,
  or NaN when flagged). The larger of old and big is pulled out, so the
  exp2 never overflows:
    old <= big: big + log2(lc + 2^(old - big))
    old >  big: old + log2(1 + lc * 2^(big - old)).
  ``logaddexp2(old, big + log2(lc))`` would take two exp2 and two log2."""
  c = old <= big
  t = jnp.exp2(-jnp.abs(old - big))
  arg = jnp.where(c, lc + t, lc * t + 1.0)
  return jnp.maximum(old, big) + jnp.log2(arg)


def _exact(s, m_i, l_i, old_c, rows, cols):
  """Per-row and per-column shifts: two exponentials per logit."""
  new_c = None
  if rows:
    m_new = jnp.maximum(m_i, s.max(axis=1))
    sh = common.safe(m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(sh, s.shape, [0]))
    l_i = l_i * jnp.exp2(m_i - sh) + p.sum(axis=1)
    m_i = m_new
  if cols:
    csh = common.safe(s.max(axis=0))
    pc = jnp.exp2(s - lax.broadcast_in_dim(csh, s.shape, [1]))
    new_c = common.logaddexp2(old_c, csh + jnp.log2(pc.sum(axis=0)))
  return m_i, l_i, new_c


def _shared_or_exact(s, m_i, l_i, old_c):
  """One exponential per logit, tested per tile (``check="tile"``).

  The whole tile is shifted by its max ``big``: exact (to float32
  rounding) as long as every row's and every column's largest term stays
  far above the underflow threshold, which the sums show: each is >= 2^-64
  iff that row's / column's max is within ~64 of the tile max. Otherwise
  (an extreme logit range inside one tile, or padding) the tile takes the
  exact two-exponential path.
  """
  big = common.safe(s.max(axis=1).max(axis=0))
  p = jnp.exp2(s - big)
  lr = p.sum(axis=1)
  lc = p.sum(axis=0)
  ok = (lr.min(axis=0) >= _math.MIN_SUM) & (lc.min(axis=0) >= _math.MIN_SUM)

  def shared():
    m_new = jnp.maximum(m_i, big)
    sh = common.safe(m_new)
    l_new = l_i * jnp.exp2(m_i - sh) + lr * jnp.exp2(big - sh)
    return m_new, l_new, merge_shift_sum(old_c, big, lc)

  return lax.cond(ok, shared, lambda: _exact(s, m_i, l_i, old_c, True, True))


def _shared_flagged(s, m_i, l_i, old_c, col_valid, col_related=None):
  """The one-exponential update with no per-tile test (``check="rerun"``).

  As ``_shared_or_exact``'s shared branch, but a row or column whose sum in
  this tile falls below 2^-64 (the case the test sends to the exact path)
  turns NaN instead: the row's running sum, the column's merged value. No
  cross-warp min and no ``lax.cond`` per tile, and ``s`` need not stay live
  beside ``p``.

  Rows with no finite logit in the tile (its columns are all padding) and
  padded columns (``col_valid`` False) are not flagged.

  ``col_related`` (groups only): (bk,) bool, the columns with no unrelated
  logit in the tile; they keep ``old_c`` (their sum is 0: the merge would
  flag them, or lose ``old_c`` to a far larger shift), and rows whose max
  is -inf keep their statistics (see the module docstring).
  """
  rmax = s.max(axis=1)
  big = common.safe(rmax.max(axis=0))
  p = jnp.exp2(s - big)
  lr = p.sum(axis=1)
  lc = p.sum(axis=0)
  nan_r = jnp.full(lr.shape, jnp.nan, F32)
  bad_r = (lr < _math.MIN_SUM) & (rmax > -jnp.inf)
  m_new = jnp.maximum(m_i, big)
  sh = common.safe(m_new)
  l_new = l_i * jnp.exp2(m_i - sh) + jnp.where(bad_r, nan_r,
                                                lr * jnp.exp2(big - sh))
  if col_related is not None:
    # A row with no term here must not be rescaled to this tile's shift
    # (its sum would underflow against a far larger one).
    has_r = rmax > -jnp.inf
    m_new = jnp.where(has_r, m_new, m_i)
    l_new = jnp.where(has_r, l_new, l_i)
  bad_c = lc < _math.MIN_SUM
  if col_valid is not None:
    bad_c = bad_c & col_valid
  lc = jnp.where(bad_c, jnp.full(lc.shape, jnp.nan, F32), lc)
  new_c = merge_shift_sum(old_c, big, lc)
  if col_related is not None:
    new_c = jnp.where(col_related, old_c, new_c)
  return m_new, l_new, new_c


def _kernel(params_ref, x_ref, y_ref, *refs, n, m, rows, cols, bq, bk, bd,
            nd, nrb, nkb2, nprog, stages, single_exp, check, groups):
  refs = list(refs)
  gx_ref, gy_ref, lo_ref, hi_ref, start_ref, stop_ref = (
      [refs.pop(0) for _ in range(6)] if groups else [None] * 6)
  row_ref = refs.pop(0) if rows else None
  col_ref = refs.pop(0) if cols else None
  x_smem, y_smem, x_full, y_full, consumed, turn = refs
  pid = lax.axis_index("p")
  num_rounds = common.my_count(pid, nrb, nprog)
  mask_rows = n % bq != 0
  mask_cols = m % (2 * bk) != 0
  neg_inf = lambda shape: jnp.full(shape, -jnp.inf, F32)

  def pad_valid(rb, c0, valid=None):
    """(bq, bk) validity of an edge tile's logits (rows < n, columns < m)
    from two 2-D iotas, and-ed onto ``valid``."""
    if mask_rows:
      ri = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=WGMMA)
      rv = ri + rb * bq < n
      valid = rv if valid is None else valid & rv
    if mask_cols:
      ci = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=WGMMA)
      cv = ci + c0 < m
      valid = cv if valid is None else valid & cv
    return valid

  def col_validity(c0):
    """(bk,) COL: which of the consumer's columns are < m."""
    return plgpu.broadcasted_iota(jnp.int32, (bk,), 0, layout=COL) + c0 < m

  def row_block(t):
    return pid + t * nprog

  def consumer(wg):
    scale2 = params_ref[0]
    bias2 = params_ref[1]
    turns = common.Turns(turn, wg)

    if cols:
      @pl.loop(0, nkb2)
      def _(j):
        col_ref.at[pid, pl.ds(j * (2 * bk) + wg * bk, bk)][...] = (
            plgpu.layout_cast(jnp.full((bk,), -jnp.inf, F32), COL))

    flagged = single_exp and rows and cols and check == "rerun"

    def round_body(t, carry):
      rb = row_block(t)
      if groups:
        gx = plgpu.load(gx_ref.at[pl.ds(rb * bq, bq)], layout=ROW,
                        optimized=False)
        if flagged:
          # Scalars: one register each across the round.
          lo = lo_ref[rb]
          hi = hi_ref[rb]

      def col_body(j, rc, *, masked):
        m_i, l_i = rc
        c0 = j * (2 * bk) + wg * bk
        old_c = None
        if cols:
          col_slice = col_ref.at[pid, pl.ds(c0, bk)]
          # Issued before the matmul so that its latency hides behind it.
          old_c = plgpu.load(col_slice, layout=COL, optimized=False)
        if masked:
          gy = plgpu.load(gy_ref.at[pl.ds(c0, bk)], layout=COL,
                          optimized=False)
        g0 = (t * nkb2 + j) * nd
        s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed, g0=g0,
                             nd=nd, wg=wg, bq=bq, bk=bk, stages=stages,
                             split_rings=True)
        turns.wait(t * nkb2 + j)
        s = s0 * scale2 + bias2
        if masked:
          unrelated = (lax.broadcast_in_dim(gx, (bq, bk), [0])
                       != lax.broadcast_in_dim(gy, (bq, bk), [1]))
          s = jnp.where(unrelated, s, neg_inf(s.shape))
        if mask_rows or mask_cols:
          # Only the last row block / the consumer's last column block
          # hold padding: every other tile skips the mask (building it in
          # every tile halved the forward's rate at B = 50,000).
          edge = False
          if mask_rows:
            edge = (rb + 1) * bq > n
          if mask_cols:
            edge = edge | (c0 + bk > m)
          s = lax.cond(
              edge,
              lambda s: jnp.where(pad_valid(rb, c0), s, neg_inf(s.shape)),
              lambda s: s, s)
        col_valid = None
        if flagged:
          if mask_cols:
            col_valid = col_validity(c0)
          all_rel = ((gy == lo) & (gy == hi)) if masked else None
          m_i, l_i, new_c = _shared_flagged(s, m_i, l_i, old_c, col_valid,
                                            all_rel)
        elif single_exp and rows and cols:
          m_i, l_i, new_c = _shared_or_exact(s, m_i, l_i, old_c)
        else:
          m_i, l_i, new_c = _exact(s, m_i, l_i, old_c, rows, cols)
        if cols:
          col_slice[...] = new_c
        turns.done()
        return m_i, l_i

      init = (plgpu.layout_cast(jnp.full((bq,), -jnp.inf, F32), ROW),
              plgpu.layout_cast(jnp.zeros((bq,), F32), ROW))
      plain = functools.partial(col_body, masked=False)
      if groups:
        # The column blocks that may hold a related pair, [start, stop),
        # mask them; the rest run the ungrouped tile (three loops, not a
        # branch per tile).
        start, stop = start_ref[rb], stop_ref[rb]
        rc = lax.fori_loop(0, start, plain, init)
        rc = lax.fori_loop(start, stop,
                           functools.partial(col_body, masked=True), rc)
        m_i, l_i = lax.fori_loop(stop, nkb2, plain, rc)
      else:
        m_i, l_i = lax.fori_loop(0, nkb2, plain, init)
      if rows:
        row_ref.at[wg, pl.ds(rb * bq, bq)][...] = (
            common.safe(m_i) + jnp.log2(l_i))
      return carry

    lax.fori_loop(0, num_rounds, round_body, 0)
    turns.drain(num_rounds * nkb2)

  # A CTA owns whole row blocks (rounds), each against every column block.
  common.specialize(
      consumer, x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed,
      coords=lambda u: (row_block(lax.div(u, nkb2)), lax.rem(u, nkb2)),
      num_tiles=num_rounds * nkb2, nd=nd, bq=bq, bk=bk, bd=bd,
      stages=stages, split_rings=True)


# Mosaic GPU's cross-warp reduction scratch (the column statistics): 16 KB
# measured faster than its 2 KB default.
REDUCTION_SCRATCH_BYTES = 16384




def lse_fwd(x, y, scale, bias, *, n, m, rows, cols, block_q=128, block_k=128,
            block_d=64, num_stages=3, num_programs=None, interpret=False,
            single_exp=True, check="rerun", groups=None):
  """Row / column LSE of the logits of padded x (n_pad, Dp), y (m_pad, Dp).

  Args:
    x, y: zero-padded bf16 / f16 inputs: x rows to a multiple of block_q,
      y rows to a multiple of 2 * block_k, D to a multiple of block_d.
      ``n`` and ``m`` are the valid row counts.
    scale, bias: float32 scalars (natural units: s = scale * x.y + bias).
    rows, cols: which statistics to compute (static).
    num_stages: slots of each consumer's ring (3 fit beside the rest of
      the 227 KB of shared memory: 2 * 3 * 32 KB).
    num_programs: persistent CTAs (default: one per SM, clipped to the
      number of row blocks).
    interpret: True (or an ``InterpretGPUParams``) runs the Mosaic GPU
      interpreter on the CPU.
    single_exp: with both statistics, one exponential per logit (a shared
      tile shift) where that is exact, two otherwise.
    check: how the one-exponential path is kept exact (rows and cols).
      ``"rerun"`` (default): no per-tile test; if any valid output is NaN
      the call is redone with ``"tile"`` under an XLA ``lax.cond`` (exact;
      costs a second forward only then: extreme logit ranges or NaN
      inputs). ``"tile"``: per tile, the smallest row and column sum (a
      cross-warp min) picks the shared or the exact path.
    groups: None, or (gx (n_pad,), gy (m_pad,)) int32 group ids of the
      padded rows / columns (any value on padding): related pairs
      (gx_i == gy_j) are left out of both statistics; a row / column with
      no other pair gets -inf.

  Returns:
    (row_lse (n,) or None, col_lse (m,) or None), float32, natural log.
  """
  if not (rows or cols):
    return None, None
  if check not in ("tile", "rerun"):
    raise ValueError(f"check must be tile or rerun, got {check}")
  common.check_groups(groups, x, y, rows="n_pad")
  ops = None if groups is None else _group_operands(
      *groups, n=n, block_q=block_q, block_k=block_k)
  kw = dict(n=n, m=m, rows=rows, cols=cols, block_q=block_q, block_k=block_k,
            block_d=block_d, num_stages=num_stages, num_programs=num_programs,
            interpret=interpret, single_exp=single_exp,
            groups=ops)
  if not (check == "rerun" and single_exp and rows and cols):
    return _lse_fwd_once(x, y, scale, bias, check="tile", **kw)
  row_lse, col_lse = _lse_fwd_once(x, y, scale, bias, check="rerun", **kw)
  redo = jnp.isnan(row_lse).any() | jnp.isnan(col_lse).any()
  return lax.cond(
      redo,
      lambda: _lse_fwd_once(x, y, scale, bias, check="tile", **kw),
      lambda: (row_lse, col_lse))


def _group_operands(gx, gy, *, n, block_q, block_k):
  """The kernel's group operands: the padded ids; per row block the
  smallest and largest id of its valid rows, and the column blocks
  [start, stop) that it masks (``group_tiles.dirty_spans``)."""
  info = jnp.iinfo(jnp.int32)
  gx = gx.astype(jnp.int32)
  gy = gy.astype(jnp.int32)
  blocks = gx.reshape(-1, block_q)
  valid = (jnp.arange(gx.shape[0]) < n).reshape(blocks.shape)
  lo = jnp.min(jnp.where(valid, blocks, info.max), axis=1)
  hi = jnp.max(jnp.where(valid, blocks, info.min), axis=1)
  start, stop = group_tiles.dirty_spans(gx, gy, block_q, 2 * block_k)
  return gx, gy, lo, hi, start, stop


def _lse_fwd_once(x, y, scale, bias, *, n, m, rows, cols, block_q, block_k,
                  block_d, num_stages, num_programs, interpret, single_exp,
                  check, groups):
  """One kernel call (see ``lse_fwd``; ``groups``: ``_group_operands``)."""
  common.check_inputs(x, y, block_q, block_k, block_d)
  n_pad, d_pad = x.shape
  m_pad = y.shape[0]
  nrb, nkb2, nd = n_pad // block_q, m_pad // (2 * block_k), d_pad // block_d
  nprog = max(1, min(num_programs or _device.num_sms(), nrb))
  params = jnp.stack([jnp.asarray(scale, F32) * _math.LOG2E,
                      jnp.asarray(bias, F32) * _math.LOG2E]).astype(F32)
  out_type = []
  if rows:
    out_type.append(jax.ShapeDtypeStruct((common.NUM_CONSUMERS, n_pad), F32))
  if cols:
    out_type.append(jax.ShapeDtypeStruct((nprog, m_pad), F32))
  scratch = common.ring_scratch(
      x.dtype, bq=block_q, bk=block_k, bd=block_d, stages=num_stages,
      split_rings=True) + [common.turn_barrier()]
  kernel = functools.partial(
      _kernel, n=n, m=m, rows=rows, cols=cols, bq=block_q, bk=block_k,
      bd=block_d, nd=nd, nrb=nrb, nkb2=nkb2, nprog=nprog, stages=num_stages,
      single_exp=single_exp, check=check, groups=groups is not None)
  outs = common.launch(
      kernel, operands=(params, x, y) + tuple(groups or ()),
      out_type=out_type, scratch=scratch,
      nprog=nprog, name="infcl_mosaic_lse_fwd", interpret=interpret,
      split_rings=True, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES)
  row_lse = col_lse = None
  if rows:
    r = outs.pop(0)[:, :n]
    row_lse = common.logaddexp2(r[0], r[1]) * _math.LN2
  if cols:
    c = outs.pop(0)[:, :m]
    mx = common.safe(jnp.max(c, axis=0))
    col_lse = (mx + jnp.log2(jnp.sum(jnp.exp2(c - mx[None, :]), axis=0))
               ) * _math.LN2
  return row_lse, col_lse
