"""Padding to block multiples, and the index guard of padded buffers.

The kernels take B and D zero-padded to block multiples and mask the
padding themselves, so any shape works. Padded rows are told apart by their
row ids (-1) or by +inf statistics.

Indexing past 2**31 elements: Pallas' Triton lowering switches a ref's
element offsets to 64 bits when the array exceeds 4 GiB, so inputs and
panels of any size are indexed correctly (tested on the GPU past 2**31).
What stays int32 is index arithmetic a kernel does itself on a flat buffer
(the forward's column workspace); ``check_int32`` guards that.
"""
from __future__ import annotations

import jax.numpy as jnp

MAX_INT32_ELEMS = 2**31 - 1


def round_up(v, k):
  return -(-v // k) * k


def pad2(a, rows, cols):
  r, c = a.shape
  if (r, c) == (rows, cols):
    return a
  return jnp.pad(a, ((0, rows - r), (0, cols - c)))


def pad1(v, n, fill):
  if v.shape[0] == n:
    return v
  return jnp.pad(v, (0, n - v.shape[0]), constant_values=fill)


def pad_ids(ids, n):
  """Group ids padded to ``n`` with the last id: the kernels mask padded
  pairs whatever their ids, and a repeated last id keeps the id range of
  a sorted block tight (``kernels.mosaic.group_tiles``)."""
  ids = ids.astype(jnp.int32)
  if ids.shape[0] == n:
    return ids
  return jnp.pad(ids, (0, n - ids.shape[0]), mode="edge")


def pad_inputs(x, y, block_q, block_k, block_d):
  """x, y zero-padded to (block_q | block_k) x block_d multiples."""
  d_pad = round_up(x.shape[1], block_d)
  xp = pad2(x, round_up(x.shape[0], block_q), d_pad)
  yp = pad2(y, round_up(y.shape[0], block_k), d_pad)
  return xp, yp


def row_ids(n, n_pad):
  """(n_pad,) int32 global row index of each padded row, -1 on padding."""
  ids = jnp.arange(n_pad, dtype=jnp.int32)
  return jnp.where(ids < n, ids, -1)


def check_int32(backend, **sizes):
  """A flat buffer that a kernel indexes with its own int32 arithmetic must
  have fewer than 2**31 elements."""
  for what, elems in sizes.items():
    if elems > MAX_INT32_ELEMS:
      raise ValueError(
          f"backend={backend!r}: {what} has {elems} elements (padded), over "
          f"the 2**31 that the kernels' int32 indexing allows; use "
          f"backend='xla' or shard the batch (axis_name)")
