"""Fused GPU kernels through Pallas' Triton lowering (``backend="pallas"``).

Both families, with the kernels of ``infcl_jax.kernels``:

* softmax ``lse``: one fused sweep (``kernels.lse_fwd``) gives row and column
  LSE together; no logit tile reaches HBM. The persistent programs' partial
  column statistics are merged in XLA.
* sigmoid ``sigmoid_sum``: one fused sweep (``kernels.sigmoid_fwd``) sums
  softplus(-z s) per row; XLA adds the rows.
* both gradients: the panel backward of ``kernel_plumbing``; per panel a
  kernel (``kernels.lse_bwd`` / ``kernels.sigmoid_bwd``) recomputes the
  logits once and writes G in the input dtype, and cuBLAS forms dx = G y and
  dy += G^T x.

Measured on an H200 (B=65536, D=768, bf16, fwd+bwd): softmax 53 ms (forward
15 ms, panel kernel 18 ms, GEMMs 20 ms), sigmoid 57 ms; see BENCHMARKS.md.

Precision: bf16 / f16 inputs run on the tensor cores with float32
accumulation. Softmax G is normalised so that its largest coefficient is 1;
a float16 sigmoid panel (|G| can be far below float16's range when the loss
is tiny) is first scanned for its largest |G| (a second recompute, float16
only) and stored divided by it. float32 inputs use TF32 matmuls by default,
like XLA's own float32 GEMMs on the GPU (~1e-3 relative on the logits);
``BlockSizes(f32_precision="highest")`` or
``jax.default_matmul_precision("highest")`` keeps full float32. Off the GPU
the kernels run with ``interpret=True`` (exact float32; slow, for tests).
"""
from __future__ import annotations

import jax.numpy as jnp

from infcl_jax import _math
from infcl_jax.backends import kernel_plumbing as kp
from infcl_jax.backends.xla import check_diagonal
from infcl_jax.kernels import lse_bwd
from infcl_jax.kernels import lse_fwd
from infcl_jax.kernels import sigmoid_bwd
from infcl_jax.kernels import sigmoid_fwd

F32 = jnp.float32


class PallasTritonBackend(kp.KernelBackend):
  """The fused Pallas-Triton backend, softmax and sigmoid families."""

  name = "pallas"
  families = ("softmax", "sigmoid")

  # ------------------------------------------------------------ softmax

  def lse(self, x, y, scale, bias, *, rows, cols, block_sizes=None):
    if not (rows or cols):
      return None, None
    bs = self._block_sizes(block_sizes, x.dtype)
    n, m = x.shape[0], y.shape[0]
    xp, yp = kp.pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    nprog = bs.num_programs or kp.num_sms()
    kp.check_int32(self.name, column_workspace=min(
        nprog, xp.shape[0] // bs.block_q) * yp.shape[0])
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
    layout = kp.panel_layout(bs, n, m, d)
    # Base-2 statistics, +inf on padding; an unused direction gets zeros
    # (its exp term is compiled out) but keeps +inf on padding for masking.
    r2 = (row_lse.astype(F32) * _math.LOG2E) if rows else jnp.zeros((n,), F32)
    c2 = (col_lse.astype(F32) * _math.LOG2E) if cols else jnp.zeros((m,), F32)
    r2 = kp.pad1(r2, layout.n_pad, jnp.inf)
    c2 = kp.pad1(c2, layout.m_pad, jnp.inf)
    params = jnp.stack([scale * _math.LOG2E, bias * _math.LOG2E,
                        row_coef / norm, col_coef / norm]).astype(F32)
    mask = layout.n_pad != n or layout.m_pad != m

    def g_panel(x_p, yp, r_p):
      if bs.bwd_impl == "xla":
        g, dsc, dbi = _xla_softmax_panel(x_p, yp, r_p, c2, params, rows, cols,
                                         mask, x.dtype, prec)
      else:
        g, dsc, dbi = lse_bwd.g_panel(
            x_p, yp, r_p, c2, params, rows=rows, cols=cols, mask=mask,
            g_dtype=x.dtype, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
            block_d=bs.block_d, num_warps=bs.bwd_num_warps,
            num_stages=bs.bwd_num_stages, precision=prec,
            interpret=self.interpret, single_exp=bs.single_exp)
      return g, jnp.ones((), F32), dsc, dbi

    dx, dy, dsc, dbi = kp.panel_backward(
        x, y, r2, g_panel, layout=layout, precision=prec,
        refs=(c2, params))
    return dx * (scale * norm), dy * (scale * norm), dsc * norm, dbi * norm

  # ------------------------------------------------------------ sigmoid

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, block_sizes=None):
    """sum_ij softplus(-z_ij * s_ij) over the block pair, float32 scalar."""
    n, m = x.shape[0], y.shape[0]
    check_diagonal(has_diagonal, n, m)
    bs = self._block_sizes(block_sizes, x.dtype)
    xp, yp = kp.pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    rows = sigmoid_fwd.sigmoid_row_sums(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        has_diagonal=has_diagonal, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, target_programs=bs.num_programs or kp.num_sms(),
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
    check_diagonal(has_diagonal, n, m)
    bs = self._block_sizes(block_sizes, x.dtype)
    scale = jnp.asarray(scale, F32)
    bias = jnp.asarray(bias, F32)
    coef = jnp.asarray(coef, F32)
    prec = self._precision(bs, x.dtype)
    rescale = jnp.dtype(x.dtype) == jnp.float16
    layout = kp.panel_layout(bs, n, m, d)
    ids = jnp.arange(layout.n_pad, dtype=jnp.int32)
    row_ids = jnp.where(ids < n, ids, -1)
    kw = dict(m=m, mask=layout.n_pad != n or layout.m_pad != m,
              has_diagonal=has_diagonal, g_dtype=x.dtype, scaled=rescale,
              block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
              block_d=bs.block_d, num_warps=bs.bwd_num_warps,
              num_stages=bs.bwd_num_stages, precision=prec,
              interpret=self.interpret)

    def g_panel(x_p, yp, rid_p):
      if bs.bwd_impl == "xla":
        return _xla_sigmoid_panel(x_p, yp, rid_p, scale, bias, m, has_diagonal,
                                  x.dtype, rescale, prec)
      g_max = jnp.ones((), F32)
      if rescale:
        params = jnp.stack([scale, bias, 1.0, 0.0]).astype(F32)
        g_max = kp.usable_max(sigmoid_bwd.g_panel(x_p, yp, rid_p, params,
                                                  mode="max", **kw))
      params = jnp.stack([scale, bias, 1.0 / g_max, 0.0]).astype(F32)
      g, dsc, dbi = sigmoid_bwd.g_panel(x_p, yp, rid_p, params, mode="g", **kw)
      return g, g_max, dsc, dbi

    dx, dy, dsc, dbi = kp.panel_backward(
        x, y, row_ids, g_panel, layout=layout, precision=prec,
        refs=(scale, bias))
    return dx * (scale * coef), dy * (scale * coef), dsc * coef, dbi * coef


# ``bwd_impl="xla"``: the same panels from XLA's GEMM and a fusion. They
# materialise the (R, B) float32 logits of a panel (more memory and HBM
# traffic than the kernels) and are kept to measure the difference.

def _xla_softmax_panel(x_p, yp, r2, c2, params, rows, cols, mask, g_dtype,
                       prec):
  s0 = kp.dot(x_p, yp, ((1,), (1,)), prec)
  s = s0 * params[0] + params[1]
  g = jnp.zeros_like(s)
  if rows:
    g = g + params[2] * jnp.exp2(s - r2[:, None])
  if cols:
    g = g + params[3] * jnp.exp2(s - c2[None, :])
  if mask:
    g = jnp.where((r2 != jnp.inf)[:, None] & (c2 != jnp.inf)[None, :], g, 0.0)
  return g.astype(g_dtype), jnp.sum(g * s0), jnp.sum(g)


def _xla_sigmoid_panel(x_p, yp, rid, scale, bias, m, has_diagonal, g_dtype,
                       rescale, prec):
  s0 = kp.dot(x_p, yp, ((1,), (1,)), prec)
  s = s0 * scale + bias
  cid = jnp.arange(yp.shape[0], dtype=jnp.int32)
  g = 1.0 / (1.0 + jnp.exp(-s))
  if has_diagonal:
    pos = rid[:, None] == cid[None, :]
    g = jnp.where(pos, -1.0 / (1.0 + jnp.exp(s)), g)
  g = jnp.where((rid >= 0)[:, None] & (cid < m)[None, :], g, 0.0)
  g_max = kp.usable_max(jnp.max(jnp.abs(g))) if rescale else jnp.ones((), F32)
  return (g / g_max).astype(g_dtype), g_max, jnp.sum(g * s0), jnp.sum(g)


BACKEND = PallasTritonBackend
