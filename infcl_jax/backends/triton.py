"""Kernels in the Triton language through jax-triton (``backend="triton"``).

Both families, with the kernels of ``kernels/triton/`` (the algorithms of
the Pallas-Triton backend, written against ``triton.language`` and
launched by ``jax_triton.triton_call``). The backend has these kernels
(``KERNELS``); the tile ops around them are ``triton_tiles``' (padding, the
int32 guard, the panel backward and its GEMMs, the precision policy, the
block sizes that fit each GPU), the same for the ``pallas`` backend:

* softmax ``lse``: one fused persistent sweep gives row and column LSE.
* sigmoid ``sigmoid_sum``: one fused sweep sums softplus(-z s) per row.
* both gradients: the panel backward; per panel a kernel recomputes the
  logits once and writes G in the input dtype, cuBLAS forms dx and dy.

``groups=`` (``backends.base``): every kernel takes the rows' and columns'
group ids as a compile-time switch (an int compare and a select per logit);
without groups the kernels are unchanged (``triton_tiles``).

It needs neither Pallas nor its Triton lowering (deprecated in jax 0.11 /
0.12), so it keeps the non-Hopper GPUs on fused kernels if that lowering
goes.

Where it runs (``RUNS_ON``): NVIDIA GPUs of compute capability 8.0 and up
whose shared memory per block is known (sm80, sm86, sm87, sm89, sm90,
sm100, sm103, sm120, sm121), with the block sizes of
``triton_tiles.CONFIGS`` for that budget; newer or unreadable GPUs are
UNTESTED (an explicit name runs, ``auto`` does not pick it); below sm80
Triton has no bfloat16 dot.

On the H200 (jax 0.11.2, triton 3.6, jax-triton 0.3.1) it is exact against
float64 (the Pallas contract's GPU tests, the ring on one device, B past
2^31 elements) and faster than Pallas-Triton in one job (B = 65,536,
D = 768, fwd+bwd): softmax bf16 51.5 vs 53.4 ms, sigmoid bf16 50.4 vs
57.1 ms, softmax float32 107.0 vs 140.1 ms. So ``auto`` picks it on every
non-Hopper GPU it supports where the extra is installed
(``registry.AUTO_ORDER``; sm90 keeps Mosaic). Other GPUs are covered
ahead of time: every kernel compiles for sm80, sm86, sm89, sm90 and sm100
in CI (shared memory within each GPU's limit, no register spills).

Precision (``backends.precision``): bf16 / f16 on the tensor cores with
float32 accumulation. float32 inputs: TF32 by default from D = 64 on, 3-pass
TF32 below it (``tl.dot(input_precision="tf32x3")``, float32-accurate logits;
also ``precision="high"``); TF32 runs on operands rounded to nearest TF32
first (Triton's TF32 dot truncates them: products ~1e-3 small on average,
which put the loss 3.2e-3 to 1.1e-2 off float64 on trained-looking inputs on
the H200; rounded, a float64 model of TF32 gives ~2e-4 on the same cases),
``precision="highest"`` IEEE float32.

Requirements: the ``triton`` extra (``pip install "infcl-jax[triton]"``:
``triton`` and ``jax-triton``); without it this module does not import and
``registry.available("triton", ...)`` is False. Off the GPU the kernels run
in Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the
environment before the first use of this backend (exact, slow; for tests).

``vmap`` runs a batch of problems one after another (``kernels.triton
.launch``); inside ``shard_map`` the kernels' outputs are typed
device-varying like their inputs.
"""
from __future__ import annotations

import jax

from infcl_jax.backends import base
from infcl_jax.backends import triton_tiles

EXTRA = 'pip install "infcl-jax[triton]"'


def _require(module):
  try:
    __import__(module)
  except ImportError as e:
    raise ImportError(
        f"backend='triton' needs the triton extra ({EXTRA}): {e}") from None


_require("triton")
if jax.default_backend() == "gpu":
  _require("jax_triton")

# pylint: disable=g-import-not-at-top,wrong-import-position
from infcl_jax.kernels.triton import launch
from infcl_jax.kernels.triton import lse_bwd
from infcl_jax.kernels.triton import lse_fwd
from infcl_jax.kernels.triton import sigmoid_bwd
from infcl_jax.kernels.triton import sigmoid_fwd

KERNELS = triton_tiles.Kernels(
    lse_fwd=lse_fwd.lse_fwd, lse_panel=lse_bwd.g_panel,
    sigmoid_rows=sigmoid_fwd.sigmoid_row_sums,
    sigmoid_panel=sigmoid_bwd.g_panel)


class TritonBackend(base.KernelBackend):
  """Triton-language kernels through jax-triton, both families (their tile
  ops: ``triton_tiles.TritonTiles``)."""

  name = "triton"
  RUNS_ON = triton_tiles.RUNS_ON
  KERNELS = KERNELS

  def block_sizes(self, block_sizes, dtype):
    if self.interpret and not launch.interpreting():
      raise ValueError(
          f"backend='triton' on platform {self.platform!r} runs its kernels "
          f"in Triton's interpreter, which needs TRITON_INTERPRET=1 in the "
          f"environment before the backend is first used; or use "
          f"backend='xla'")
    return super().block_sizes(block_sizes, dtype)


BACKEND = TritonBackend
