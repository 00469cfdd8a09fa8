"""Portable tiled backend: the tile operations of ``tile_backend`` in plain XLA.

Runs on any JAX platform. Two nested ``lax.scan`` loops walk the tiles: the
outer one over row blocks of x, the inner one over column blocks of y. Only a
(block_q, block_k) tile of logits exists at a time; the row statistics of the
current row block and the column statistics of all columns (O(B)) are carried.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from infcl_jax import tile_backend
from infcl_jax.block_sizes import BlockSizes

F32 = jnp.float32
NEG_INF = -jnp.inf


def matmul_precision(dtype):
  # float32 inputs must not silently drop to TF32 on GPU: the tests hold f32
  # to ~1e-5. bf16/f16 inputs already run on the tensor cores at full rate.
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return lax.Precision.DEFAULT


def safe_max(m):
  """A max usable as a shift: -inf (an all-masked row) becomes 0."""
  return jnp.where(m == NEG_INF, 0.0, m)


def merge_stats(m_a, l_a, m_b, l_b):
  """Stable merge of two (running max, sum of exp(s - max)) pairs."""
  m = jnp.maximum(m_a, m_b)
  shift = safe_max(m)
  return m, l_a * jnp.exp(m_a - shift) + l_b * jnp.exp(m_b - shift)


def stats_to_lse(m, l):
  return m + jnp.log(l)


def _blocks(a, block):
  """Zero-pads the rows of ``a`` to a multiple of ``block`` and splits them."""
  n, d = a.shape
  nb = -(-n // block)
  pad = nb * block - n
  if pad:
    a = jnp.pad(a, ((0, pad), (0, 0)))
  valid = (jnp.arange(nb * block) < n).reshape(nb, block)
  return a.reshape(nb, block, d), valid


def _vec_blocks(v, block, fill):
  n = v.shape[0]
  nb = -(-n // block)
  return jnp.pad(v, (0, nb * block - n), constant_values=fill).reshape(nb, block)


def _dot_t(a, b, precision):
  """a @ b.T with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         preferred_element_type=F32, precision=precision)


def _dot(a, b, precision):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                         preferred_element_type=F32, precision=precision)


def _tile_sizes(block_sizes, n, m):
  # Never pad a small problem up to a large default tile.
  return min(block_sizes.block_q, n), min(block_sizes.block_k, m)


class XlaBackend:
  """Plumbing shared by the XLA backends of both families."""

  name = "xla"

  def default_block_sizes(self, platform, dtype):
    return BlockSizes.get_default("xla", platform, dtype)

  def _block_sizes(self, block_sizes, dtype):
    if block_sizes is None:
      return self.default_block_sizes(tile_backend.default_platform(), dtype)
    return block_sizes


class XlaTiles(XlaBackend):
  """The portable tiled backend (``backend="xla"``), softmax family."""

  def lse(self, x, y, scale, bias, *, rows, cols, block_sizes=None):
    bs = self._block_sizes(block_sizes, x.dtype)
    n, m = x.shape[0], y.shape[0]
    bq, bk = _tile_sizes(bs, n, m)
    prec = matmul_precision(x.dtype)
    xb, row_valid = _blocks(x, bq)
    yb, col_valid = _blocks(y, bk)
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)

    def row_block(col_stats, inputs):
      x_blk, rv = inputs

      def col_block(row_stats, inputs):
        y_blk, cv = inputs
        s = scale * _dot_t(x_blk, y_blk, prec) + bias
        s = jnp.where(rv[:, None] & cv[None, :], s, NEG_INF)
        out = ()
        if rows:
          m_t = jnp.max(s, axis=1)
          l_t = jnp.sum(jnp.exp(s - safe_max(m_t)[:, None]), axis=1)
          row_stats = merge_stats(*row_stats, m_t, l_t)
        if cols:
          mc = jnp.max(s, axis=0)
          lc = jnp.sum(jnp.exp(s - safe_max(mc)[None, :]), axis=0)
          out = (mc, lc)
        return row_stats, out

      init = (jnp.full((bq,), NEG_INF, F32), jnp.zeros((bq,), F32))
      init = tile_backend.vary_like(init, x, y, scale, bias)
      (rm, rl), tile_cols = lax.scan(col_block, init, (yb, col_valid))
      if cols:
        col_stats = merge_stats(*col_stats, *tile_cols)
      return col_stats, (stats_to_lse(rm, rl) if rows else ())

    col_init = (jnp.full(yb.shape[:2], NEG_INF, F32), jnp.zeros(yb.shape[:2], F32))
    col_init = tile_backend.vary_like(col_init, x, y, scale, bias)
    (cm, cl), row_lse = lax.scan(row_block, col_init, (xb, row_valid))
    row_out = row_lse.reshape(-1)[:n] if rows else None
    col_out = stats_to_lse(cm, cl).reshape(-1)[:m] if cols else None
    return row_out, col_out

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
               *, block_sizes=None):
    bs = self._block_sizes(block_sizes, x.dtype)
    n, m = x.shape[0], y.shape[0]
    d = x.shape[1]
    bq, bk = _tile_sizes(bs, n, m)
    prec = matmul_precision(x.dtype)
    # The probabilities are in [0, 1]; the coefficients (~1/B) are applied
    # after the matmuls, so that a float16 G does not underflow.
    row_coef = jnp.asarray(row_coef if row_lse is not None else 0.0, F32)
    col_coef = jnp.asarray(col_coef if col_lse is not None else 0.0, F32)
    norm = jnp.maximum(jnp.abs(row_coef), jnp.abs(col_coef))
    norm = jnp.where(norm == 0, 1.0, norm)
    a_r, a_c = row_coef / norm, col_coef / norm
    g_dtype = x.dtype if prec == lax.Precision.DEFAULT else F32

    xb, row_valid = _blocks(x, bq)
    yb, col_valid = _blocks(y, bk)
    # +inf statistics of padding make exp(s - lse) vanish there.
    r_b = _vec_blocks(row_lse.astype(F32), bq, jnp.inf) if row_lse is not None else None
    c_b = _vec_blocks(col_lse.astype(F32), bk, jnp.inf) if col_lse is not None else None
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)
    nk = yb.shape[0]

    def row_block(carry, inputs):
      dy, dsc, dbi = carry
      x_blk, rv, r_blk = inputs

      def col_block(carry, inputs):
        dx, dy, dsc, dbi = carry
        k, y_blk, cv, c_blk = inputs
        s0 = _dot_t(x_blk, y_blk, prec)
        s = scale * s0 + bias
        g = jnp.zeros_like(s)
        if row_lse is not None:
          g = g + a_r * jnp.exp(s - r_blk[:, None])
        if col_lse is not None:
          g = g + a_c * jnp.exp(s - c_blk[None, :])
        g = jnp.where(rv[:, None] & cv[None, :], g, 0.0)
        dsc = dsc + jnp.sum(g * s0)
        dbi = dbi + jnp.sum(g)
        gc = g.astype(g_dtype)
        dx = dx + _dot(gc, y_blk, prec)
        dy = dy.at[k].add(_dot(gc.T, x_blk, prec))
        return (dx, dy, dsc, dbi), None

      dx0 = tile_backend.vary_like(jnp.zeros((bq, d), F32), carry, x_blk, r_blk)
      c_in = c_b if c_b is not None else jnp.zeros(yb.shape[:2], F32)
      (dx, dy, dsc, dbi), _ = lax.scan(
          col_block, (dx0, dy, dsc, dbi),
          (jnp.arange(nk), yb, col_valid, c_in))
      return (dy, dsc, dbi), dx

    r_in = r_b if r_b is not None else jnp.zeros(xb.shape[:2], F32)
    init = (jnp.zeros(yb.shape, F32), jnp.zeros((), F32), jnp.zeros((), F32))
    init = tile_backend.vary_like(init, x, y, scale, bias, row_lse, col_lse)
    (dy, dsc, dbi), dx = lax.scan(row_block, init, (xb, row_valid, r_in))
    dx = dx.reshape(-1, d)[:n] * (scale * norm)
    dy = dy.reshape(-1, d)[:m] * (scale * norm)
    return dx, dy, dsc * norm, dbi * norm


tile_backend.register("xla", XlaTiles, family="softmax")
