"""Tile sizes and kernel tuning of the tiled backends.

A tile is ``block_q`` rows (queries, image side) by ``block_k`` columns (keys,
text side). Every buffer the tiled backends allocate is O(block_q * block_k),
O(B * D), or a fixed number of rows times B (the Pallas backward's
``panel_rows`` x B probability panel, the Pallas forward's
``num_programs`` x B column-statistics workspace); nothing is O(B**2). The
defaults depend on backend, platform and dtype, so ``BlockSizes.get_default``
is the single place that picks them.

The XLA backend reads only ``block_q`` and ``block_k``. The Pallas backend
reads the rest; its block shapes must be powers of two (Triton's rule), and
the feature dimension D is zero-padded to a multiple of ``block_d`` and
walked in ``block_d``-wide steps.
"""
from __future__ import annotations

import dataclasses

import numpy as np

F32_PRECISIONS = ("tf32", "highest")
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
    f32_precision: Pallas, float32 inputs only: "tf32" runs the matmuls on
      the tensor cores in TF32 (10-bit mantissa: logits carry ~1e-3 relative
      error); "highest" keeps full float32 (CUDA cores, several times slower).
      ``None`` (the default) follows JAX's own switch for float32 matmuls,
      ``jax.default_matmul_precision`` / ``jax_default_matmul_precision``:
      "highest" or "float32" there gives "highest", anything else TF32, as
      XLA's own float32 GEMMs on the GPU do.
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

  def resolved_f32_precision(self) -> str:
    """"tf32" or "highest": the explicit setting, else JAX's matmul switch."""
    if self.f32_precision is not None:
      return self.f32_precision
    import jax  # Read at trace time, so a `with jax.default_matmul_precision`
    # block around the call takes effect (it is part of jit's cache key).
    setting = jax.config.jax_default_matmul_precision
    return "highest" if setting in ("highest", "float32", "fastest_float32_off") else "tf32"

  @classmethod
  def get_default(cls, backend: str = "xla", platform: str = "cpu",
                  dtype=None) -> "BlockSizes":
    """The default sizes of ``backend`` on ``platform`` for inputs of ``dtype``."""
    if backend == "xla":
      if platform == "gpu":
        # Large tiles keep cuBLAS busy; 2048 x 8192 f32 is 64 MiB per buffer.
        return cls(block_q=2048, block_k=8192)
      # On CPU a few MiB per tile amortises the loop overhead.
      return cls(block_q=512, block_k=2048)
    if backend == "pallas":
      wide = dtype is not None and np.dtype(dtype).itemsize >= 4
      if platform == "gpu":
        # 128 x 256 tiles, K-step 64, 8 warps, 3 stages: the configuration
        # that reached ~600 TFLOP/s for a flash-style LSE pass on an H200.
        # float32 tiles take twice the shared memory per stage, so they
        # use a K-step of 32, and a smaller panel keeps the float32 G
        # panel (4 bytes per element) at the same size in bytes. 128 x 256
        # beat 128 x 128 for float32 too (H200, B=65536: forward 43 vs
        # 55 ms, probability panels 46 vs 53 ms).
        if wide:
          return cls(block_q=128, block_k=256, block_d=32, num_stages=3,
                     bwd_block_q=128, bwd_block_k=256, panel_rows=2048)
        return cls(block_q=128, block_k=256, block_d=64, panel_rows=4096)
      # CPU: interpret mode, meant for tests; small tiles keep it quick.
      return cls(block_q=32, block_k=32, block_d=32, num_programs=2,
                 bwd_block_q=32, bwd_block_k=32, panel_rows=64)
    raise ValueError(f"no default BlockSizes for backend {backend!r}")
