"""``BlockSizes``: the public override of a tiled backend's tiles and tuning.

A tile is ``block_q`` rows (queries, image side) by ``block_k`` columns (keys,
text side). Every buffer the tiled backends allocate is O(block_q * block_k),
O(B * D), or a fixed number of rows times B (the Pallas backward's
``panel_rows`` x B probability panel, the Pallas forward's
``num_programs`` x B column-statistics workspace); nothing is O(B**2).

Each backend owns its defaults (``default_block_sizes`` on the backend
class): the XLA backend's in ``backends/xla.py``, the Triton kernels'
per-GPU table in ``backends/triton_tiles.py``, the Mosaic kernels' tiles
in ``backends/mosaic.py``. Pass a ``BlockSizes`` only to override them.

The XLA backend reads only ``block_q`` and ``block_k``. The Pallas backend
reads the rest; its block shapes must be powers of two (Triton's rule), and
the feature dimension D is zero-padded to a multiple of ``block_d`` and
walked in ``block_d``-wide steps.
"""
from __future__ import annotations

import dataclasses

import numpy as np

# See infcl_jax.backends.precision; "tf32" is accepted for "default".
F32_PRECISIONS = ("default", "high", "highest")

BWD_IMPLS = ("pallas", "xla")


def _is_pow2(v: int) -> bool:
  return v >= 1 and (v & (v - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile shape and kernel tuning of a tiled backend.

  ``BlockSizes(f32_precision=...)`` alone (no ``block_q`` / ``block_k``)
  keeps the backend's own tiles and tuning and sets only the float32
  precision; any other field needs the tile shape (``block_q`` and
  ``block_k``) beside it.

  Attributes:
    block_q: rows of x per tile (None, with ``block_k`` None: the backend's
      tiles).
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
    f32_precision: float32 inputs only, the precision of the matmuls:
      "default" (TF32 tensor cores, operands rounded to TF32; logits carry
      ~4e-4 * scale / sqrt(D) of error, the loss puts each positive back in
      float32), "high" (3-pass TF32: float32-accurate logits, ~3 TF32
      passes) or "highest" (IEEE float32, several times slower); "tf32" is
      "default". ``None``: "highest" if JAX's own float32 switch
      (``jax.default_matmul_precision``) says "highest" or "float32", else
      the backend's default: "highest" for xla; for the kernel backends
      "default" from D = 64 on and "high" below (the one policy:
      ``infcl_jax.backends.precision``). The losses' ``precision=`` sets
      this field.
    single_exp: Pallas: one exponential per logit where a tile's range
      allows (a shared shift for row and column terms; the kernels check
      this per tile and fall back to the exact two-exponential form).
    f32_panels: float32 inputs on TF32 tiles: the softmax backward keeps
      its gradient panels G in float32 (TF32 GEMMs) instead of float16
      (16-bit GEMMs, ~1.5x faster). float16 G shares one scale per batch
      with G's largest entry; ``group_mode="positives"`` sets this, since a
      query with several related keys puts entries of order 1 beside a
      confident one-key row's tiny ones (measured: 2.9e-3 of those rows'
      gradients in float16 against 1e-6 in float32).
  """
  block_q: int | None = None
  block_k: int | None = None
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
  f32_panels: bool = False

  def __post_init__(self):
    if (self.block_q is None) != (self.block_k is None):
      raise ValueError(
          f"BlockSizes needs block_q and block_k together (the tile shape), "
          f"or neither (the backend's tiles), got block_q={self.block_q!r}, "
          f"block_k={self.block_k!r}")
    if self.block_q is None:
      tuned = [f.name for f in dataclasses.fields(self)
               if f.name not in ("block_q", "block_k", "f32_precision",
                                 "f32_panels")
               and getattr(self, f.name) != f.default]
      if tuned:
        raise ValueError(
            f"BlockSizes.{tuned[0]} needs block_q and block_k beside it (a "
            f"BlockSizes without them sets only f32_precision and "
            f"f32_panels and keeps the backend's tiles)")
    for name in ("block_q", "block_k", "block_d", "num_warps", "num_stages",
                 "bwd_block_q", "bwd_block_k", "bwd_num_warps",
                 "bwd_num_stages", "panel_rows"):
      v = getattr(self, name)
      if v is None and name in ("block_q", "block_k"):
        continue
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
    f32 = self.f32_precision
    if f32 is not None:
      f32 = {"tf32": "default"}.get(f32, f32) if isinstance(f32, str) else f32
      if f32 not in F32_PRECISIONS:
        raise ValueError(f"BlockSizes.f32_precision must be one of "
                         f"{F32_PRECISIONS} (or \"tf32\", the same as "
                         f"\"default\"), got {self.f32_precision!r}")
      # One spelling, so that equal settings are one jit cache entry.
      object.__setattr__(self, "f32_precision", f32)

  @property
  def tiles(self) -> bool:
    """Whether this sets the tiles (else only the float32 precision and
    panels)."""
    return self.block_q is not None

  def over(self, default: "BlockSizes") -> "BlockSizes":
    """What a backend runs: ``self``, or without tiles ``default`` (the
    backend's own) with this float32 precision."""
    if self.tiles:
      return self
    return dataclasses.replace(default, f32_precision=self.f32_precision,
                               f32_panels=self.f32_panels)

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
