"""Portable tiled backend of the sigmoid (SigLIP) family, in plain XLA.

Implements ``sigmoid_sum`` and ``sigmoid_grad`` of ``tile_backend`` with the
same two nested ``lax.scan`` loops as the softmax tiles (``xla_tiles``): the
outer one over row blocks of x, the inner one over column blocks of y. Only
one (block_q, block_k) tile of logits exists at a time. There are no row or
column statistics: the forward is a sum over tiles, and the backward
recomputes each tile once from x, y, scale and bias.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import tile_backend
from infcl_jax.xla_tiles import F32
from infcl_jax.xla_tiles import XlaBackend
from infcl_jax.xla_tiles import _blocks
from infcl_jax.xla_tiles import _dot
from infcl_jax.xla_tiles import _dot_t
from infcl_jax.xla_tiles import _tile_sizes
from infcl_jax.xla_tiles import matmul_precision


def softplus(u):
  """log(1 + e^u) without overflow for u >> 0 or loss of accuracy for u << 0.

  Equals -log sigmoid(-u). For u << 0 the result is e^u to full relative
  precision, which keeps a tiny loss accurate.
  """
  return jnp.maximum(u, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(u)))


def _positive_mask(rb, kb, bq, bk):
  """Where the global row index equals the global column index in a tile."""
  rows = rb * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = kb * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return rows == cols


def _check_diagonal(has_diagonal, n, m):
  if has_diagonal and n != m:
    raise ValueError(
        "has_diagonal=True needs square block pairs (positives at i == j), "
        f"got x with {n} rows and y with {m} rows")


class XlaSigmoidTiles(XlaBackend):
  """The portable tiled sigmoid backend (``backend="xla"``, family "sigmoid")."""

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, block_sizes=None):
    """sum_ij softplus(-z_ij * s_ij) over the block pair, float32 scalar."""
    n, m = x.shape[0], y.shape[0]
    _check_diagonal(has_diagonal, n, m)
    bs = self._block_sizes(block_sizes, x.dtype)
    bq, bk = _tile_sizes(bs, n, m)
    prec = matmul_precision(x.dtype)
    xb, row_valid = _blocks(x, bq)
    yb, col_valid = _blocks(y, bk)
    nk = yb.shape[0]
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)

    def row_block(total, inputs):
      rb, x_blk, rv = inputs

      def col_block(row_total, inputs):
        kb, y_blk, cv = inputs
        s = scale * _dot_t(x_blk, y_blk, prec) + bias
        # -z * s: the positives contribute softplus(-s), the negatives
        # softplus(s). Each term is evaluated on its own, never as
        # softplus(s) - s, so that small terms keep their relative accuracy.
        u = s
        if has_diagonal:
          u = jnp.where(_positive_mask(rb, kb, bq, bk), -s, s)
        t = jnp.where(rv[:, None] & cv[None, :], softplus(u), 0.0)
        return row_total + jnp.sum(t), None

      # Inside shard_map a constant carry must be typed device-varying like
      # the inputs, or lax.scan rejects it (see tile_backend.vary_like).
      row_init = tile_backend.vary_like(jnp.zeros((), F32), total, x_blk)
      row_total, _ = lax.scan(col_block, row_init,
                              (jnp.arange(nk), yb, col_valid))
      return total + row_total, None

    init = tile_backend.vary_like(jnp.zeros((), F32), x, y, scale, bias)
    total, _ = lax.scan(row_block, init,
                        (jnp.arange(xb.shape[0]), xb, row_valid))
    return total

  def sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal,
                   block_sizes=None):
    """(dx, dy, dscale, dbias) of ``coef * sigmoid_sum``, all float32.

    The tile gradient is G_ij = coef * (-z_ij) * sigmoid(-z_ij * s_ij).
    """
    n, m = x.shape[0], y.shape[0]
    d = x.shape[1]
    _check_diagonal(has_diagonal, n, m)
    bs = self._block_sizes(block_sizes, x.dtype)
    bq, bk = _tile_sizes(bs, n, m)
    prec = matmul_precision(x.dtype)
    g_dtype = x.dtype if prec == lax.Precision.DEFAULT else F32
    # float16 has 5 exponent bits: sigmoid values below ~6e-8 (the whole
    # tile when the loss is tiny) would flush to zero. Each float16 tile is
    # therefore divided by its largest |G| before the cast and multiplied
    # back after the f32-accumulated matmul. bfloat16 has float32's range.
    rescale = jnp.dtype(g_dtype) == jnp.float16
    coef = jnp.asarray(coef, F32)
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)
    xb, row_valid = _blocks(x, bq)
    yb, col_valid = _blocks(y, bk)
    nk = yb.shape[0]

    def row_block(carry, inputs):
      dy, dsc, dbi = carry
      rb, x_blk, rv = inputs

      def col_block(carry, inputs):
        dx, dy, dsc, dbi = carry
        kb, y_blk, cv = inputs
        s0 = _dot_t(x_blk, y_blk, prec)
        s = scale * s0 + bias
        # (-z) * sigmoid(-z * s), in [-1, 1]; coef (~1/B) is applied after
        # the matmuls, as in the softmax tiles, so that G stays well scaled.
        g = jax.nn.sigmoid(s)
        if has_diagonal:
          g = jnp.where(_positive_mask(rb, kb, bq, bk), -jax.nn.sigmoid(-s), g)
        g = jnp.where(rv[:, None] & cv[None, :], g, 0.0)
        dsc = dsc + jnp.sum(g * s0)
        dbi = dbi + jnp.sum(g)
        if rescale:
          g_max = jnp.max(jnp.abs(g))
          # An all-zero tile keeps factor 1; a NaN max stays NaN on purpose.
          g_max = jnp.where(g_max == 0, 1.0, g_max)
          gc = (g / g_max).astype(g_dtype)
        else:
          g_max = 1.0
          gc = g.astype(g_dtype)
        dx = dx + g_max * _dot(gc, y_blk, prec)
        dy = dy.at[kb].add(g_max * _dot(gc.T, x_blk, prec))
        return (dx, dy, dsc, dbi), None

      dx0 = tile_backend.vary_like(jnp.zeros((bq, d), F32), carry, x_blk)
      (dx, dy, dsc, dbi), _ = lax.scan(
          col_block, (dx0, dy, dsc, dbi), (jnp.arange(nk), yb, col_valid))
      return (dy, dsc, dbi), dx

    init = (jnp.zeros(yb.shape, F32), jnp.zeros((), F32), jnp.zeros((), F32))
    init = tile_backend.vary_like(init, x, y, scale, bias, coef)
    (dy, dsc, dbi), dx = lax.scan(
        row_block, init, (jnp.arange(xb.shape[0]), xb, row_valid))
    dx = dx.reshape(-1, d)[:n] * (scale * coef)
    dy = dy.reshape(-1, d)[:m] * (scale * coef)
    return dx, dy, dsc * coef, dbi * coef


tile_backend.register("xla", XlaSigmoidTiles, family="sigmoid")
