"""Pallas backend of the softmax tile family (``backend="pallas"``).

Implements ``lse`` and ``lse_grad`` of ``infcl_jax.tile_backend`` with the
kernels of ``infcl_jax.kernels``:

* ``lse``: one fused Pallas sweep (``kernels.lse_fwd``) gives row and column
  LSE together; no logit tile is written to HBM. Partial column statistics
  of the persistent programs are merged here in XLA.
* ``lse_grad``: a hybrid over panels of ``panel_rows`` rows. Per panel a
  Pallas kernel (``kernels.lse_bwd``) recomputes the logits once and writes
  the probability panel G in the input dtype, and the library GEMMs form
  dx = G y and dy += G^T x. The panel is the only buffer of R * B elements.

Both kernels take one exponential per logit where a tile's logit range
allows it and fall back, per tile, to the exact two-exponential form
(``BlockSizes.single_exp``). Measured on an H200 (B=65536, D=768, bf16):
forward 15 ms, backward 38 ms (panel kernel 18 ms + GEMMs 20 ms); see
BENCHMARKS.md.

On a GPU the kernels lower through Pallas' Triton backend; on any other
platform they run with ``interpret=True`` (slow, for tests). The wrapper
pads B and D with zeros and the kernels mask the padding, so any shape works.

Precision: bf16 / f16 inputs run on the tensor cores with float32
accumulation; G is stored in the input dtype, normalised so that its
largest coefficient is 1 (a float16 G cannot underflow for large B).
float32 inputs use TF32 matmuls by default, like XLA's own float32 GEMMs on
the GPU: logits then carry ~1e-3 relative error, and so do the loss and the
gradients. ``BlockSizes(f32_precision="highest")``, or JAX's own switch
``with jax.default_matmul_precision("highest"):``, keeps full float32 at
several times the cost. On a
CPU (interpret mode) the matmuls are exact float32 either way.

A Mosaic GPU (``plgpu.kernel``) or jax-triton version replaces the kernels
by registering another backend class with the same two methods.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from infcl_jax import pallas_common
from infcl_jax import tile_backend
from infcl_jax.kernels import lse_bwd
from infcl_jax.kernels import lse_fwd
from infcl_jax.pallas_common import check_int32 as _check_int32
from infcl_jax.pallas_common import dot as _dot
from infcl_jax.pallas_common import num_sms as _num_sms
from infcl_jax.pallas_common import pad1 as _pad1
from infcl_jax.pallas_common import pad2 as _pad2
from infcl_jax.pallas_common import panel_rows
from infcl_jax.pallas_common import round_up as _round_up

F32 = jnp.float32
LOG2E = math.log2(math.e)


class PallasTiles(pallas_common.PallasBackend):
  """The fused Pallas backend (``backend="pallas"``), softmax family."""

  def lse(self, x, y, scale, bias, *, rows, cols, block_sizes=None):
    if not (rows or cols):
      return None, None
    bs = self._block_sizes(block_sizes, x.dtype)
    n, d = x.shape
    m = y.shape[0]
    d_pad = _round_up(d, bs.block_d)
    xp = _pad2(x, _round_up(n, bs.block_q), d_pad)
    yp = _pad2(y, _round_up(m, bs.block_k), d_pad)
    nprog = bs.num_programs or _num_sms()
    _check_int32(image_emb=xp.size, text_emb=yp.size,
                 column_workspace=min(nprog, xp.shape[0] // bs.block_q)
                 * yp.shape[0])
    return lse_fwd.lse_fwd(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        rows=rows, cols=cols, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, num_programs=nprog, num_warps=bs.num_warps,
        num_stages=bs.num_stages, precision=self._precision(bs, x.dtype),
        interpret=self.interpret, single_exp=bs.single_exp)

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
               *, block_sizes=None):
    bs = self._block_sizes(block_sizes, x.dtype)
    n, d = x.shape
    m = y.shape[0]
    rows, cols = row_lse is not None, col_lse is not None
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)
    prec = self._precision(bs, x.dtype)
    # Probabilities are in [0, 1]; the coefficients (~1/B) are applied after
    # the GEMMs, so that a float16 G does not underflow.
    row_coef = jnp.asarray(row_coef if rows else 0.0, F32)
    col_coef = jnp.asarray(col_coef if cols else 0.0, F32)
    norm = jnp.maximum(jnp.abs(row_coef), jnp.abs(col_coef))
    norm = jnp.where(norm == 0, 1.0, norm)
    a_r, a_c = row_coef / norm, col_coef / norm
    g_dtype = x.dtype

    d_pad = _round_up(d, bs.block_d)
    m_pad = _round_up(m, bs.bwd_block_k)
    r_rows, n_panels = panel_rows(bs, n, m_pad)
    n_pad = r_rows * n_panels
    xp = _pad2(x, n_pad, d_pad)
    yp = _pad2(y, m_pad, d_pad)
    _check_int32(image_emb=xp.size, text_emb=yp.size)
    # Base-2 statistics, +inf on padding; an unused direction gets zeros
    # (its exp term is compiled out) but keeps +inf on padding for masking.
    r2 = (row_lse.astype(F32) * LOG2E) if rows else jnp.zeros((n,), F32)
    c2 = (col_lse.astype(F32) * LOG2E) if cols else jnp.zeros((m,), F32)
    r2 = _pad1(r2, n_pad, jnp.inf)
    c2 = _pad1(c2, m_pad, jnp.inf)
    mask = n_pad != n or m_pad != m
    params = jnp.stack([scale * LOG2E, bias * LOG2E, a_r, a_c]).astype(F32)

    def panel(carry, inputs):
      dy, dsc, dbi = carry
      x_p, r_p = inputs
      if bs.bwd_impl == "pallas":
        g, dsc_p, dbi_p = lse_bwd.g_panel(
            x_p, yp, r_p, c2, params, rows=rows, cols=cols, mask=mask,
            g_dtype=g_dtype, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
            block_d=bs.block_d, num_warps=bs.bwd_num_warps,
            num_stages=bs.bwd_num_stages, precision=prec,
            interpret=self.interpret, single_exp=bs.single_exp)
      else:
        g, dsc_p, dbi_p = _xla_g_panel(x_p, yp, r_p, c2, params, rows, cols,
                                       mask, g_dtype, prec)
      dx_p = _dot(g, yp, ((1,), (0,)), prec)
      dy = dy + _dot(g, x_p, ((0,), (0,)), prec)
      return (dy, dsc + dsc_p, dbi + dbi_p), dx_p

    init = (jnp.zeros((m_pad, d_pad), F32), jnp.zeros((), F32),
            jnp.zeros((), F32))
    # Inside shard_map the carry must vary over the same mesh axes as what
    # the panels add to it (see tile_backend.vary_like).
    init = tile_backend.vary_like(init, xp, yp, r2, c2, params)
    (dy, dsc, dbi), dx = lax.scan(
        panel, init, (xp.reshape(n_panels, r_rows, d_pad),
                      r2.reshape(n_panels, r_rows)))
    dx = dx.reshape(n_pad, d_pad)[:n, :d] * (scale * norm)
    dy = dy[:m, :d] * (scale * norm)
    return dx, dy, dsc * norm, dbi * norm


def _xla_g_panel(x_p, yp, r2, c2, params, rows, cols, mask, g_dtype, prec):
  """``bwd_impl="xla"``: the same panel from XLA's GEMM + a fusion.

  Materialises the (R, B) float32 logits of the panel: more memory and HBM
  traffic than the Pallas kernel; kept to measure the difference.
  """
  s0 = _dot(x_p, yp, ((1,), (1,)), prec)
  s = s0 * params[0] + params[1]
  g = jnp.zeros_like(s)
  if rows:
    g = g + params[2] * jnp.exp2(s - r2[:, None])
  if cols:
    g = g + params[3] * jnp.exp2(s - c2[None, :])
  if mask:
    g = jnp.where((r2 != jnp.inf)[:, None] & (c2 != jnp.inf)[None, :], g, 0.0)
  return g.astype(g_dtype), jnp.sum(g * s0), jnp.sum(g)


tile_backend.register("pallas", PallasTiles, family="softmax")
