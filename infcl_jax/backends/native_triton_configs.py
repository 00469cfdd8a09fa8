"""The ``triton`` backend's tuning: the block sizes that fit each GPU.

The Triton-language kernels (``kernels/triton/``) have the structure of the
Pallas-Triton ones: a K-loop over D whose x and y slices Triton's pipeliner
keeps in ``num_stages`` shared-memory buffers, then an epilogue that needs
shared memory only as scratch (reductions; in the backward the G tile's
layout change for the store). So the same shared-memory estimate applies
(``triton_configs.triton_smem``, whose notes derive it), against the
per-block limits of ``capability.SMEM_PER_BLOCK``:

* A100 / A30 (sm80), Orin (sm87): 163 KB ("smem163k");
* A10 / RTX 30xx (sm86), L4 / L40 / RTX 40xx (sm89), RTX 50xx (sm120):
  99 KB ("smem99k");
* H100 / H200 (sm90), B200 / B300 (sm100 / sm103): 227 KB ("smem227k").

Registers: the float32 logit tile lives in registers across the K-loop,
``block_q * block_k / (32 * num_warps)`` per thread, and the epilogue's
exponentials need about as many again for a moment; ``REG_BUDGET`` (128 of
the 255 a thread may have) keeps the tile from spilling (a fully fused dX
kernel with three 256-wide accumulators spilled on the H200:
``panel_backward``).

The entries are the Pallas-Triton ones: same tiles, same budget. On the
H200 the 227 KB entry is exact and at least as fast as Pallas-Triton's
(https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#loss); the sigmoid's gap was its
softplus (``kernels/triton/common.py``), not the tiles: of the forward
variants probed on the H200 (4 warps, 4 stages, 128-wide tiles) none was
faster, 4 warps 10x slower; the backward variants were not probed. Every
entry fits its limit by the no-reuse bound (``SmemEstimate.total``) and the
register budget, which the project's CPU tests check for every GPU kind,
and its CI compiles every kernel with them for sm80,
sm86, sm89, sm90 and sm100 and checks Triton's own figures: shared memory
within the limit (sm80 96 KB, sm86 / sm89 48 KB, sm90 / sm100 144 KB for
bf16), no spills (ptxas gives most kernels all 255 registers a thread may
have, and needs no local memory).
"""
from __future__ import annotations

import numpy as np

from infcl_jax.backends import capability
from infcl_jax.backends import triton_configs
from infcl_jax.block_sizes import BlockSizes

# 32-bit registers per thread the logit tile may take (see above).
REG_BUDGET = 128

# name -> (the smallest per-block limit it is meant for, bf16/f16 config,
# float32 config).
CONFIGS: dict[str, tuple[int, BlockSizes, BlockSizes]] = dict(
    triton_configs.TRITON_CONFIGS)


def tile_registers(bs: BlockSizes, kernel: str) -> int:
  """32-bit registers per thread of the float32 logit tile of the forward
  (``"fwd"``) or backward (``"bwd"``) kernel."""
  if kernel == "fwd":
    return bs.block_q * bs.block_k // (32 * bs.num_warps)
  if kernel == "bwd":
    return bs.bwd_block_q * bs.bwd_block_k // (32 * bs.bwd_num_warps)
  raise ValueError(f"kernel must be 'fwd' or 'bwd', got {kernel!r}")


def config_name(capability) -> str:
  """The ``CONFIGS`` entry of a GPU: the largest whose limit it meets."""
  return triton_configs.config_name(CONFIGS, capability)


def config(capability, dtype) -> BlockSizes:
  """The default ``BlockSizes`` of the ``triton`` backend on a GPU."""
  _, narrow, wide = CONFIGS[config_name(capability)]
  return wide if dtype is not None and np.dtype(dtype).itemsize >= 4 else narrow


def default(platform, capability, dtype) -> BlockSizes:
  """The default ``BlockSizes`` here; off the GPU (Triton's interpreter)
  the small tiles of ``triton_configs.INTERPRET``."""
  if platform != "gpu":
    return triton_configs.INTERPRET
  return config(capability, dtype)


def default_here(platform, dtype) -> BlockSizes:
  """``default`` for the first device of ``platform`` (what the backend's
  ``default_block_sizes`` returns)."""
  cc = capability.device_capability() if platform == "gpu" else None
  return default(platform, cc, dtype)
