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

from infcl_jax.kernels.mosaic import common

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)


def _kernel(params_ref, x_ref, y_ref, r_ref, c_ref, g_ref, part_ref, x_smem,
            y_smem, g_smem, x_full, y_full, consumed, turn, *, rows, cols, mask,
            bq, bk, bd, nd, ni, num_tiles, nprog, stages, compute_regs,
            memory_regs, pingpong):
  pid = lax.axis_index("p")
  wg = lax.axis_index("wg")
  my_tiles = lax.div(num_tiles - pid + nprog - 1, nprog)

  def coords(u):
    tile = pid + u * nprog
    return lax.rem(tile, ni), lax.div(tile, ni)

  @pl.when(wg == common.NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(memory_regs, action="decrease")
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
    inf_c = plgpu.layout_cast(jnp.full((bk,), jnp.inf, F32), COL)
    zero_c = plgpu.layout_cast(jnp.zeros((bk,), F32), COL)
    turns = common.Turns(turn, wg, enabled=pingpong)

    def tile_body(u, acc):
      dsc, dbi = acc
      i, j = coords(u)
      c0 = j * (2 * bk) + wg * bk
      # Vector loads issued before the matmul: their latency hides behind it.
      r = plgpu.load(r_ref.at[pl.ds(i * bq, bq)], layout=ROW, optimized=False)
      c = plgpu.load(c_ref.at[pl.ds(c0, bk)], layout=COL, optimized=False)
      s0 = common.mma_tile(x_smem, y_smem, x_full, y_full, consumed,
                           g0=u * nd, nd=nd, wg=wg, bq=bq, bk=bk,
                           stages=stages)
      turns.wait(u)
      s = s0 * scale2 + bias2
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
      # The previous tile's TMA store must have read g_smem before reuse.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      g_smem.at[wg][...] = g.astype(g_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(g_smem.at[wg],
                              g_ref.at[pl.ds(i * bq, bq), pl.ds(c0, bk)])
      dsc = dsc + (g * s0).sum(axis=1)
      dbi = dbi + g.sum(axis=1)
      turns.done()
      return dsc, dbi

    dsc, dbi = lax.fori_loop(0, my_tiles, tile_body, (zero_r, zero_r))
    turns.drain(my_tiles)
    part_ref.at[pid, wg, 0][...] = dsc
    part_ref.at[pid, wg, 1][...] = dbi
    plgpu.wait_smem_to_gmem(0)


def g_panel(x, y, r2, c2, params, *, rows, cols, mask, g_dtype=None,
            block_q=128, block_k=128, block_d=64, num_stages=3,
            num_programs=None, interpret=False, compute_regs=232,
            memory_regs=40, pingpong=False):
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
  nprog = max(1, min(num_programs or common.num_sms(), num_tiles))
  tr = common.smem_transforms(x.dtype, block_d)
  g_tr = common.smem_transforms(x.dtype, block_k)
  scratch = [
      plgpu.SMEM((num_stages, block_q, block_d), x.dtype, transforms=tr),
      plgpu.SMEM((num_stages, 2 * block_k, block_d), x.dtype, transforms=tr),
      plgpu.SMEM((common.NUM_CONSUMERS, block_q, block_k), x.dtype,
                 transforms=g_tr),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),
      plgpu.Barrier(num_arrivals=common.NUM_CONSUMERS,
                    num_barriers=num_stages),
      common.turn_barrier(),
  ]
  kernel = functools.partial(
      _kernel, rows=rows, cols=cols, mask=mask, bq=block_q, bk=block_k,
      bd=block_d, nd=nd, ni=ni, num_tiles=num_tiles, nprog=nprog,
      stages=num_stages, compute_regs=compute_regs, memory_regs=memory_regs,
      pingpong=pingpong)
  ins = (params.astype(F32), x, y, r2.astype(F32), c2.astype(F32))
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
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=common.interpret_params(interpret),
  )(*ins)
  g, part = common.vary_like((g, part), *ins)
  return g, jnp.sum(part[:, :, 0]), jnp.sum(part[:, :, 1])
