"""Mosaic GPU forward: row and column log-sum-exp of s = t * x y^T + b.

Same contract as ``infcl_jax.kernels.lse_fwd.lse_fwd`` (padded inputs in,
natural-log LSE vectors out), written for Hopper with TMA + wgmma.

Schedule. A persistent grid of P CTAs; CTA p owns the row blocks p, p + P,
... (``block_q`` rows each). Each CTA is three warpgroups (see
``common``): a TMA producer and two wgmma consumers, consumer w taking
columns [w * block_k, (w + 1) * block_k) of every 2 * block_k column block.
For each of its row blocks, a consumer walks all column blocks; each
(block_q, block_k) float32 logit tile is accumulated over D in ``block_d``
chunks from the shared-memory ring, then

* the row statistics (running max, running sum) stay in registers across the
  column blocks and are written once per row block, as a base-2 LSE, to the
  consumer's own row of a (2, n_pad) output (the two consumers' halves are
  merged in XLA);
* the column statistics of the tile (complete: the consumer holds all
  block_q rows of its columns) are merged into the CTA's own row of a
  (P, m_pad) base-2 LSE workspace: read before the tile's matmul (the load's
  latency hides behind it), merged with ``logaddexp2``, written back.
  No two CTAs touch the same workspace row, so there are no atomics; XLA
  merges the P rows.

Everything is in base 2 (exp2 / log2 with log2(e) folded into the scale and
bias). Padded rows / columns (index >= n / m) are masked to -inf.
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

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)   # (block_q,) vector: one value per row
COL = plgpu.Layout.WGMMA.reduce(0)   # (block_k,) vector: one value per column


def merge_shift_sum(old, big, lc):
  """log2(2^old + lc * 2^big) per column: one exp2 and one log2.

  ``old`` is the running column value (base-2 LSE, -inf before the first
  tile), ``big`` the tile's finite shift, ``lc`` its column sums (>= 2^-64:
  the tile passed the exactness check). The larger of old and big is pulled
  out, so the exp2 never overflows:
    old <= big: big + log2(lc + 2^(old - big))
    old >  big: old + log2(1 + lc * 2^(big - old)).
  ``logaddexp2(old, big + log2(lc))`` takes two exp2 and two log2."""
  c = old <= big
  t = jnp.exp2(-jnp.abs(old - big))
  arg = jnp.where(c, lc + t, lc * t + 1.0)
  return jnp.maximum(old, big) + jnp.log2(arg)


def _merge(old_c, big, lc, col_merge):
  """The shared path's new column value (see ``lse_fwd``'s col_merge)."""
  if col_merge == "rmw2":
    return merge_shift_sum(old_c, big, lc)
  v = big + jnp.log2(lc)
  if col_merge == "deferred":
    return v
  return common.logaddexp2(old_c, v)


def _exact(s, m_i, l_i, old_c, rows, cols, col_merge="rmw"):
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
    v = csh + jnp.log2(pc.sum(axis=0))
    # The exact path (rare) merges with logaddexp2 in every rmw mode.
    new_c = v if col_merge == "deferred" else common.logaddexp2(old_c, v)
  return m_i, l_i, new_c


def _shared_or_exact(s, m_i, l_i, old_c, col_merge="rmw"):
  """One exponential per logit: the whole tile shifted by its max ``big``.

  Exact (to float32 rounding) as long as every row's and every column's
  largest term stays far above the underflow threshold, which the sums
  show: each is >= 2^-64 iff that row's / column's max is within ~64 of the
  tile max. Otherwise (an extreme logit range inside one tile, or padding)
  the tile takes the exact two-exponential path.
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
    return m_new, l_new, _merge(old_c, big, lc, col_merge)

  return lax.cond(ok, shared,
                  lambda: _exact(s, m_i, l_i, old_c, True, True, col_merge))


def _shared_flagged(s, m_i, l_i, old_c, col_merge, col_valid):
  """The one-exponential update with no per-tile exactness check.

  As ``_shared_or_exact``'s shared branch, but a row or column whose sum in
  this tile falls below 2^-64 (the case the check sends to the exact path)
  turns NaN instead: the row's running sum, the column's merged value. The
  wrapper reruns the whole call with the checked kernel when any valid
  output is NaN (``check="rerun"``). No cross-warp min, no ``lax.cond``,
  and ``s`` need not stay live beside ``p``.

  Rows with no finite logit in the tile (its columns are all padding) and
  padded columns (``col_valid`` False) are not flagged.
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
  bad_c = lc < _math.MIN_SUM
  if col_valid is not None:
    bad_c = bad_c & col_valid
  lc = jnp.where(bad_c, jnp.full(lc.shape, jnp.nan, F32), lc)
  return m_new, l_new, _merge(old_c, big, lc, col_merge)


def _kernel(params_ref, x_ref, y_ref, *refs, n, m, rows, cols, bq, bk, bd,
            nd, nrb, nkb2, nprog, stages, compute_regs, memory_regs,
            pingpong, single_exp, col_merge, private_pad, check,
            split_rings):
  refs = list(refs)
  row_ref = refs.pop(0) if rows else None
  col_ref = refs.pop(0) if cols else None
  x_smem, y_smem, x_full, y_full, consumed, turn = refs
  pid = lax.axis_index("p")
  wg = lax.axis_index("wg")
  num_rounds = lax.div(nrb - pid + nprog - 1, nprog)
  mask_rows = n % bq != 0
  mask_cols = m % (2 * bk) != 0
  deferred = cols and col_merge == "deferred"

  def row_block(t):
    return pid + t * nprog

  def producer():
    plgpu.set_max_registers(memory_regs, action="decrease")
    coords = lambda u: (row_block(lax.div(u, nkb2)), lax.rem(u, nkb2))
    if split_rings:
      common.producer_split(
          x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed,
          coords=coords, num_tiles=num_rounds * nkb2, nd=nd, bq=bq, bk=bk,
          bd=bd, stages=stages)
    else:
      common.producer(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed,
                      coords=coords, num_tiles=num_rounds * nkb2, nd=nd,
                      bq=bq, bk2=2 * bk, bd=bd, stages=stages)

  def consumer():
    plgpu.set_max_registers(compute_regs, action="increase")
    scale2 = params_ref[0]
    bias2 = params_ref[1]
    # Column statistics reduce across warps: with one shared reduction
    # scratch the consumers must take turns; with private ones (see
    # ``private_scratch``) only ``pingpong`` decides.
    turns = common.Turns(
        turn, wg, enabled=pingpong or (cols and private_pad is None))

    if cols and not deferred:
      @pl.loop(0, nkb2)
      def _(j):
        col_ref.at[pid, pl.ds(j * (2 * bk) + wg * bk, bk)][...] = (
            plgpu.layout_cast(jnp.full((bk,), -jnp.inf, F32), COL))

    def round_body(t, carry):
      rb = row_block(t)

      def col_body(j, rc):
        m_i, l_i = rc
        c0 = j * (2 * bk) + wg * bk
        old_c = None
        if deferred:
          col_slice = col_ref.at[rb, pl.ds(c0, bk)]
        elif cols:
          col_slice = col_ref.at[pid, pl.ds(c0, bk)]
          # Issued before the matmul so that its latency hides behind it.
          old_c = plgpu.load(col_slice, layout=COL, optimized=False)
        g0 = (t * nkb2 + j) * nd
        s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed, g0=g0,
                             nd=nd, wg=wg, bq=bq, bk=bk, stages=stages,
                             split_rings=split_rings)
        turns.wait(t * nkb2 + j)
        s = s0 * scale2 + bias2
        if mask_rows or mask_cols:
          valid = None
          if mask_rows:
            ri = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=WGMMA)
            valid = ri + rb * bq < n
          if mask_cols:
            ci = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=WGMMA)
            cv = ci + c0 < m
            valid = cv if valid is None else valid & cv
          s = jnp.where(valid, s, jnp.full(s.shape, -jnp.inf, F32))
        if single_exp and rows and cols and check == "rerun":
          col_valid = None
          if mask_cols:
            col_valid = plgpu.broadcasted_iota(
                jnp.int32, (bk,), 0, layout=COL) + c0 < m
          m_i, l_i, new_c = _shared_flagged(s, m_i, l_i, old_c, col_merge,
                                            col_valid)
        elif single_exp and rows and cols:
          m_i, l_i, new_c = _shared_or_exact(s, m_i, l_i, old_c, col_merge)
        else:
          m_i, l_i, new_c = _exact(s, m_i, l_i, old_c, rows, cols, col_merge)
        if cols:
          col_slice[...] = new_c
        turns.done()
        return m_i, l_i

      init = (plgpu.layout_cast(jnp.full((bq,), -jnp.inf, F32), ROW),
              plgpu.layout_cast(jnp.zeros((bq,), F32), ROW))
      m_i, l_i = lax.fori_loop(0, nkb2, col_body, init)
      if rows:
        row_ref.at[wg, pl.ds(rb * bq, bq)][...] = (
            common.safe(m_i) + jnp.log2(l_i))
      return carry

    lax.fori_loop(0, num_rounds, round_body, 0)
    turns.drain(num_rounds * nkb2)

  if private_pad is None:
    pl.when(wg == common.NUM_CONSUMERS)(producer)
    pl.when(wg < common.NUM_CONSUMERS)(consumer)
  else:
    # Mosaic GPU places a cross-warp reduction's scratch at the SMEM offset
    # in use where the reduction is traced. Consumer 1's code is traced
    # inside a scoped allocation of ``private_pad`` bytes, so its scratch
    # sits above consumer 0's: the two can reduce at the same time. The
    # scope is entered first by all warpgroups (its entry barrier is
    # CTA-wide); warpgroups 0 and 2 leave it at once (no barrier on exit).
    def scoped(pad_ref):
      del pad_ref
      pl.when(wg == 1)(consumer)

    pl.run_scoped(scoped, plgpu.SMEM((private_pad // 4,), F32),
                  collective_axes="wg")
    pl.when(wg == common.NUM_CONSUMERS)(producer)
    pl.when(wg == 0)(consumer)


def lse_fwd(x, y, scale, bias, *, n, m, rows, cols, block_q=128, block_k=128,
            block_d=64, num_stages=4, num_programs=None, interpret=False,
            compute_regs=232, memory_regs=40, pingpong=True,
            single_exp=True, reduction_scratch_bytes=None, col_merge="rmw",
            private_scratch=False, check="tile", rings="shared"):
  """Row / column LSE of the logits of padded x (n_pad, Dp), y (m_pad, Dp).

  Args:
    x, y: zero-padded bf16 / f16 inputs: x rows to a multiple of block_q,
      y rows to a multiple of 2 * block_k, D to a multiple of block_d.
      ``n`` and ``m`` are the valid row counts.
    scale, bias: float32 scalars (natural units: s = scale * x.y + bias).
    rows, cols: which statistics to compute (static).
    num_programs: persistent CTAs (default: one per SM, clipped to the
      number of row blocks).
    interpret: True (or an ``InterpretGPUParams``) runs the Mosaic GPU
      interpreter on the CPU.
    single_exp: with both statistics, one exponential per logit (a shared
      tile shift) where that is exact, two otherwise.
    reduction_scratch_bytes: Mosaic GPU's cross-warp reduction scratch.
    pingpong: alternate the two consumers' epilogues (always on when cols
      and not ``private_scratch``: the column reductions need it then).
    col_merge: how a tile's column statistics reach the output.
      ``"rmw"`` (default): read-modify-write of the CTA's row of a
      (P, m_pad) base-2 LSE workspace, merged with ``logaddexp2`` (two exp2
      and two log2 per column value, on a COL vector replicated over the
      32 threads holding a column). ``"rmw2"``: the same workspace, the
      shared path merging (old, tile shift, column sums) with one exp2 and
      one log2 (``merge_shift_sum``). ``"deferred"``: no read, no merge:
      each tile writes its base-2 column LSE to row ``row block`` of an
      (n_pad / block_q, m_pad) workspace (4 * n_pad * m_pad / block_q bytes:
      128 MB at B = 65536), merged over the row blocks in XLA.
    private_scratch: give each consumer its own cross-warp reduction
      scratch (consumer 1's code is traced inside a scoped SMEM pad, so its
      scratch lies above consumer 0's; the consumer loop is emitted twice).
      The consumers then need not take turns for the column statistics;
      ``pingpong`` alone decides whether they alternate.
    check: the single-exponential path's exactness test (rows and cols).
      ``"tile"`` (default): per tile, the smallest row and column sum
      (a cross-warp min) picks the shared or the exact path (``lax.cond``).
      ``"rerun"``: no per-tile test; a row / column whose tile sum falls
      below 2^-64 comes out NaN (``_shared_flagged``), and if any valid
      output is NaN the whole call is redone with ``check="tile"`` under an
      XLA ``lax.cond`` (exact; costs a second forward only then: extreme
      logit ranges or NaN inputs).
    rings: ``"shared"`` (default): one ring of (x chunk, 2 * block_k-row y
      chunk) slots read by both consumers, which ties them to within
      ``num_stages`` chunks of each other (so their epilogues coincide and
      the tensor cores idle meanwhile; the turns cannot offset them by more
      than the ring). ``"split"``: a ring per consumer fed by its own
      producer warp (``common.producer_split``), ``num_stages`` slots each
      (SMEM 2 * num_stages * 32 KB: use num_stages=3); with ``pingpong``
      one consumer's wgmmas run during the other's epilogue. Fetches x
      twice per tile pair (4/3 of the L2 -> SMEM traffic).

  Returns:
    (row_lse (n,) or None, col_lse (m,) or None), float32, natural log.
  """
  if not (rows or cols):
    return None, None
  if check not in ("tile", "rerun"):
    raise ValueError(f"check must be tile or rerun, got {check}")
  kw = dict(n=n, m=m, rows=rows, cols=cols, block_q=block_q, block_k=block_k,
            block_d=block_d, num_stages=num_stages, num_programs=num_programs,
            interpret=interpret, compute_regs=compute_regs,
            memory_regs=memory_regs, pingpong=pingpong, single_exp=single_exp,
            reduction_scratch_bytes=reduction_scratch_bytes,
            col_merge=col_merge, private_scratch=private_scratch, rings=rings)
  if not (check == "rerun" and single_exp and rows and cols):
    return _lse_fwd_once(x, y, scale, bias, check="tile", **kw)
  row_lse, col_lse = _lse_fwd_once(x, y, scale, bias, check="rerun", **kw)
  redo = jnp.isnan(row_lse).any() | jnp.isnan(col_lse).any()
  return lax.cond(
      redo,
      lambda: _lse_fwd_once(x, y, scale, bias, check="tile", **kw),
      lambda: (row_lse, col_lse))


def _lse_fwd_once(x, y, scale, bias, *, n, m, rows, cols, block_q, block_k,
                  block_d, num_stages, num_programs, interpret, compute_regs,
                  memory_regs, pingpong, single_exp, reduction_scratch_bytes,
                  col_merge, private_scratch, check, rings):
  """One kernel call (see ``lse_fwd``)."""
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
  if col_merge not in ("rmw", "rmw2", "deferred"):
    raise ValueError(f"col_merge must be rmw, rmw2 or deferred: {col_merge}")
  if cols:
    out_type.append(jax.ShapeDtypeStruct(
        (nrb if col_merge == "deferred" else nprog, m_pad), F32))
  if rings not in ("shared", "split"):
    raise ValueError(f"rings must be shared or split, got {rings}")
  scratch = common.ring_scratch(
      x.dtype, bq=block_q, bk=block_k, bd=block_d, stages=num_stages,
      split_rings=rings == "split") + [common.turn_barrier()]
  kernel = functools.partial(
      _kernel, n=n, m=m, rows=rows, cols=cols, bq=block_q, bk=block_k,
      bd=block_d, nd=nd, nrb=nrb, nkb2=nkb2, nprog=nprog, stages=num_stages,
      compute_regs=compute_regs, memory_regs=memory_regs, pingpong=pingpong,
      single_exp=single_exp, col_merge=col_merge, private_pad=None,
      check=check, split_rings=rings == "split")
  cp = dict(approx_math=True)
  if reduction_scratch_bytes:
    cp["reduction_scratch_bytes"] = reduction_scratch_bytes
  if private_scratch:
    rsb = (reduction_scratch_bytes
           or plgpu.CompilerParams().reduction_scratch_bytes)
    kernel = functools.partial(kernel, private_pad=common.align_smem(rsb))
  outs = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(nprog,),
      grid_names=("p",),
      num_threads=common.NUM_CONSUMERS + 1,
      thread_name="wg",
      kernel_name="infcl_mosaic_lse_fwd",
      compiler_params=plgpu.CompilerParams(**cp),
      interpret=common.interpret_params(interpret),
  )(*common.kernel_operands(rings == "split", params, x, y))
  outs = common.vary_like(list(outs), params, x, y)
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
