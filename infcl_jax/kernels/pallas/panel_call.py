"""The grid and block specs that both families' backward panel kernels run on.

A panel kernel (``lse_bwd``, ``sigmoid_bwd``) is one program per
(block_q, block_k) tile of an (R, m_pad) panel. Each program reads the whole
parameter vector, the whole x panel and all of y (it steps over D itself,
``tile_dot``), its row block of each per-row vector and its column block of
each per-column vector; it writes its tile of G (unless the kernel writes no
panel) and one float32 partial per tile for each scalar output.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from infcl_jax._axes import out_struct

F32 = jnp.float32


def panel_call(kernel, params, x, y, *, row_vecs, col_vecs, g_dtype,
               num_partials, block_q, block_k, num_warps, num_stages,
               interpret, name):
  """Runs ``kernel`` over the panel's tiles; returns its outputs (a list).

  Args:
    kernel: the body, called with the refs of (params, x, y, *row_vecs,
      *col_vecs) and then of the outputs.
    params: (P,) float32 parameters; x: (R, Dp) panel rows; y: (m_pad, Dp).
    row_vecs, col_vecs: (R,) and (m_pad,) vectors, blocked per tile.
    g_dtype: the dtype of the G panel output, or None for no panel.
    num_partials: how many (R / block_q, m_pad / block_k) float32 outputs
      of per-tile partials follow G.

  Returns:
    [G (R, m_pad)] if ``g_dtype`` is given, then the partials; inside
    ``shard_map`` they are typed device-varying like the inputs.
  """
  r_rows, d_pad = x.shape
  m_pad = y.shape[0]
  ni, nj = r_rows // block_q, m_pad // block_k
  ins = (params, x, y, *row_vecs, *col_vecs)
  out_shape, out_specs = [], []
  if g_dtype is not None:
    out_shape.append(out_struct((r_rows, m_pad), g_dtype, *ins))
    out_specs.append(pl.BlockSpec((block_q, block_k), lambda i, j: (i, j)))
  out_shape += [out_struct((ni, nj), F32, *ins)] * num_partials
  out_specs += [pl.BlockSpec((None, None), lambda i, j: (i, j))] * num_partials
  # Grid axis 0 (row blocks) varies fastest on the GPU: consecutive programs
  # share one y tile, and the whole x panel stays in L2.
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(ni, nj),
      in_specs=[
          pl.BlockSpec(params.shape, lambda i, j: (0,)),
          pl.BlockSpec((r_rows, d_pad), lambda i, j: (0, 0)),
          pl.BlockSpec((m_pad, d_pad), lambda i, j: (0, 0)),
          *[pl.BlockSpec((block_q,), lambda i, j: (i,)) for _ in row_vecs],
          *[pl.BlockSpec((block_k,), lambda i, j: (j,)) for _ in col_vecs],
      ],
      out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name=name,
  )(*ins)
