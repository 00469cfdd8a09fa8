"""Fused GPU kernels through Pallas' Triton lowering (``backend="pallas"``).

Both families, with the kernels of ``infcl_jax.kernels``:

* softmax ``lse``: one fused sweep (``kernels.lse_fwd``) gives row and column
  LSE together; no logit tile reaches HBM. The persistent programs' partial
  column statistics are merged in XLA.
* sigmoid ``sigmoid_sum``: one fused sweep (``kernels.sigmoid_fwd``) sums
  softplus(-z s) per row; XLA adds the rows.
* both gradients: the panel backward (``panel_backward``); per panel a
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

import functools

import jax.numpy as jnp

from infcl_jax import _device
from infcl_jax.backends import capability
from infcl_jax.backends import kernel_backend
from infcl_jax.backends import panel_backward as pb
from infcl_jax.backends import triton_configs
from infcl_jax.backends.padding import check_int32
from infcl_jax.backends.padding import pad_inputs
from infcl_jax.kernels import lse_bwd
from infcl_jax.kernels import lse_fwd
from infcl_jax.kernels import sigmoid_bwd
from infcl_jax.kernels import sigmoid_fwd

F32 = jnp.float32


def _layout(bs, x, y):
  """The panel backward's layout for the Triton panel kernels' tiles."""
  return pb.panel_layout(x.shape[0], y.shape[0], x.shape[1],
                         block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
                         block_d=bs.block_d, panel_rows=bs.panel_rows)


class PallasTritonBackend(kernel_backend.KernelBackend):
  """The fused Pallas-Triton backend, softmax and sigmoid families."""

  name = "pallas"
  families = ("softmax", "sigmoid")
  # Tuned: every GPU from sm80 whose shared memory per block is known (the
  # configs fit it). Newer GPUs are untested; below sm80 Triton has no
  # bfloat16 dot.
  RUNS_ON = capability.RunsOn(
      tuned=tuple(cc for cc in capability.SMEM_PER_BLOCK if cc >= (8, 0)),
      floor=(8, 0), unknown_gpu=capability.UNTESTED,
      needs="an NVIDIA GPU of compute capability 8.0 or newer (Triton has "
            "no bfloat16 dot below)")

  def default_block_sizes(self, platform, dtype):
    """The ``triton_configs`` entry that fits this GPU's shared memory."""
    cc = capability.device_capability() if platform == "gpu" else None
    return triton_configs.default(platform, cc, dtype)

  # ------------------------------------------------------------ softmax

  def _lse(self, x, y, scale, bias, *, rows, cols, bs):
    n, m = x.shape[0], y.shape[0]
    xp, yp = pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    nprog = bs.num_programs or _device.num_sms()
    check_int32(self.name, column_workspace=min(
        nprog, xp.shape[0] // bs.block_q) * yp.shape[0])
    return lse_fwd.lse_fwd(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        rows=rows, cols=cols, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, num_programs=nprog, num_warps=bs.num_warps,
        num_stages=bs.num_stages, precision=self.precision(bs, x.dtype),
        interpret=self.interpret, single_exp=bs.single_exp)

  def _lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
                col_coef, *, bs):
    prec = self.precision(bs, x.dtype)
    panel = None if bs.bwd_impl == "xla" else functools.partial(
        lse_bwd.g_panel, g_dtype=x.dtype, block_q=bs.bwd_block_q,
        block_k=bs.bwd_block_k, block_d=bs.block_d,
        num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages,
        precision=prec, interpret=self.interpret, single_exp=bs.single_exp)
    return pb.softmax_grad(
        x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
        layout=_layout(bs, x, y),
        precision=prec, panel=panel)

  # ------------------------------------------------------------ sigmoid

  def _sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, bs):
    n, m = x.shape[0], y.shape[0]
    xp, yp = pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    rows = sigmoid_fwd.sigmoid_row_sums(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        has_diagonal=has_diagonal, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, target_programs=bs.num_programs or _device.num_sms(),
        num_warps=bs.num_warps, num_stages=bs.num_stages,
        precision=self.precision(bs, x.dtype), interpret=self.interpret)
    return jnp.sum(rows)

  def _sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal, bs):
    prec = self.precision(bs, x.dtype)

    def panel(x_p, yp, rid_p, params, mode, **kw):
      return sigmoid_bwd.g_panel(
          x_p, yp, rid_p, params, mode=mode, g_dtype=x.dtype,
          block_q=bs.bwd_block_q, block_k=bs.bwd_block_k, block_d=bs.block_d,
          num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages,
          precision=prec, interpret=self.interpret, **kw)

    return pb.sigmoid_grad(
        x, y, scale, bias, coef, has_diagonal=has_diagonal,
        layout=_layout(bs, x, y),
        precision=prec, panel=None if bs.bwd_impl == "xla" else panel)


BACKEND = PallasTritonBackend
