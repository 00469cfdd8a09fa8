"""Pallas backend of the sigmoid (SigLIP) tile family (``backend="pallas"``).

Implements ``sigmoid_sum`` and ``sigmoid_grad`` of ``infcl_jax.tile_backend``
with the kernels ``kernels.sigmoid_fwd`` and ``kernels.sigmoid_bwd``, on the
same plan as the softmax Pallas backend (``pallas_tiles``):

* ``sigmoid_sum``: one fused Pallas sweep computes every logit tile on chip
  and sums softplus(-z s) per row; XLA adds the rows. Nothing of size B^2
  reaches HBM.
* ``sigmoid_grad``: a hybrid over panels of ``panel_rows`` rows. Per panel
  a Pallas kernel recomputes the logits once and writes the gradient panel
  G = (-z) sigmoid(-z s) in the input dtype, with the scale and bias
  partial sums; the library GEMMs then form dx = G y and dy += G^T x.

``BlockSizes`` fields mean what they mean for the softmax backend, and the
defaults are the same; ``num_programs`` (None: one per SM) is the forward's
target grid size, reached by splitting the columns when there are fewer
row blocks than that (a ring shard of a few thousand rows).

The positives are the *global* diagonal of the block pair (``has_diagonal``),
located by global row / column indices, so it crosses tile and panel borders
correctly. B and D are zero-padded to the block sizes and the kernels mask
the padding (a zero row's logit is the bias, not a neutral value).

Precision: bf16 / f16 inputs run on the tensor cores with float32
accumulation; every term and sum is float32. G lies in [-1, 1] and coef
(~1/B) is applied after the GEMMs. bfloat16 has float32's exponent range, so
tiny |G| survive the cast; float16 does not (below ~6e-8 it flushes to 0),
so a float16 panel is first scanned for its largest |G| (``mode="max"``,
a second recompute of the panel's logits, float16 only) and G is stored
divided by it. float32 inputs use TF32 matmuls by default
(``BlockSizes.f32_precision``), as in ``pallas_tiles``. On a CPU the kernels
run with ``interpret=True`` (slow, for tests).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import pallas_common
from infcl_jax import tile_backend
from infcl_jax.kernels import sigmoid_bwd
from infcl_jax.kernels import sigmoid_fwd
from infcl_jax.pallas_common import dot as _dot
from infcl_jax.pallas_common import num_sms as _num_sms
from infcl_jax.pallas_common import pad2 as _pad2
from infcl_jax.pallas_common import panel_rows as _panel_rows
from infcl_jax.pallas_common import round_up as _round_up
from infcl_jax.xla_sigmoid_tiles import _check_diagonal

F32 = jnp.float32


class PallasSigmoidTiles(pallas_common.PallasBackend):
  """The fused Pallas backend (``backend="pallas"``), sigmoid family."""

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, block_sizes=None):
    """sum_ij softplus(-z_ij * s_ij) over the block pair, float32 scalar."""
    n, d = x.shape
    m = y.shape[0]
    _check_diagonal(has_diagonal, n, m)
    bs = self._block_sizes(block_sizes, x.dtype)
    d_pad = _round_up(d, bs.block_d)
    xp = _pad2(x, _round_up(n, bs.block_q), d_pad)
    yp = _pad2(y, _round_up(m, bs.block_k), d_pad)
    rows = sigmoid_fwd.sigmoid_row_sums(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        has_diagonal=has_diagonal, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, target_programs=bs.num_programs or _num_sms(),
        num_warps=bs.num_warps, num_stages=bs.num_stages,
        precision=self._precision(bs, x.dtype), interpret=self.interpret)
    return jnp.sum(rows)

  def sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal,
                   block_sizes=None):
    """(dx, dy, dscale, dbias) of ``coef * sigmoid_sum``, all float32.

    The tile gradient is G_ij = coef * (-z_ij) * sigmoid(-z_ij * s_ij).
    """
    n, d = x.shape
    m = y.shape[0]
    _check_diagonal(has_diagonal, n, m)
    bs = self._block_sizes(block_sizes, x.dtype)
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)
    coef = jnp.asarray(coef, F32)
    prec = self._precision(bs, x.dtype)
    g_dtype = x.dtype
    rescale = jnp.dtype(g_dtype) == jnp.float16

    d_pad = _round_up(d, bs.block_d)
    m_pad = _round_up(m, bs.bwd_block_k)
    r_rows, n_panels = _panel_rows(bs, n, m_pad)
    n_pad = r_rows * n_panels
    xp = _pad2(x, n_pad, d_pad)
    yp = _pad2(y, m_pad, d_pad)
    ids = jnp.arange(n_pad, dtype=jnp.int32)
    row_ids = jnp.where(ids < n, ids, -1)
    mask = n_pad != n or m_pad != m
    kw = dict(m=m, mask=mask, has_diagonal=has_diagonal, g_dtype=g_dtype,
              scaled=rescale,
              block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
              block_d=bs.block_d, num_warps=bs.bwd_num_warps,
              num_stages=bs.bwd_num_stages, precision=prec,
              interpret=self.interpret)

    def panel(carry, inputs):
      dy, dsc, dbi = carry
      x_p, rid_p = inputs
      if bs.bwd_impl == "xla":
        g, g_max, dsc_p, dbi_p = _xla_g_panel(
            x_p, yp, rid_p, scale, bias, m, has_diagonal, g_dtype, rescale,
            prec)
      else:
        g_max = jnp.ones((), F32)
        if rescale:
          params = jnp.stack([scale, bias, 1.0, 0.0]).astype(F32)
          g_max = _usable_max(sigmoid_bwd.g_panel(x_p, yp, rid_p, params,
                                                  mode="max", **kw))
        params = jnp.stack([scale, bias, 1.0 / g_max, 0.0]).astype(F32)
        g, dsc_p, dbi_p = sigmoid_bwd.g_panel(x_p, yp, rid_p, params,
                                              mode="g", **kw)
      dx_p = _dot(g, yp, ((1,), (0,)), prec) * g_max
      dy = dy + _dot(g, x_p, ((0,), (0,)), prec) * g_max
      return (dy, dsc + dsc_p, dbi + dbi_p), dx_p

    init = (jnp.zeros((m_pad, d_pad), F32), jnp.zeros((), F32),
            jnp.zeros((), F32))
    # Inside shard_map a constant carry must be typed device-varying like
    # the inputs, or lax.scan rejects it (see tile_backend.vary_like).
    init = tile_backend.vary_like(init, x, y, scale, bias)
    (dy, dsc, dbi), dx = lax.scan(
        panel, init, (xp.reshape(n_panels, r_rows, d_pad),
                      row_ids.reshape(n_panels, r_rows)))
    dx = dx.reshape(n_pad, d_pad)[:n, :d] * (scale * coef)
    dy = dy[:m, :d] * (scale * coef)
    return dx, dy, dsc * coef, dbi * coef


def _usable_max(g_max):
  """The divisor of a float16 panel: its max |G|, or 1 if that is 0 / NaN.

  |G| <= 1, so dividing never overflows. An all-zero (or all-padding) panel
  keeps 1; a NaN panel keeps 1 too, and its NaN G still reaches the result.
  """
  return jnp.where((g_max > 0) & jnp.isfinite(g_max), g_max, 1.0).astype(F32)


def _xla_g_panel(x_p, yp, rid, scale, bias, m, has_diagonal, g_dtype,
                 rescale, prec):
  """``bwd_impl="xla"``: the same panel from XLA's GEMM + a fusion.

  Materialises the (R, B) float32 logits of the panel: more memory and HBM
  traffic than the Pallas kernel; kept to measure the difference.
  """
  s0 = _dot(x_p, yp, ((1,), (1,)), prec)
  s = s0 * scale + bias
  cid = jnp.arange(yp.shape[0], dtype=jnp.int32)
  g = jax.nn.sigmoid(s)
  if has_diagonal:
    pos = rid[:, None] == cid[None, :]
    g = jnp.where(pos, -jax.nn.sigmoid(-s), g)
  g = jnp.where((rid >= 0)[:, None] & (cid < m)[None, :], g, 0.0)
  g_max = _usable_max(jnp.max(jnp.abs(g))) if rescale else jnp.ones((), F32)
  return (g / g_max).astype(g_dtype), g_max, jnp.sum(g * s0), jnp.sum(g)


tile_backend.register("pallas", PallasSigmoidTiles, family="sigmoid")
