"""Portable tiled backend (``backend="xla"``): both families in plain XLA.

Runs on any JAX platform. Two nested ``lax.scan`` loops walk the tiles: the
outer one over row blocks of x, the inner one over column blocks of y. Only a
(block_q, block_k) tile of logits exists at a time; the row statistics of the
current row block and the column statistics of all columns (O(B)) are
carried. The backward of both families is one sweep (``_grad_sweep``) that
recomputes each tile once and differs only in how a tile of G is formed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import _math
from infcl_jax.backends import base
from infcl_jax.backends import capability
from infcl_jax.block_sizes import BlockSizes

F32 = jnp.float32


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
  pad = ((0, nb * block - n),) + ((0, 0),) * (v.ndim - 1)
  return jnp.pad(v, pad, constant_values=fill).reshape(
      (nb, block) + v.shape[1:])


def _positive_mask(rb, kb, bq, bk):
  """Where the global row index equals the global column index in a tile."""
  rows = rb * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  cols = kb * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  return rows == cols


def _group_blocks(groups, bq, bk, n_rows, n_cols):
  """The (row, column) group ids split like the inputs, or dummies (-1
  padding: padded pairs are masked anyway)."""
  if groups is None:
    return (jnp.zeros((n_rows, bq), jnp.int32),
            jnp.zeros((n_cols, bk), jnp.int32))
  gx, gy = groups
  return _vec_blocks(gx, bq, -1), _vec_blocks(gy, bk, -1)


def _with_positives(groups, positives, m):
  """``groups`` with the rows' ``positives`` (``base``: one more column
  left out per row, -1 none) as a second id per row and column: the ids
  become (n, c) and (m, c), and a pair is related when any of its c ids
  agree (``_related``). Unchanged without positives."""
  if positives is None:
    return groups
  px = positives.astype(jnp.int32)[:, None]
  py = jnp.arange(m, dtype=jnp.int32)[:, None]
  if groups is None:
    return px, py
  gx, gy = groups
  return (jnp.concatenate([gx[:, None], px], axis=1),
          jnp.concatenate([gy[:, None], py], axis=1))


def _related(gx_blk, gy_blk):
  """The related pairs of a tile from its rows' and columns' ids: equal
  ids, or for (n, c) ids (``_with_positives``) any of the c equal."""
  if gx_blk.ndim == 1:
    return gx_blk[:, None] == gy_blk[None, :]
  return jnp.any(gx_blk[:, None, :] == gy_blk[None, :, :], axis=-1)


def _sigmoid_labels(rb, kb, bq, bk, has_diagonal, rel, group_mode):
  """(positive, dropped) masks of a sigmoid tile: the diagonal (home tile)
  is positive; related pairs (``rel``, None without groups) are positives
  or dropped by ``group_mode``."""
  diag = (_positive_mask(rb, kb, bq, bk) if has_diagonal
          else jnp.zeros((bq, bk), bool))
  if rel is None:
    return diag, jnp.zeros((), bool)
  if group_mode == "positives":
    return diag | rel, jnp.zeros((), bool)
  return diag, rel & ~diag


def _grad_sweep(x, y, scale, bias, tile_g, *, bs, prec, row_vec=None,
                col_vec=None, rescale=False, groups=None):
  """sum over tiles of (G y, G^T x, sum G * x y^T, sum G), G recomputed.

  ``tile_g(rb, kb, s, r_blk, c_blk, rel)`` forms a float32 tile of G from
  the logits (padding is masked here); ``rel`` is the tile's related pairs
  (``groups``; all False without). ``row_vec`` / ``col_vec`` are optional
  per-row / per-column float32 vectors handed to it blockwise. ``rescale``
  divides each tile by its largest |G| before the cast to the input dtype
  and multiplies back after the float32-accumulated matmul: float16 has 5
  exponent bits, and a tile of tiny G (a tiny loss) would flush to zero.
  The caller applies the scale and its coefficients to the results.
  """
  n, m = x.shape[0], y.shape[0]
  d = x.shape[1]
  bq, bk = min(bs.block_q, n), min(bs.block_k, m)
  g_dtype = x.dtype if prec == lax.Precision.DEFAULT else F32
  xb, row_valid = _blocks(x, bq)
  yb, col_valid = _blocks(y, bk)
  nk = yb.shape[0]
  r_in = (_vec_blocks(row_vec, bq, jnp.inf) if row_vec is not None
          else jnp.zeros(xb.shape[:2], F32))
  c_in = (_vec_blocks(col_vec, bk, jnp.inf) if col_vec is not None
          else jnp.zeros(yb.shape[:2], F32))
  gxb, gyb = _group_blocks(groups, bq, bk, xb.shape[0], yb.shape[0])

  def row_block(carry, inputs):
    dy, dsc, dbi = carry
    rb, x_blk, rv, r_blk, gx_blk = inputs

    def col_block(carry, inputs):
      dx, dy, dsc, dbi = carry
      kb, y_blk, cv, c_blk, gy_blk = inputs
      s0 = _math.dot(x_blk, y_blk, ((1,), (1,)), prec)
      rel = (_related(gx_blk, gy_blk) if groups is not None
             else jnp.zeros((), bool))
      g = tile_g(rb, kb, scale * s0 + bias, r_blk, c_blk, rel)
      g = jnp.where(rv[:, None] & cv[None, :], g, 0.0)
      dsc = dsc + jnp.sum(g * s0)
      dbi = dbi + jnp.sum(g)
      g_max = 1.0
      if rescale:
        g_max = jnp.max(jnp.abs(g))
        # An all-zero tile keeps factor 1; a NaN max stays NaN on purpose.
        g_max = jnp.where(g_max == 0, 1.0, g_max)
        g = g / g_max
      gc = g.astype(g_dtype)
      dx = dx + g_max * _math.dot(gc, y_blk, ((1,), (0,)), prec)
      dy = dy.at[kb].add(g_max * _math.dot(gc, x_blk, ((0,), (0,)), prec))
      return (dx, dy, dsc, dbi), None

    # Inside shard_map a constant carry must vary like what is added to it.
    dx0 = _axes.vary_like(jnp.zeros((bq, d), F32), carry, inputs)
    (dx, dy, dsc, dbi), _ = lax.scan(
        col_block, (dx0, dy, dsc, dbi),
        (jnp.arange(nk), yb, col_valid, c_in, gyb))
    return (dy, dsc, dbi), dx

  init = (jnp.zeros(yb.shape, F32), jnp.zeros((), F32), jnp.zeros((), F32))
  init = _axes.vary_like(init, x, y, scale, bias, r_in, c_in)
  (dy, dsc, dbi), dx = lax.scan(
      row_block, init, (jnp.arange(xb.shape[0]), xb, row_valid, r_in, gxb))
  return dx.reshape(-1, d)[:n], dy.reshape(-1, d)[:m], dsc, dbi


class XlaBackend(base.TileBackend):
  """The portable tiled backend, softmax and sigmoid families."""

  name = "xla"
  families = ("softmax", "sigmoid")
  RUNS_ON = capability.RunsOn(portable=True)
  GROUPS = True
  POSITIVES = True
  F32_DEFAULT = "highest"  # The exactness baseline (backends.precision).

  def default_block_sizes(self, platform, dtype):
    del dtype
    if platform == "gpu":
      # Large tiles keep cuBLAS busy; 2048 x 8192 f32 is 64 MiB per buffer.
      return BlockSizes(block_q=2048, block_k=8192)
    # On CPU a few MiB per tile amortises the loop overhead.
    return BlockSizes(block_q=512, block_k=2048)

  def _sweep(self, x, y, scale, bias, bs):
    """What a forward sweep needs: tile shape, precision, blocked inputs."""
    bq, bk = min(bs.block_q, x.shape[0]), min(bs.block_k, y.shape[0])
    return (bq, bk, self.precision(bs, x.dtype, x.shape[-1]),
            _blocks(x, bq), _blocks(y, bk), jnp.asarray(scale, F32), jnp.asarray(bias, F32))

  # ------------------------------------------------------------ softmax

  def _lse(self, x, y, scale, bias, *, rows, cols, bs, groups=None,
           positives=None):
    n, m = x.shape[0], y.shape[0]
    groups = _with_positives(groups, positives, m)
    bq, bk, prec, (xb, row_valid), (yb, col_valid), scale, bias = self._sweep(
        x, y, scale, bias, bs)
    neg = _math.NEG_INF
    gxb, gyb = _group_blocks(groups, bq, bk, xb.shape[0], yb.shape[0])

    def row_block(col_stats, inputs):
      x_blk, rv, gx_blk = inputs

      def col_block(row_stats, inputs):
        y_blk, cv, gy_blk = inputs
        s = scale * _math.dot(x_blk, y_blk, ((1,), (1,)), prec) + bias
        keep = rv[:, None] & cv[None, :]
        if groups is not None:
          keep = keep & (gx_blk[:, None] != gy_blk[None, :] if gx_blk.ndim == 1
                         else ~_related(gx_blk, gy_blk))
        s = jnp.where(keep, s, neg)
        out = ()
        if rows:
          m_t = jnp.max(s, axis=1)
          l_t = jnp.sum(jnp.exp(s - _math.safe_max(m_t)[:, None]), axis=1)
          row_stats = _math.merge_stats(*row_stats, m_t, l_t)
        if cols:
          mc = jnp.max(s, axis=0)
          lc = jnp.sum(jnp.exp(s - _math.safe_max(mc)[None, :]), axis=0)
          out = (mc, lc)
        return row_stats, out

      init = (jnp.full((bq,), neg, F32), jnp.zeros((bq,), F32))
      init = _axes.vary_like(init, x, y, scale, bias)
      (rm, rl), tile_cols = lax.scan(col_block, init, (yb, col_valid, gyb))
      if cols:
        col_stats = _math.merge_stats(*col_stats, *tile_cols)
      return col_stats, (_math.stats_to_lse(rm, rl) if rows else ())

    col_init = (jnp.full(yb.shape[:2], neg, F32), jnp.zeros(yb.shape[:2], F32))
    col_init = _axes.vary_like(col_init, x, y, scale, bias)
    (cm, cl), row_lse = lax.scan(row_block, col_init, (xb, row_valid, gxb))
    row_out = row_lse.reshape(-1)[:n] if rows else None
    col_out = _math.stats_to_lse(cm, cl).reshape(-1)[:m] if cols else None
    return row_out, col_out

  def _lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
                col_coef, *, bs, groups=None, positives=None):
    groups = _with_positives(groups, positives, y.shape[0])
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)
    a_r, a_c, norm = _math.unit_coefs(
        row_coef if row_lse is not None else None,
        col_coef if col_lse is not None else None)

    def tile_g(rb, kb, s, r_blk, c_blk, rel):
      del rb, kb
      g = jnp.zeros_like(s)
      if row_lse is not None:
        g = g + a_r * jnp.exp(s - r_blk[:, None])
      if col_lse is not None:
        g = g + a_c * jnp.exp(s - c_blk[None, :])
      # Related pairs are not in the LSEs (and a row of them only has LSE
      # -inf, whose exp(s - lse) would be NaN).
      return jnp.where(rel, 0.0, g) if groups is not None else g

    vec = lambda v: None if v is None else v.astype(F32)
    dx, dy, dsc, dbi = _grad_sweep(x, y, scale, bias, tile_g, bs=bs,
                                   prec=self.precision(bs, x.dtype, x.shape[-1]),
                                   row_vec=vec(row_lse), col_vec=vec(col_lse),
                                   groups=groups)
    return dx * (scale * norm), dy * (scale * norm), dsc * norm, dbi * norm

  # ------------------------------------------------------------ sigmoid

  def _sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, bs,
                   groups=None, group_mode="mask"):
    bq, bk, prec, (xb, row_valid), (yb, col_valid), scale, bias = self._sweep(
        x, y, scale, bias, bs)
    gxb, gyb = _group_blocks(groups, bq, bk, xb.shape[0], yb.shape[0])

    def row_block(total, inputs):
      rb, x_blk, rv, gx_blk = inputs

      def col_block(row_total, inputs):
        kb, y_blk, cv, gy_blk = inputs
        s = scale * _math.dot(x_blk, y_blk, ((1,), (1,)), prec) + bias
        rel = (gx_blk[:, None] == gy_blk[None, :]) if groups is not None else None
        pos, drop = _sigmoid_labels(rb, kb, bq, bk, has_diagonal, rel,
                                    group_mode)
        # -z * s: the positives contribute softplus(-s), the negatives
        # softplus(s), each on its own.
        u = jnp.where(pos, -s, s)
        keep = rv[:, None] & cv[None, :] & ~drop
        t = jnp.where(keep, _math.softplus(u), 0.0)
        return row_total + jnp.sum(t), None

      row_init = _axes.vary_like(jnp.zeros((), F32), total, x_blk)
      row_total, _ = lax.scan(col_block, row_init,
                              (jnp.arange(yb.shape[0]), yb, col_valid, gyb))
      return total + row_total, None

    init = _axes.vary_like(jnp.zeros((), F32), x, y, scale, bias)
    total, _ = lax.scan(row_block, init,
                        (jnp.arange(xb.shape[0]), xb, row_valid, gxb))
    return total

  def _sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal, bs,
                    groups=None, group_mode="mask"):
    n, m = x.shape[0], y.shape[0]
    bq, bk = min(bs.block_q, n), min(bs.block_k, m)
    coef = jnp.asarray(coef, F32)
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)

    def tile_g(rb, kb, s, r_blk, c_blk, rel):
      del r_blk, c_blk
      # (-z) * sigmoid(-z * s), in [-1, 1]; coef (~1/B) is applied after the
      # matmuls so that G stays well scaled.
      pos, drop = _sigmoid_labels(rb, kb, bq, bk, has_diagonal,
                                  rel if groups is not None else None,
                                  group_mode)
      g = jnp.where(pos, -jax.nn.sigmoid(-s), jax.nn.sigmoid(s))
      return jnp.where(drop, 0.0, g)

    prec = self.precision(bs, x.dtype, x.shape[-1])
    g_dtype = x.dtype if prec == lax.Precision.DEFAULT else F32
    dx, dy, dsc, dbi = _grad_sweep(
        x, y, scale, bias, tile_g, bs=bs, prec=prec,
        rescale=jnp.dtype(g_dtype) == jnp.float16, groups=groups)
    return dx * (scale * coef), dy * (scale * coef), dsc * coef, dbi * coef


BACKEND = XlaBackend
