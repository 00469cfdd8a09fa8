"""Fused GPU kernels through Pallas' Triton lowering (``backend="pallas"``).

Both families, with the kernels of ``infcl_jax.kernels``:

* softmax ``lse``: one fused sweep (``kernels.pallas.lse_fwd``) gives row and
  column LSE together; no logit tile reaches HBM. The persistent programs'
  partial column statistics are merged in XLA.
* sigmoid ``sigmoid_sum``: one fused sweep (``kernels.pallas.sigmoid_fwd``)
  sums softplus(-z s) per row; XLA adds the rows.
* both gradients: the panel backward (``panel_backward``); per panel a kernel
  (``kernels.pallas.lse_bwd`` / ``kernels.pallas.sigmoid_bwd``) recomputes the
  logits once and writes G in the input dtype, and cuBLAS forms dx = G y and dy
  += G^T x.

The plumbing around the kernels is ``triton_tiles``, shared with the
``triton`` backend (the same algorithms in the Triton language).

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
only) and stored divided by it. float32 inputs (``backends.precision``): 3-pass TF32 by
default (``DotAlgorithmPreset.TF32_TF32_F32_X3``: float32-accurate
logits), TF32 with ``precision="default"`` (operands rounded to TF32, the
positives put back in float32 by the loss), IEEE float32 with
``precision="highest"`` or ``jax.default_matmul_precision("highest")``.
Off the GPU the kernels run with ``interpret=True`` (exact float32; slow,
for tests).
"""
from __future__ import annotations

from jax import lax

from infcl_jax.backends import triton_tiles
from infcl_jax.kernels.pallas import lse_bwd
from infcl_jax.kernels.pallas import lse_fwd
from infcl_jax.kernels.pallas import sigmoid_bwd
from infcl_jax.kernels.pallas import sigmoid_fwd

KERNELS = triton_tiles.Kernels(lse_fwd, lse_bwd, sigmoid_fwd, sigmoid_bwd)


class PallasBackend(triton_tiles.TritonTilesBackend):
  """The fused Pallas-Triton backend, softmax and sigmoid families."""

  name = "pallas"
  KERNELS = KERNELS

  def default_block_sizes(self, platform, dtype):
    """The ``triton_tiles.CONFIGS`` entry that fits this GPU."""
    return triton_tiles.default_here(platform, dtype)

  def _kernel_kw(self):
    return {"interpret": self.interpret}

  def _kernel_precision(self, prec):
    # Pallas' Triton lowering reads Precision.HIGH as plain TF32; the
    # 3-pass TF32 dot is an algorithm preset there. The interpreter's dot
    # is exact float32 (and XLA's CPU dot takes no TF32 preset).
    if prec == lax.Precision.HIGH:
      return (lax.Precision.HIGHEST if self.interpret
              else lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
    return prec


BACKEND = PallasBackend
