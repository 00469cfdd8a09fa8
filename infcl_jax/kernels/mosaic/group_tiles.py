"""Which tiles of a grouped grid may hold a related pair: clean tiles first.

A tile (row block i, column block j) can hold a related pair
(``gx[a] == gy[b]``) only if the id ranges [min, max] of its rows and of its
columns overlap. The test is conservative for ids in any order (a tile it
calls clean holds no related pair), so a kernel may run its clean tiles
without the per-logit compare and select. It is sharp when both sides are
sorted by id: a row block's range then overlaps the few column blocks that
hold the same ids, and every other tile is clean. O(B + tiles) in XLA.
"""
from __future__ import annotations

import jax.numpy as jnp


def dirty_tiles(gx, gy, block_rows, block_cols):
  """(nj, ni) bool: whether the id ranges of row block i and column block j
  overlap (the tile may hold a related pair).

  Args:
    gx: (ni * block_rows,) int32 ids of the rows. Padding takes any id; pad
      with the last valid one (``padding.pad_ids``) to keep the ranges of
      sorted ids tight.
    gy: (nj * block_cols,) int32 ids of the columns, likewise.
  """
  rows = gx.reshape(-1, block_rows)
  cols = gy.reshape(-1, block_cols)
  lo_r, hi_r = rows.min(axis=1), rows.max(axis=1)
  lo_c, hi_c = cols.min(axis=1), cols.max(axis=1)
  return (lo_r[None, :] <= hi_c[:, None]) & (lo_c[:, None] <= hi_r[None, :])


def tile_order(gx, gy, block_rows, block_cols):
  """The tiles of a grouped grid, those without a related pair first
  (``dirty_tiles``' arguments).

  Returns:
    (order, n_clean): order (ni * nj,) int32 holds every tile index
    t = i + ni * j once, the clean tiles first, each part in index order
    (row blocks fastest, as the kernels' persistent grids walk them);
    n_clean, an int32 scalar, counts the clean ones.
  """
  dirty = dirty_tiles(gx, gy, block_rows, block_cols).reshape(-1)
  # A stable partition by prefix counts and a scatter to distinct
  # positions: XLA's GPU sort of a few thousand flags costs more than the
  # panel saves (measured on an H200).
  clean = ~dirty
  n_clean = jnp.sum(clean, dtype=jnp.int32)
  pos = jnp.where(clean, jnp.cumsum(clean, dtype=jnp.int32),
                  n_clean + jnp.cumsum(dirty, dtype=jnp.int32)) - 1
  order = jnp.zeros(dirty.shape, jnp.int32).at[pos].set(
      jnp.arange(dirty.size, dtype=jnp.int32), unique_indices=True)
  return order, n_clean


def dirty_spans(gx, gy, block_rows, block_cols):
  """Per row block, the column blocks [start, stop) from its first dirty
  tile to its last (start == stop: none), for a kernel that walks a row
  block's column blocks in order (``dirty_tiles``' arguments). Contiguous
  for sorted ids; a superset of the dirty tiles otherwise.

  Returns:
    (start (ni,), stop (ni,)) int32.
  """
  dirty = dirty_tiles(gx, gy, block_rows, block_cols)
  nj = dirty.shape[0]
  j = jnp.arange(nj, dtype=jnp.int32)[:, None]
  start = jnp.min(jnp.where(dirty, j, nj), axis=0)
  stop = jnp.max(jnp.where(dirty, j + 1, 0), axis=0)
  return start.astype(jnp.int32), jnp.maximum(start, stop).astype(jnp.int32)
