"""``BlockSizes``: the public override of a tiled backend's tiles and tuning.

A tile is ``block_q`` rows (queries, image side) by ``block_k`` columns (keys,
text side). Every buffer the tiled backends allocate is O(block_q * block_k),
O(B * D), or a fixed number of rows times B (the Pallas backward's
``panel_rows`` x B probability panel, the Pallas forward's
``num_programs`` x B column-statistics workspace); nothing is O(B**2).

Each backend owns its defaults (``default_block_sizes`` on the backend
class): the XLA backend's in ``backends/xla.py``, the Triton kernels'
per-GPU tables in ``backends/triton_configs.py``, the Mosaic kernels' tiles
in ``backends/mosaic.py``. Pass a ``BlockSizes`` only to override them.

The XLA backend reads only ``block_q`` and ``block_k``. The Pallas backend
reads the rest; its block shapes must be powers of two (Triton's rule), and
the feature dimension D is zero-padded to a multiple of ``block_d`` and
walked in ``block_d``-wide steps.
"""
from __future__ import annotations

import dataclasses

import numpy as np

F32_PRECISIONS = ("tf32", "highest")  # See infcl_jax.backends.precision.

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
