"""What the Pallas backends of both loss families share.

Padding to block multiples, Triton's int32 size limit, the backward's panel
split, and the backend plumbing (platform -> interpret mode, default block
sizes, matmul precision). The family modules (``pallas_tiles`` for softmax,
``pallas_sigmoid_tiles`` for sigmoid) hold only their own kernels' calls.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import tile_backend
from infcl_jax.block_sizes import BlockSizes

F32 = jnp.float32
# Triton computes element offsets in int32: a panel of R x B_pad elements
# must stay below 2**31.
MAX_PANEL_ELEMS = 2**31 - 1


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


def dot(a, b, contract, precision):
  return lax.dot_general(a, b, (contract, ((), ())),
                         preferred_element_type=F32, precision=precision)


def check_int32(**sizes):
  """Triton indexes with int32: every array the kernels see must fit."""
  for what, elems in sizes.items():
    if elems > MAX_PANEL_ELEMS:
      raise ValueError(
          f"backend='pallas': {what} has {elems} elements (padded), over the "
          f"2**31 that Triton's int32 indexing allows; use backend='xla' or "
          f"shard the batch (axis_name)")


def num_sms():
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except RuntimeError:
    return 132


def panel_rows(bs, n, m_pad):
  """Rows per backward panel: at most panel_rows, few padded, int32-safe.

  Returns:
    (rows per panel, number of panels).
  """
  bq = bs.bwd_block_q
  cap = max(bq, (MAX_PANEL_ELEMS // m_pad) // bq * bq)
  r = min(bs.panel_rows, cap, round_up(n, bq))
  n_panels = -(-n // r)
  # Spread the rows evenly so that the last panel is not mostly padding.
  r = round_up(-(-n // n_panels), bq)
  return r, n_panels


class PallasBackend:
  """Plumbing shared by the Pallas backends of both families."""

  name = "pallas"

  def __init__(self, platform: str | None = None):
    self.platform = platform or tile_backend.default_platform()
    # Anything but a GPU runs the same kernels through the interpreter.
    self.interpret = self.platform != "gpu"

  def default_block_sizes(self, platform, dtype):
    return BlockSizes.get_default("pallas", platform, dtype)

  def _block_sizes(self, block_sizes, dtype):
    bs = block_sizes
    if bs is None:
      bs = self.default_block_sizes(self.platform, dtype)
    bs.check_pallas()
    return bs

  def _precision(self, bs, dtype):
    if (jnp.dtype(dtype) == jnp.float32
        and bs.resolved_f32_precision() == "highest"):
      return lax.Precision.HIGHEST
    # DEFAULT: bf16 / f16 tensor cores; TF32 for float32 on the GPU.
    return lax.Precision.DEFAULT
