"""Mosaic GPU backward panel for softmax: G = a_r * P^r + a_c * P^c.

Same contract as ``infcl_jax.kernels.lse_bwd.g_panel``: for a panel x of R
rows against all of y, recompute each logit tile once (TMA + wgmma over D),
form

    G_ij = a_r * 2^(s_ij - r_i) + a_c * 2^(s_ij - c_j)      (base 2)

write it to HBM in the input dtype, and return the sums of G * (x y^T) and
of G (the scale and bias gradients). The library GEMMs then form dx = G y and
dy += G^T x.

Schedule. A persistent grid of P CTAs over the (R / block_q) x
(m_pad / (2 * block_k)) tiles, row blocks fastest (CTAs running together
share a y tile; the x panel stays in L2). Each CTA is a TMA producer and two
wgmma consumers (see ``common``); while the consumers run a tile's epilogue
(exponentials, the bf16 store through shared memory and a TMA store, the
scalar partial sums) the producer already streams the next tile's chunks.
The scalar partials are kept as per-row vectors in registers across the
CTA's tiles and written once.

Padding: the statistics of padded rows / columns arrive as +inf; the kernel
turns them into a -inf logit, so that both terms vanish there (a padded
row's column term would otherwise not). NaN statistics stay NaN.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from infcl_jax import _device
from infcl_jax.kernels.mosaic import common

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)
# Fused single-exponential G (``single_exp``): the tile shift is the
# smallest statistic plus FUSED_SHIFT, used where the statistics span at most
# FUSED_SPAN (base 2): then 2^(t - r), 2^(t - c) lie in [2^-116, 2^64] and
# 2^(s - t) <= 2^116, and 2^(s - t) underflows only where G < 2^-62.
FUSED_SHIFT = 64.0
FUSED_SPAN = 180.0
FUSED_OK = 1e30


def _two_exp(s, r, c, a_r, a_c, *, rows, cols, mask, consts):
  inf_r, zero_r, inf_c, zero_c = consts
  if mask:
    # -inf logits on padded rows / columns (statistic +inf).
    pen_r = jnp.where(r == jnp.inf, inf_r, zero_r)
    pen_c = jnp.where(c == jnp.inf, inf_c, zero_c)
    s = (s - lax.broadcast_in_dim(pen_r, s.shape, [0])
         - lax.broadcast_in_dim(pen_c, s.shape, [1]))
  g = None
  if rows:
    g = a_r * jnp.exp2(s - lax.broadcast_in_dim(r, s.shape, [0]))
  if cols:
    gc = a_c * jnp.exp2(s - lax.broadcast_in_dim(c, s.shape, [1]))
    g = gc if g is None else g + gc
  return g


def _g_tile(s0, r, c, tv, a_r, a_c, scale2, bias2, *, rows, cols, mask,
            fused, consts):
  """G of one (sub-)tile: a_r 2^(s - r_i) + a_c 2^(s - c_j).

  ``fused``: G = 2^(s - t) * (a_r 2^(t - r_i) + a_c 2^(t - c_j)) with the
  tile's scalar shift t = tv: one exponential per element (plus one per row
  and per column). Exact to float32 rounding when the tile's statistics
  span at most ``FUSED_SPAN`` (then no factor over- or underflows where G
  is above 2^-62); the wrapper sets tv = +inf otherwise, and such tiles
  (padding included) take the two-exponential form.
  """
  kw = dict(rows=rows, cols=cols, mask=mask, consts=consts)
  if not fused:
    return _two_exp(s0 * scale2 + bias2, r, c, a_r, a_c, **kw)

  def one_exp():
    ar = a_r * jnp.exp2(tv - r)
    ac = a_c * jnp.exp2(tv - c)
    w = (lax.broadcast_in_dim(ar, s0.shape, [0])
         + lax.broadcast_in_dim(ac, s0.shape, [1]))
    # s - t as one FMA: s0 * scale2 + (bias2 - t).
    return jnp.exp2(s0 * scale2 + (bias2 - tv)) * w

  return lax.cond(tv < FUSED_OK, one_exp,
                  lambda: _two_exp(s0 * scale2 + bias2, r, c, a_r, a_c, **kw))


def _kernel(params_ref, x_ref, y_ref, r_ref, c_ref, *refs, rows, cols, mask,
            bq, bk, bd, nd, ni, num_tiles, nprog, stages, compute_regs,
            memory_regs, pingpong, split, fused, ni_cols, split_rings):
  refs = list(refs)
  tab_ref = refs.pop(0) if fused else None
  (g_ref, part_ref, x_smem, y_smem, g_smem, x_full, y_full, consumed,
   turn) = refs
  bw = bk // split
  pid = lax.axis_index("p")
  wg = lax.axis_index("wg")
  my_tiles = lax.div(num_tiles - pid + nprog - 1, nprog)

  def coords(u):
    tile = pid + u * nprog
    return lax.rem(tile, ni), lax.div(tile, ni)

  @pl.when(wg == common.NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(memory_regs, action="decrease")
    if split_rings:
      common.producer_split(x_ref, y_ref, x_smem, y_smem, x_full, y_full,
                            consumed, coords=coords, num_tiles=my_tiles,
                            nd=nd, bq=bq, bk=bk, bd=bd, stages=stages)
    else:
      common.producer(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed,
                      coords=coords, num_tiles=my_tiles, nd=nd, bq=bq,
                      bk2=2 * bk, bd=bd, stages=stages)

  @pl.when(wg < common.NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(compute_regs, action="increase")
    scale2 = params_ref[0]
    bias2 = params_ref[1]
    a_r = params_ref[2]
    a_c = params_ref[3]
    inf_r = plgpu.layout_cast(jnp.full((bq,), jnp.inf, F32), ROW)
    zero_r = plgpu.layout_cast(jnp.zeros((bq,), F32), ROW)
    inf_c = plgpu.layout_cast(jnp.full((bw,), jnp.inf, F32), COL)
    zero_c = plgpu.layout_cast(jnp.zeros((bw,), F32), COL)
    turns = common.Turns(turn, wg, enabled=pingpong)

    def tile_body(u, acc):
      dsc, dbi = acc
      i, j = coords(u)
      c0 = j * (2 * bk) + wg * bk
      # Vector loads issued before the matmul: their latency hides behind it.
      r = plgpu.load(r_ref.at[pl.ds(i * bq, bq)], layout=ROW, optimized=False)
      # c per column sub-tile.
      c_parts = [plgpu.load(c_ref.at[pl.ds(c0 + h * bw, bw)], layout=COL,
                            optimized=False) for h in range(split)]
      tv = None
      if fused:
        # Per-tile shift from the wrapper's table, +inf where the tile's
        # statistics span too wide a range (or are padding / NaN).
        tv = tab_ref[i * (2 * ni_cols) + j * 2 + wg]
      s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed,
                           g0=u * nd, nd=nd, wg=wg, bq=bq, bk=bk,
                           stages=stages, split_rings=split_rings)
      turns.wait(u)
      if split == 1:
        halves = [(s0, c_parts[0])]
      else:
        # Per column sub-tile: its raw logits and its slice of c.
        halves = [(s0[:, h * bw:(h + 1) * bw], c_parts[h])
                  for h in range(split)]
      for h, (s0h, ch) in enumerate(halves):
        g = _g_tile(s0h, r, ch, tv, a_r, a_c, scale2, bias2, rows=rows,
                    cols=cols, mask=mask, fused=fused,
                    consts=(inf_r, zero_r, inf_c, zero_c))
        # G leaves in ``split`` column sub-tiles of bw columns through the
        # consumer's (bq, bw) SMEM buffer; the previous TMA store must have
        # read the buffer before it is reused (with split = 2 the second
        # sub-tile's exponentials run while the first one's store drains).
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        g_smem.at[wg][...] = g.astype(g_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            g_smem.at[wg], g_ref.at[pl.ds(i * bq, bq), pl.ds(c0 + h * bw, bw)])
        dsc = dsc + (g * s0h).sum(axis=1)
        dbi = dbi + g.sum(axis=1)
      turns.done()
      return dsc, dbi

    dsc, dbi = lax.fori_loop(0, my_tiles, tile_body, (zero_r, zero_r))
    turns.drain(my_tiles)
    part_ref.at[pid, wg, 0][...] = dsc
    part_ref.at[pid, wg, 1][...] = dbi
    plgpu.wait_smem_to_gmem(0)


def _shift_table(r2, c2, bq, bk):
  """Per (row block, bk-column block): the fused form's shift, or +inf.

  Flattened (R / bq) x (m_pad / bk), row-major; +inf where the block's
  statistics span more than FUSED_SPAN or are not finite (padding, NaN)."""
  rr = r2.reshape(-1, bq)
  cc = c2.reshape(-1, bk)
  lo = jnp.minimum(rr.min(axis=1)[:, None], cc.min(axis=1)[None, :])
  hi = jnp.maximum(rr.max(axis=1)[:, None], cc.max(axis=1)[None, :])
  ok = (hi - lo <= FUSED_SPAN) & jnp.isfinite(lo) & jnp.isfinite(hi)
  return jnp.where(ok, lo + FUSED_SHIFT, jnp.inf).astype(F32).reshape(-1)


def g_panel(x, y, r2, c2, params, *, rows, cols, mask, g_dtype=None,
            block_q=128, block_k=128, block_d=64, num_stages=3,
            num_programs=None, interpret=False, compute_regs=232,
            memory_regs=40, pingpong=False, epilogue_split=1,
            reduction_scratch_bytes=None, single_exp=False, rings="shared"):
  """The (R, m_pad) probability panel and its scalar partial sums.

  Args:
    x: (R, Dp) panel of zero-padded bf16 / f16 image rows (R a multiple of
      block_q).
    y: (m_pad, Dp) zero-padded text rows (m_pad a multiple of 2 * block_k).
    r2, c2: (R,), (m_pad,) float32 base-2 row / column LSE, +inf on padding
      (any finite placeholder for an unused direction, still +inf on
      padding).
    params: (4,) float32 [scale * log2 e, bias * log2 e, a_r, a_c].
    rows, cols: which terms G has (static).
    mask: whether any padding exists (static).
    g_dtype: dtype of G; must be x.dtype (the TMA store writes that dtype).
    pingpong: alternate the two consumers' epilogues (measured slower on
      an H200: 395 vs 465 TFLOP/s at B = 65536, R = 4096; off by default).
    epilogue_split: G leaves each consumer tile in this many column
      sub-tiles (1 or 2) through a (block_q, block_k / split) SMEM buffer per
      consumer, reused after the previous sub-tile's TMA store has read it.
      With 2 the G buffers take 32 KB instead of 64 KB, so that
      ``num_stages=4`` fits (4 * 48 + 32 KB) with ``reduction_scratch_bytes``
      set to 0.
    single_exp: with both terms, one exponential per element where exact
      (see ``_g_tile``): a per-(row block, consumer column block) shift
      table computed here from r2 / c2 in XLA, read by the kernel per tile.
    rings: ``"shared"`` (default) or ``"split"``: a ring per consumer (see
      ``lse_fwd``); 2 * num_stages * 32 KB of SMEM, so with num_stages=3 it
      needs epilogue_split=2 and reduction_scratch_bytes=0. Meant with
      ``pingpong=True``: with the shared ring the ping-pong cannot offset
      the consumers by more than the ring (measured slower), with split
      rings one consumer's wgmmas run during the other's epilogue.
    reduction_scratch_bytes: Mosaic GPU's cross-warp reduction scratch
      (None: its default, 2 KB). The panel reduces only along rows (within
      warps), so 0 is enough; Pallas reserves the scratch for any reduction.

  Returns:
    g (R, m_pad) of x.dtype, and the sums of G * (x y^T) and of G (float32
    scalars).
  """
  common.check_inputs(x, y, block_q, block_k, block_d)
  if g_dtype is not None and jnp.dtype(g_dtype) != jnp.dtype(x.dtype):
    raise ValueError(f"g_dtype must be the input dtype {x.dtype}")
  if not (rows or cols):
    raise ValueError("at least one of rows / cols")
  r_rows, d_pad = x.shape
  m_pad = y.shape[0]
  ni, nj2, nd = r_rows // block_q, m_pad // (2 * block_k), d_pad // block_d
  num_tiles = ni * nj2
  fused = bool(single_exp and rows and cols)
  nprog = max(1, min(num_programs or _device.num_sms(), num_tiles))
  if epilogue_split not in (1, 2):
    raise ValueError(f"epilogue_split must be 1 or 2, got {epilogue_split}")
  bw = block_k // epilogue_split
  g_tr = common.smem_transforms(x.dtype, bw)
  if rings not in ("shared", "split"):
    raise ValueError(f"rings must be shared or split, got {rings}")
  ring = common.ring_scratch(x.dtype, bq=block_q, bk=block_k, bd=block_d,
                             stages=num_stages, split_rings=rings == "split")
  scratch = ring[:2] + [
      plgpu.SMEM((common.NUM_CONSUMERS, block_q, bw), x.dtype,
                 transforms=g_tr)] + ring[2:] + [common.turn_barrier()]
  kernel = functools.partial(
      _kernel, rows=rows, cols=cols, mask=mask, bq=block_q, bk=block_k,
      bd=block_d, nd=nd, ni=ni, num_tiles=num_tiles, nprog=nprog,
      stages=num_stages, compute_regs=compute_regs, memory_regs=memory_regs,
      pingpong=pingpong, split=epilogue_split, fused=fused,
      ni_cols=nj2, split_rings=rings == "split")
  cp = dict(approx_math=True)
  if reduction_scratch_bytes is not None:
    cp["reduction_scratch_bytes"] = reduction_scratch_bytes
  ins = (params.astype(F32), x, y, r2.astype(F32), c2.astype(F32))
  if fused:
    ins = ins + (_shift_table(ins[3], ins[4], block_q, block_k),)
  g, part = plgpu.kernel(
      kernel,
      out_type=[
          jax.ShapeDtypeStruct((r_rows, m_pad), x.dtype),
          jax.ShapeDtypeStruct((nprog, common.NUM_CONSUMERS, 2, block_q), F32),
      ],
      scratch_types=scratch,
      grid=(nprog,),
      grid_names=("p",),
      num_threads=common.NUM_CONSUMERS + 1,
      thread_name="wg",
      kernel_name="infcl_mosaic_lse_bwd_panel",
      compiler_params=plgpu.CompilerParams(**cp),
      interpret=common.interpret_params(interpret),
  )(*common.kernel_operands(rings == "split", *ins))
  g, part = common.vary_like((g, part), *ins)
  return g, jnp.sum(part[:, :, 0]), jnp.sum(part[:, :, 1])
