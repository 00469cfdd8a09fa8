"""The Pallas-Triton backend's tuning: the block sizes that fit each GPU.

``default(platform, capability, dtype)`` is what ``backend="pallas"`` (and
the Mosaic backend's Triton path) runs without a ``BlockSizes``: on a GPU
the ``TRITON_CONFIGS`` entry that fits its shared memory per block, off the
GPU small tiles for the interpreter (tests).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from infcl_jax.backends.capability import smem_limit
from infcl_jax.block_sizes import BlockSizes

# ---------------------------------------------------------------------------
# Shared memory of the Triton kernels, and the configs that fit each GPU.
#
# Every Pallas-Triton kernel here (kernels/pallas/lse_fwd.py, lse_bwd.py,
# sigmoid_fwd.py, sigmoid_bwd.py) starts from ``tile_dot``: a K-loop over D
# in ``block_d`` steps that loads a (block_q, block_d) slice of x and a
# (block_k, block_d) slice of y and feeds them to one tensor-core dot.
# Triton's software pipeliner keeps up to ``num_stages`` copies of both
# slices in shared memory (cp.async / TMA prefetch; on sm80 it needs
# num_stages - 1, on sm90 with wgmma num_stages), so the K-loop holds
#
#     pipeline = num_stages * (block_q + block_k) * block_d * itemsize
#
# (128 x 256 tiles, block_d 64, 3 stages, bf16: 147,456 B). After the loop
# (the "epilogue") the kernels need shared memory only as scratch:
#
# * forward (lse_fwd, sigmoid_fwd): the row / column reductions of the
#   float32 tile (max, sum), one at a time; a reduction across warps stages
#   at most one float32 per warp and reduced lane:
#   ``num_warps * max(block_q, block_k) * 4``. The 1-D statistics' layout
#   changes (block_k floats) are smaller.
# * backward (lse_bwd, sigmoid_bwd): the same reductions (the scale / bias
#   partial sums), plus the (bwd_block_q, bwd_block_k) tile of G converted
#   from the dot's register layout to a coalesced one for the store, at
#   most the whole tile in the input dtype:
#   ``bwd_block_q * bwd_block_k * itemsize``.
#
# Triton's shared-memory allocator is liveness-based: the K-loop's buffers
# are dead once the loop ends, so the epilogue scratch reuses them and the
# kernel needs ``peak = max(pipeline, epilogue)``. ``total = pipeline +
# epilogue`` is the bound if nothing were reused. The configs for GPUs we
# could not test (sm80, sm86/sm89/sm12x) fit their limit by ``total``, so
# they do not depend on the reuse; the H200 configs fit 227 KB by ``peak``
# (bf16 also by ``total``) and are compiled and measured there.
#
# Checked against the compiler: XLA logs the shared memory of each Triton
# kernel it compiles. On the H200 (jax 0.11.2) every bf16 kernel of every
# config below used exactly ``pipeline`` bytes (the G tile's staging reuses
# the K-loop buffers), and every float32 kernel at most ``peak``
# (https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#pallas-configs-for-smaller-gpus).
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SmemEstimate:
  """Shared memory of one Triton kernel, in bytes (see the notes above)."""
  pipeline: int  # the K-loop's multi-buffered x and y slices
  epilogue: int  # scratch after the K-loop (reductions, the G tile store)

  @property
  def peak(self) -> int:
    """What a liveness-based allocator needs (epilogue reuses the buffers)."""
    return max(self.pipeline, self.epilogue)

  @property
  def total(self) -> int:
    """The bound without any reuse."""
    return self.pipeline + self.epilogue


def triton_smem(bs: BlockSizes, dtype, kernel: str) -> SmemEstimate:
  """Shared memory of the forward (``kernel="fwd"``) or the backward panel
  (``"bwd"``) kernel of either family, with block sizes ``bs`` and inputs
  of ``dtype``."""
  isz = np.dtype(dtype).itemsize
  if kernel == "fwd":
    bq, bk, stages, warps = bs.block_q, bs.block_k, bs.num_stages, bs.num_warps
    epilogue = warps * max(bq, bk) * 4
  elif kernel == "bwd":
    bq, bk = bs.bwd_block_q, bs.bwd_block_k
    stages, warps = bs.bwd_num_stages, bs.bwd_num_warps
    epilogue = bq * bk * isz + warps * max(bq, bk) * 4
  else:
    raise ValueError(f"kernel must be 'fwd' or 'bwd', got {kernel!r}")
  return SmemEstimate(stages * (bq + bk) * bs.block_d * isz, epilogue)


# name -> (the smallest per-block limit it is meant for, bf16/f16 config,
# float32 config). The bf16 configs of sm80 and sm86 are the faster on the
# H200 of two candidates each, both exact there at B = 4096 (the other and
# the times: https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#pallas-configs-for-smaller-gpus).
TRITON_CONFIGS = {
    # H200 (sm90), B200 (sm100): 227 KB. 128 x 256 tiles, K-step 64, 3
    # stages: ~600 TFLOP/s for a flash-style LSE pass on the H200. float32
    # tiles take twice the bytes per stage, so K-step 32, and a smaller
    # panel keeps the float32 G panel at the same size in bytes. 128 x 256
    # beat 128 x 128 for float32 too (H200, B=65536: forward 43 vs 55 ms,
    # probability panels 46 vs 53 ms).
    "smem227k": (227 * 1024,
                 BlockSizes(block_q=128, block_k=256, block_d=64,
                            panel_rows=4096),
                 BlockSizes(block_q=128, block_k=256, block_d=32,
                            num_stages=3, bwd_block_q=128, bwd_block_k=256,
                            panel_rows=2048)),
    # A100 (sm80), Orin (sm87): 163 KB. The H200 forward (152 KB total)
    # and a 128 x 128 backward (132 KB total). On the H200 (B=65536, D=768,
    # bf16, fwd+bwd) it costs 1.00x (softmax) / 1.04x (sigmoid) the H200
    # configs; K-step 32 with 128 x 256 everywhere was 1.05x / 1.05x.
    # float32: the H200 forward and a 128 x 128 backward with 2 stages
    # (132 KB total).
    "smem163k": (163 * 1024,
                 BlockSizes(block_q=128, block_k=256, block_d=64,
                            num_stages=3, bwd_block_q=128, bwd_block_k=128,
                            bwd_num_stages=3, panel_rows=4096),
                 BlockSizes(block_q=128, block_k=256, block_d=32,
                            num_stages=3, bwd_block_q=128, bwd_block_k=128,
                            bwd_num_stages=2, panel_rows=2048)),
    # A10 / RTX 30xx (sm86), L4 / RTX 40xx (sm89), RTX 50xx (sm120): 99 KB.
    # 128 x 128 tiles, K-step 32, 4 warps: forward 4 stages (66 KB total),
    # backward 3 (82 KB total). On the H200 1.21x (softmax) / 1.17x
    # (sigmoid) the H200 configs; 8 warps was 1.22x / 1.21x. float32:
    # forward 2 stages (68 KB), backward 64 x 128 with 2 stages (84 KB).
    "smem99k": (99 * 1024,
                BlockSizes(block_q=128, block_k=128, block_d=32,
                           num_warps=4, num_stages=4, bwd_block_q=128,
                           bwd_block_k=128, bwd_num_warps=4,
                           bwd_num_stages=3, panel_rows=4096),
                BlockSizes(block_q=128, block_k=128, block_d=32,
                           num_stages=2, bwd_block_q=64, bwd_block_k=128,
                           bwd_num_stages=2, panel_rows=2048)),
}


def config_name(table, capability) -> str:
  """The largest entry of ``table`` (name -> (limit, ...)) whose limit the
  GPU meets.

  Unknown capabilities get the H200 configs (``"smem227k"``); a GPU below
  every limit gets the smallest (best effort: Triton may still reject it).
  """
  limit = smem_limit(capability)
  if limit is None:
    return "smem227k"
  fitting = [(v[0], name) for name, v in table.items() if v[0] <= limit]
  if not fitting:
    return min((v[0], name) for name, v in table.items())[1]
  return max(fitting)[1]


def triton_config_name(capability) -> str:
  """The ``TRITON_CONFIGS`` entry of a GPU (``config_name``)."""
  return config_name(TRITON_CONFIGS, capability)


def triton_config(capability, dtype) -> BlockSizes:
  """The Pallas-Triton default ``BlockSizes`` for a GPU and input dtype."""
  _, narrow, wide = TRITON_CONFIGS[triton_config_name(capability)]
  return wide if dtype is not None and np.dtype(dtype).itemsize >= 4 else narrow


# Off the GPU the kernels run in the interpreter, for tests: small tiles keep
# it quick and still give several blocks, programs and panels.
INTERPRET = BlockSizes(block_q=32, block_k=32, block_d=32, num_programs=2,
                       bwd_block_q=32, bwd_block_k=32, panel_rows=64)


def default(platform, capability, dtype) -> BlockSizes:
  """The default ``BlockSizes`` of the Triton kernels here."""
  if platform != "gpu":
    return INTERPRET
  return triton_config(capability, dtype)
