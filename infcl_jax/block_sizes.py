"""Tile sizes of the tiled backends.

A tile is ``block_q`` rows (queries, image side) by ``block_k`` columns (keys,
text side). Every buffer the tiled backends allocate is O(block_q * block_k)
or O(B * D); nothing is O(B**2). The defaults depend on backend, platform and
dtype, so ``BlockSizes.get_default`` is the single place that picks them.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile shape of a tiled backend.

  Attributes:
    block_q: rows of x per tile.
    block_k: rows of y per tile.
  """
  block_q: int
  block_k: int

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {v!r}")

  @classmethod
  def get_default(cls, backend: str = "xla", platform: str = "cpu",
                  dtype=None) -> "BlockSizes":
    del dtype  # The XLA tiles do not depend on it (yet).
    if backend == "xla":
      if platform == "gpu":
        # Large tiles keep cuBLAS busy; 2048 x 8192 f32 is 64 MiB per buffer.
        return cls(block_q=2048, block_k=8192)
      # On CPU a few MiB per tile amortises the loop overhead.
      return cls(block_q=512, block_k=2048)
    raise ValueError(f"no default BlockSizes for backend {backend!r}")
