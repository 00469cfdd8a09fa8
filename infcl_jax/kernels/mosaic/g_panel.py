"""Mosaic GPU backward panel for softmax: G = a_r * P^r + a_c * P^c.

Same contract as ``infcl_jax.kernels.pallas.lse_bwd.g_panel``: for a panel
x of R rows against all of y, recompute each logit tile once (TMA + wgmma
over D), form

    G_ij = a_r * 2^(s_ij - r_i) + a_c * 2^(s_ij - c_j)      (base 2)

write it to HBM in the input dtype, and return the sums of G * (x y^T) and
of G (the scale and bias gradients). The library GEMMs then form dx = G y and
dy += G^T x.

Schedule. A persistent grid of P CTAs over the (R / block_q) x
(m_pad / (2 * block_k)) tiles, row blocks fastest (CTAs running together
share a y tile; the x panel stays in L2). Each CTA is a TMA producer and two
wgmma consumers (see ``common``), each consumer with its own ring (split
rings), and the consumers alternate their epilogues (exponentials, the
16-bit store through shared memory and a TMA store, the scalar partial
sums): while one runs its epilogue the other's wgmmas keep the tensor cores
busy. G leaves each consumer tile in two column halves through a
(block_q, block_k / 2) SMEM buffer, which frees the shared memory for three
ring stages. The scalar partials are kept as per-row vectors in registers
across the CTA's tiles and written once.

Padding: the statistics of padded rows / columns arrive as +inf; the kernel
turns them into a -inf logit, so that both terms vanish there (a padded
row's column term would otherwise not). NaN statistics stay NaN.

Groups (``groups=(gx, gy)``, a static switch): G is 0 on related pairs
(gx_i == gy_j), which the LSEs left out; one compare and one select per
element after the exponentials, so that a row or column whose statistic is
-inf (all its pairs related) gives 0 there, not NaN. Only the tiles whose
id ranges overlap pay for them (``group_tiles``): each CTA walks the tiles
in the order ``tile_order`` gives, its clean tiles in a first loop without
the compare and select, the others in a second; with ids sorted (the
backend sorts them) nearly every tile is clean. Such a statistic is
clamped to a large finite value (``common.safe``) before the call, once
(O(R + m), not per tile), so that it gives 0, not NaN, against the
padding. The rows' ids are loaded beside r; the columns' after the
matmul (measured faster than beside c: fewer registers live across it).
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
from infcl_jax.kernels.mosaic import group_tiles

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)
# Column halves per consumer tile in the epilogue (see the module docstring).
EPILOGUE_SPLIT = 2


def _g_tile(s, r, c, a_r, a_c, *, rows, cols, mask, consts):
  """G of one (sub-)tile: a_r 2^(s - r_i) + a_c 2^(s - c_j), two
  exponentials per element (the statistics of rows and columns differ)."""
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


def _kernel(params_ref, x_ref, y_ref, r_ref, c_ref, *refs, rows, cols, mask,
            groups, bq, bk, bd, nd, ni, num_tiles, nprog, stages):
  refs = list(refs)
  gx_ref, gy_ref, order_ref, n_clean_ref = (
      [refs.pop(0) for _ in range(4)] if groups else (None,) * 4)
  (g_ref, part_ref, x_smem, y_smem, g_smem, x_full, y_full, consumed,
   turn) = refs
  bw = bk // EPILOGUE_SPLIT
  pid, my_tiles, coords = common.persistent_tiles(num_tiles, nprog, ni)
  my_clean = my_tiles
  if groups:
    # The CTA walks ``order`` (clean tiles first) round-robin as it would
    # walk the grid; its first ``my_clean`` tiles are clean.
    def coords(u):
      t = order_ref[pid + u * nprog]
      return lax.rem(t, ni), lax.div(t, ni)
    my_clean = common.my_count(pid, n_clean_ref[0], nprog)

  def consumer(wg):
    scale2 = params_ref[0]
    bias2 = params_ref[1]
    a_r = params_ref[2]
    a_c = params_ref[3]
    inf_r = plgpu.layout_cast(jnp.full((bq,), jnp.inf, F32), ROW)
    zero_r = plgpu.layout_cast(jnp.zeros((bq,), F32), ROW)
    inf_c = plgpu.layout_cast(jnp.full((bw,), jnp.inf, F32), COL)
    zero_c = plgpu.layout_cast(jnp.zeros((bw,), F32), COL)
    turns = common.Turns(turn, wg)

    def tile_body(u, acc, *, masked):
      dsc, dbi = acc
      i, j = coords(u)
      c0 = j * (2 * bk) + wg * bk
      # Vector loads issued before the matmul: their latency hides behind it.
      r = plgpu.load(r_ref.at[pl.ds(i * bq, bq)], layout=ROW, optimized=False)
      # c per column sub-tile.
      c_parts = [plgpu.load(c_ref.at[pl.ds(c0 + h * bw, bw)], layout=COL,
                            optimized=False) for h in range(EPILOGUE_SPLIT)]
      if masked:
        gx = plgpu.load(gx_ref.at[pl.ds(i * bq, bq)], layout=ROW,
                        optimized=False)
      s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed,
                           g0=u * nd, nd=nd, wg=wg, bq=bq, bk=bk,
                           stages=stages, split_rings=True)
      turns.wait(u)
      if masked:
        gy_parts = [plgpu.load(gy_ref.at[pl.ds(c0 + h * bw, bw)], layout=COL,
                               optimized=False)
                    for h in range(EPILOGUE_SPLIT)]
      # Per column sub-tile: its raw logits and its slice of c.
      halves = [(s0[:, h * bw:(h + 1) * bw], c_parts[h])
                for h in range(EPILOGUE_SPLIT)]
      for h, (s0h, ch) in enumerate(halves):
        g = _g_tile(s0h * scale2 + bias2, r, ch, a_r, a_c, rows=rows,
                    cols=cols, mask=mask,
                    consts=(inf_r, zero_r, inf_c, zero_c))
        if masked:
          rel = (lax.broadcast_in_dim(gx, g.shape, [0])
                 == lax.broadcast_in_dim(gy_parts[h], g.shape, [1]))
          g = jnp.where(rel, jnp.zeros(g.shape, F32), g)
        # The previous TMA store must have read the buffer before it is
        # reused; the second sub-tile's exponentials run while the first
        # one's store drains.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        g_smem.at[wg][...] = g.astype(g_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            g_smem.at[wg], g_ref.at[pl.ds(i * bq, bq), pl.ds(c0 + h * bw, bw)])
        dsc = dsc + (g * s0h).sum(axis=1)
        dbi = dbi + g.sum(axis=1)
      turns.done()
      return dsc, dbi

    # Two loops, not a branch per tile (which costs Mosaic GPU more than the
    # compare and select it would skip).
    acc = lax.fori_loop(0, my_clean,
                        functools.partial(tile_body, masked=False),
                        (zero_r, zero_r))
    if groups:
      acc = lax.fori_loop(my_clean, my_tiles,
                          functools.partial(tile_body, masked=True), acc)
    dsc, dbi = acc
    turns.drain(my_tiles)
    part_ref.at[pid, wg, 0][...] = dsc
    part_ref.at[pid, wg, 1][...] = dbi
    plgpu.wait_smem_to_gmem(0)

  common.specialize(consumer, x_ref, y_ref, x_smem, y_smem, x_full, y_full,
                    consumed, coords=coords, num_tiles=my_tiles, nd=nd, bq=bq,
                    bk=bk, bd=bd, stages=stages, split_rings=True)


def g_panel(x, y, r2, c2, params, *, rows, cols, mask, g_dtype=None,
            block_q=128, block_k=128, block_d=64, num_stages=3,
            num_programs=None, interpret=False, groups=None, tiles=None):
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
    num_stages: slots of each consumer's ring (3: 2 * 3 * 32 KB of ring
      beside 2 * 16 KB of G buffers).
    num_programs: persistent CTAs (default: one per SM).
    groups: None, or (gx (R,), gy (m_pad,)) int32 group ids of the panel's
      rows and of the columns: G = 0 on related pairs (gx_i == gy_j).
    tiles: with ``groups``, the panel's ``group_tiles.tile_order(gx, gy,
      block_q, 2 * block_k)`` when the caller has it (computed here if
      None).

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
  common.check_groups(groups, x, y)
  ni, nj2, nd = r_rows // block_q, m_pad // (2 * block_k), d_pad // block_d
  num_tiles = ni * nj2
  nprog = max(1, min(num_programs or _device.num_sms(), num_tiles))
  bw = block_k // EPILOGUE_SPLIT
  ring = common.ring_scratch(x.dtype, bq=block_q, bk=block_k, bd=block_d,
                             stages=num_stages, split_rings=True)
  scratch = ring[:2] + [
      plgpu.SMEM((common.NUM_CONSUMERS, block_q, bw), x.dtype,
                 transforms=common.smem_transforms(x.dtype, bw))
  ] + ring[2:] + [common.turn_barrier()]
  kernel = functools.partial(
      _kernel, rows=rows, cols=cols, mask=mask, groups=groups is not None,
      bq=block_q, bk=block_k, bd=block_d, nd=nd, ni=ni, num_tiles=num_tiles,
      nprog=nprog, stages=num_stages)
  r2, c2 = r2.astype(F32), c2.astype(F32)
  if groups is not None:
    # A statistic of -inf (every pair of the row / column related) becomes
    # a large finite one: its related pairs are zeroed in the kernel, and
    # against a padded column / row (-inf logit) it gives 0, not
    # -inf - (-inf) = NaN. +inf (padding) stays.
    r2, c2 = common.safe(r2), common.safe(c2)
  ins = (params.astype(F32), x, y, r2, c2)
  if groups is not None:
    gx, gy = (g.astype(jnp.int32) for g in groups)
    order, n_clean = tiles or group_tiles.tile_order(gx, gy, block_q,
                                                     2 * block_k)
    ins += (gx, gy, order.astype(jnp.int32),
            n_clean.astype(jnp.int32).reshape(1))
  # The panel reduces only along rows (within warps): no cross-warp
  # reduction scratch is needed, and its SMEM goes to the ring.
  g, part = common.launch(
      kernel, operands=ins,
      out_type=[
          jax.ShapeDtypeStruct((r_rows, m_pad), x.dtype),
          jax.ShapeDtypeStruct((nprog, common.NUM_CONSUMERS, 2, block_q), F32),
      ],
      scratch=scratch, nprog=nprog, name="infcl_mosaic_lse_bwd_panel",
      interpret=interpret, split_rings=True, reduction_scratch_bytes=0)
  return g, jnp.sum(part[:, :, 0]), jnp.sum(part[:, :, 1])
