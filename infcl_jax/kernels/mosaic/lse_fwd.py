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

from infcl_jax.kernels.mosaic import common

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)   # (block_q,) vector: one value per row
COL = plgpu.Layout.WGMMA.reduce(0)   # (block_k,) vector: one value per column


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
  ok = (lr.min(axis=0) >= common.MIN_SUM) & (lc.min(axis=0) >= common.MIN_SUM)

  def shared():
    m_new = jnp.maximum(m_i, big)
    sh = common.safe(m_new)
    l_new = l_i * jnp.exp2(m_i - sh) + lr * jnp.exp2(big - sh)
    return m_new, l_new, common.logaddexp2(old_c, big + jnp.log2(lc))

  return lax.cond(ok, shared,
                  lambda: _exact(s, m_i, l_i, old_c, True, True))


def _kernel(params_ref, x_ref, y_ref, *refs, n, m, rows, cols, bq, bk, bd,
            nd, nrb, nkb2, nprog, stages, compute_regs, memory_regs,
            pingpong, single_exp):
  refs = list(refs)
  row_ref = refs.pop(0) if rows else None
  col_ref = refs.pop(0) if cols else None
  x_smem, y_smem, x_full, y_full, consumed, turn = refs
  pid = lax.axis_index("p")
  wg = lax.axis_index("wg")
  num_rounds = lax.div(nrb - pid + nprog - 1, nprog)
  mask_rows = n % bq != 0
  mask_cols = m % (2 * bk) != 0

  def row_block(t):
    return pid + t * nprog

  @pl.when(wg == common.NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(memory_regs, action="decrease")
    common.producer(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed,
                    coords=lambda u: (row_block(lax.div(u, nkb2)),
                                      lax.rem(u, nkb2)),
                    num_tiles=num_rounds * nkb2, nd=nd, bq=bq, bk2=2 * bk,
                    bd=bd, stages=stages)

  @pl.when(wg < common.NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(compute_regs, action="increase")
    scale2 = params_ref[0]
    bias2 = params_ref[1]
    # Column statistics reduce across warps: the consumers must take turns.
    turns = common.Turns(turn, wg, enabled=cols or pingpong)

    if cols:
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
        if cols:
          col_slice = col_ref.at[pid, pl.ds(c0, bk)]
          # Issued before the matmul so that its latency hides behind it.
          old_c = plgpu.load(col_slice, layout=COL, optimized=False)
        g0 = (t * nkb2 + j) * nd
        s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed, g0=g0,
                             nd=nd, wg=wg, bq=bq, bk=bk, stages=stages)
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
        if single_exp and rows and cols:
          m_i, l_i, new_c = _shared_or_exact(s, m_i, l_i, old_c)
        else:
          m_i, l_i, new_c = _exact(s, m_i, l_i, old_c, rows, cols)
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


def lse_fwd(x, y, scale, bias, *, n, m, rows, cols, block_q=128, block_k=128,
            block_d=64, num_stages=4, num_programs=None, interpret=False,
            compute_regs=232, memory_regs=40, pingpong=True,
            single_exp=True, reduction_scratch_bytes=None):
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
    pingpong: alternate the two consumers' epilogues (always on when cols:
      the column reductions need it for correctness).

  Returns:
    (row_lse (n,) or None, col_lse (m,) or None), float32, natural log.
  """
  if not (rows or cols):
    return None, None
  common.check_inputs(x, y, block_q, block_k, block_d)
  n_pad, d_pad = x.shape
  m_pad = y.shape[0]
  nrb, nkb2, nd = n_pad // block_q, m_pad // (2 * block_k), d_pad // block_d
  nprog = max(1, min(num_programs or common.num_sms(), nrb))
  params = jnp.stack([jnp.asarray(scale, F32) * common.LOG2E,
                      jnp.asarray(bias, F32) * common.LOG2E]).astype(F32)
  out_type = []
  if rows:
    out_type.append(jax.ShapeDtypeStruct((common.NUM_CONSUMERS, n_pad), F32))
  if cols:
    out_type.append(jax.ShapeDtypeStruct((nprog, m_pad), F32))
  tr = common.smem_transforms(x.dtype, block_d)
  scratch = [
      plgpu.SMEM((num_stages, block_q, block_d), x.dtype, transforms=tr),
      plgpu.SMEM((num_stages, 2 * block_k, block_d), x.dtype, transforms=tr),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=common.NUM_CONSUMERS,
                    num_barriers=num_stages),
      common.turn_barrier(),
  ]
  kernel = functools.partial(
      _kernel, n=n, m=m, rows=rows, cols=cols, bq=block_q, bk=block_k,
      bd=block_d, nd=nd, nrb=nrb, nkb2=nkb2, nprog=nprog, stages=num_stages,
      compute_regs=compute_regs, memory_regs=memory_regs, pingpong=pingpong,
      single_exp=single_exp)
  cp = dict(approx_math=True)
  if reduction_scratch_bytes:
    cp["reduction_scratch_bytes"] = reduction_scratch_bytes
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
  )(params, x, y)
  outs = common.vary_like(list(outs), params, x, y)
  row_lse = col_lse = None
  if rows:
    r = outs.pop(0)[:, :n]
    row_lse = common.logaddexp2(r[0], r[1]) * common.LN2
  if cols:
    c = outs.pop(0)[:, :m]
    mx = common.safe(jnp.max(c, axis=0))
    col_lse = (mx + jnp.log2(jnp.sum(jnp.exp2(c - mx[None, :]), axis=0))
               ) * common.LN2
  return row_lse, col_lse
