"""Fused GPU kernels through Pallas' Triton lowering (``backend="pallas"``).

Both families, with the kernels of ``kernels/pallas/``:

* softmax ``lse``: one fused sweep (``kernels.pallas.lse_fwd``) gives row and
  column LSE together; no logit tile reaches HBM. The persistent programs'
  partial column statistics are merged in XLA.
* sigmoid ``sigmoid_sum``: one fused sweep (``kernels.pallas.sigmoid_fwd``)
  sums softplus(-z s) per row; XLA adds the rows.
* both gradients: the panel backward (``panel_backward``); per panel a kernel
  (``kernels.pallas.lse_bwd`` / ``kernels.pallas.sigmoid_bwd``) recomputes
  the logits once and writes G in the input dtype, and cuBLAS forms
  dx = G y and dy += G^T x.

The backend has these kernels (``KERNELS``); the tile ops around them
(padding, the int32 guard, the panel backward's layout, the precision
policy) and the block sizes that fit each GPU are ``triton_tiles``', the
same for the ``triton`` backend (the same algorithms in the Triton
language).

``groups=`` (``backends.base``): every kernel takes the rows' and columns'
group ids as a compile-time switch (an int compare and a select per logit);
without groups the kernels are unchanged (``triton_tiles``).

Measured on an H200 (B=65536, D=768, bf16, fwd+bwd): softmax 53 ms (forward
15 ms, panel kernel 18 ms, GEMMs 20 ms), sigmoid 57 ms
(https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#loss).

Precision: bf16 / f16 inputs run on the tensor cores with float32
accumulation. Softmax G is normalised so that its largest coefficient is 1;
a float16 sigmoid panel (|G| can be far below float16's range when the loss
is tiny) is first scanned for its largest |G| (a second recompute, float16
only) and stored divided by it. float32 inputs (``backends.precision``):
TF32 by default from D = 64 on (operands rounded to TF32, the positives
put back in float32 by the loss), 3-pass TF32 below it
(``DotAlgorithmPreset.TF32_TF32_F32_X3``: float32-accurate logits; also
``precision="high"``), IEEE float32 with ``precision="highest"`` or
``jax.default_matmul_precision("highest")``. Off the GPU the kernels run
with ``interpret=True`` (exact float32; slow, for tests).
"""
from __future__ import annotations

from jax import lax

from infcl_jax.backends import base
from infcl_jax.backends import triton_tiles
from infcl_jax.kernels.pallas import lse_bwd
from infcl_jax.kernels.pallas import lse_fwd
from infcl_jax.kernels.pallas import sigmoid_bwd
from infcl_jax.kernels.pallas import sigmoid_fwd


def kernel_precision(prec, interpret):
  """What the Pallas kernels take for ``prec``: Pallas' Triton lowering
  reads Precision.HIGH as plain TF32, and the 3-pass TF32 dot is an
  algorithm preset there. The interpreter's dot is exact float32 (and XLA's
  CPU dot takes no TF32 preset)."""
  if prec == lax.Precision.HIGH:
    return (lax.Precision.HIGHEST if interpret
            else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
  return prec


KERNELS = triton_tiles.Kernels(
    lse_fwd=lse_fwd.lse_fwd, lse_panel=lse_bwd.g_panel,
    sigmoid_rows=sigmoid_fwd.sigmoid_row_sums,
    sigmoid_panel=sigmoid_bwd.g_panel, takes_interpret=True,
    precision=kernel_precision)


class PallasBackend(base.KernelBackend):
  """The Pallas-Triton kernels, both families (their tile ops:
  ``triton_tiles.TritonTiles``)."""

  name = "pallas"
  RUNS_ON = triton_tiles.RUNS_ON
  KERNELS = KERNELS


BACKEND = PallasBackend
