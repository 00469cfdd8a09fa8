"""Tile sizes and kernel tuning of the tiled backends.

A tile is ``block_q`` rows (queries, image side) by ``block_k`` columns (keys,
text side). Every buffer the tiled backends allocate is O(block_q * block_k),
O(B * D), or a fixed number of rows times B (the Pallas backward's
``panel_rows`` x B probability panel, the Pallas forward's
``num_programs`` x B column-statistics workspace); nothing is O(B**2). The
defaults depend on backend, platform, dtype and, for the Pallas kernels on a
GPU, its compute capability (what fits its shared memory: ``triton_smem``,
``TRITON_CONFIGS``), so ``BlockSizes.get_default`` is the single place that
picks them.

The XLA backend reads only ``block_q`` and ``block_k``. The Pallas backend
reads the rest; its block shapes must be powers of two (Triton's rule), and
the feature dimension D is zero-padded to a multiple of ``block_d`` and
walked in ``block_d``-wide steps.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from infcl_jax.backends.capability import SMEM_PER_BLOCK  # pylint: disable=unused-import
from infcl_jax.backends.capability import smem_limit

from infcl_jax.backends.precision import F32_PRECISIONS
BWD_IMPLS = ("pallas", "xla")


def _is_pow2(v: int) -> bool:
  return v >= 1 and (v & (v - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile shape and kernel tuning of a tiled backend.

  Attributes:
    block_q: rows of x per tile.
    block_k: rows of y per tile.
    block_d: Pallas: feature-dimension step of the tile matmul (the K-step).
    num_warps: Pallas: warps per program of the forward kernel.
    num_stages: Pallas: software-pipelining depth of the forward kernel.
    num_programs: Pallas forward: number of persistent programs; each keeps
      its own row of partial column statistics (num_programs x B floats).
      ``None`` means one per streaming multiprocessor of the device.
    bwd_block_q: Pallas backward: rows per tile of the probability kernel.
    bwd_block_k: Pallas backward: columns per tile of the probability kernel.
    bwd_num_warps: Pallas backward: warps per program.
    bwd_num_stages: Pallas backward: software-pipelining depth.
    panel_rows: Pallas backward: rows of x per panel. The backward forms the
      (panel_rows, B) probability panel G in HBM and multiplies it with the
      library GEMM (dx = G y, dy += G^T x); memory is panel_rows * B
      elements of the input dtype, linear in B.
    bwd_impl: Pallas backward: "pallas" (a fused kernel recomputes the
      logits and writes G) or "xla" (XLA's GEMM recomputes the logits of the
      panel in float32, then an elementwise fusion forms G; more memory).
    f32_precision: float32 inputs only: "tf32" runs the matmuls on the
      tensor cores in TF32 (10-bit mantissa: logits carry ~1e-3 relative
      error); "highest" keeps full float32 (CUDA cores, several times
      slower). ``None`` (the default): "highest" if JAX's own float32 switch
      (``jax.default_matmul_precision``) says "highest" or "float32", else
      the backend's default: "highest" for xla, "tf32" for the kernel
      backends (the one policy: ``infcl_jax.backends.precision``).
    single_exp: Pallas: one exponential per logit where a tile's range
      allows (a shared shift for row and column terms; the kernels check
      this per tile and fall back to the exact two-exponential form).
  """
  block_q: int
  block_k: int
  block_d: int = 64
  num_warps: int = 8
  num_stages: int = 3
  num_programs: int | None = None
  bwd_block_q: int = 128
  bwd_block_k: int = 256
  bwd_num_warps: int = 8
  bwd_num_stages: int = 3
  panel_rows: int = 4096
  bwd_impl: str = "pallas"
  f32_precision: str | None = None
  single_exp: bool = True

  def __post_init__(self):
    for name in ("block_q", "block_k", "block_d", "num_warps", "num_stages",
                 "bwd_block_q", "bwd_block_k", "bwd_num_warps",
                 "bwd_num_stages", "panel_rows"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {v!r}")
    n = self.num_programs
    if n is not None and (not isinstance(n, (int, np.integer))
                          or isinstance(n, bool) or n < 1):
      raise ValueError(
          f"BlockSizes.num_programs must be None or a positive int, got {n!r}")
    if not isinstance(self.single_exp, bool):
      raise ValueError(
          f"BlockSizes.single_exp must be a bool, got {self.single_exp!r}")
    if self.bwd_impl not in BWD_IMPLS:
      raise ValueError(
          f"BlockSizes.bwd_impl must be one of {BWD_IMPLS}, got {self.bwd_impl!r}")
    if self.f32_precision is not None and self.f32_precision not in F32_PRECISIONS:
      raise ValueError(f"BlockSizes.f32_precision must be one of "
                       f"{F32_PRECISIONS}, got {self.f32_precision!r}")

  def check_pallas(self):
    """Raises ValueError unless the Pallas kernels can use these sizes."""
    for name in ("block_q", "block_k", "block_d", "bwd_block_q", "bwd_block_k"):
      v = getattr(self, name)
      if not _is_pow2(v):
        raise ValueError(
            f"BlockSizes.{name} must be a power of two for the Pallas "
            f"backend (Triton block shapes), got {v}")
    for name in ("block_q", "bwd_block_q"):
      if self.panel_rows % getattr(self, name):
        raise ValueError(
            f"BlockSizes.panel_rows ({self.panel_rows}) must be a multiple of "
            f"{name} ({getattr(self, name)})")

  @classmethod
  def get_default(cls, backend: str = "xla", platform: str = "cpu",
                  dtype=None, capability=None) -> "BlockSizes":
    """The default sizes of ``backend`` on ``platform`` for inputs of ``dtype``.

    ``capability``: the GPU's CUDA compute capability ``(major, minor)``
    (``infcl_jax.backends.capability.device_capability()``); the Pallas
    configs depend on its shared memory per block (``TRITON_CONFIGS``).
    ``None`` (unknown) gives the configs tuned on the H200.
    """
    if backend == "xla":
      if platform == "gpu":
        # Large tiles keep cuBLAS busy; 2048 x 8192 f32 is 64 MiB per buffer.
        return cls(block_q=2048, block_k=8192)
      # On CPU a few MiB per tile amortises the loop overhead.
      return cls(block_q=512, block_k=2048)
    if backend == "pallas":
      if platform == "gpu":
        return triton_config(capability, dtype)
      # CPU: interpret mode, meant for tests; small tiles keep it quick.
      return cls(block_q=32, block_k=32, block_d=32, num_programs=2,
                 bwd_block_q=32, bwd_block_k=32, panel_rows=64)
    raise ValueError(f"no default BlockSizes for backend {backend!r}")


# ---------------------------------------------------------------------------
# Shared memory of the Triton kernels, and the configs that fit each GPU.
#
# Every Pallas-Triton kernel here (kernels/lse_fwd.py, lse_bwd.py,
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
# kernel it compiles (``benchmarks/bench_configs.py --smem_probe``). On the
# H200 (jax 0.11.2) every bf16 kernel of every config below used exactly
# ``pipeline`` bytes (the G tile's staging reuses the K-loop buffers), and
# every float32 kernel at most ``peak`` (benchmarks/results/configs_h200).
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
# H200 of two candidates each, both exact there at B = 4096 (the other one
# is ``benchmarks/bench_configs.CANDIDATES``; BENCHMARKS.md has the times).
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


def triton_config_name(capability) -> str:
  """The largest ``TRITON_CONFIGS`` entry whose limit the GPU meets.

  Unknown capabilities get the H200 configs (``"smem227k"``); a GPU below
  every limit gets the smallest (best effort: Triton may still reject it).
  """
  limit = smem_limit(capability)
  if limit is None:
    return "smem227k"
  fitting = [(lim, name) for name, (lim, _, _) in TRITON_CONFIGS.items()
             if lim <= limit]
  if not fitting:
    return min((lim, name) for name, (lim, _, _) in TRITON_CONFIGS.items())[1]
  return max(fitting)[1]


def triton_config(capability, dtype) -> BlockSizes:
  """The Pallas-Triton default ``BlockSizes`` for a GPU and input dtype."""
  _, narrow, wide = TRITON_CONFIGS[triton_config_name(capability)]
  return wide if dtype is not None and np.dtype(dtype).itemsize >= 4 else narrow
