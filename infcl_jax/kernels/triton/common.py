"""What every Triton-language kernel here shares: the logit tile and the
stable scalar functions.

``tile_dot`` is the K-loop (x_blk @ y_blk^T over D in ``BD`` steps) that
Triton software-pipelines with ``num_stages`` buffers; every kernel of both
families starts from it, so it is written once. The constants are
``infcl_jax._math``'s, as Triton compile-time values.

A tile's scalar (its largest logit, its sum of G) is one reduction over
all of it (``tl.sum(x)``), and a vector's smallest entry ``tl.min(v)``,
never a reduction along an axis of a reduction's result
(``tl.sum(tl.sum(x, axis=1), axis=0)``): Triton 3.6 fails to compile that
for sm100 (``TritonNvidiaGPUOptimizeTMemLayoutsPass``: "parent layout must
have at least rank >= 2") when the tile comes from tensor memory.
CI compiles every kernel for sm100 ahead of time to keep it so.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from infcl_jax import _math
from infcl_jax.kernels.triton import launch

LOG2E = tl.constexpr(_math.LOG2E)
LN2 = tl.constexpr(_math.LN2)
MIN_SUM = tl.constexpr(_math.MIN_SUM)
# The one-exponential backward form is exact while a tile's statistics span
# at most 2**64 (see lse_bwd).
MAX_SPREAD = tl.constexpr(64.0)
# Triton's interpreter has no libdevice. Read once, when the kernels are
# imported (as Triton itself reads TRITON_INTERPRET).
INTERPRETED = tl.constexpr(launch.interpreting())

# lax.Precision -> tl.dot's input_precision. bf16 / f16 ignore it (tensor
# cores, float32 accumulation); float32 takes TF32, 3-pass TF32 or full
# IEEE float32 (``backends.precision``).
PRECISIONS = {"DEFAULT": "tf32", "HIGH": "tf32x3", "HIGHEST": "ieee"}


def group_ptrs(groups, stand_in):
  """The two group-id arguments of a kernel: the ids, or without groups
  ``stand_in`` twice (an input already passed; a kernel compiled with
  ``GROUPS`` False never reads them, so it is the program it would be
  without the arguments)."""
  return tuple(groups) if groups is not None else (stand_in, stand_in)


def dot_precision(precision) -> str:
  """``tl.dot``'s input_precision for a ``lax.Precision`` (None: DEFAULT)."""
  return PRECISIONS[getattr(precision, "name", None) or "DEFAULT"]


@triton.jit
def tile_dot(x_ptr, y_ptr, row0, col0, D_PAD: tl.constexpr,
             BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
             PREC: tl.constexpr):
  """(BQ, BK) float32 x[row0:row0+BQ] @ y[col0:col0+BK]^T over D_PAD.

  x, y are zero-padded row-major (rows, D_PAD) buffers; row offsets are
  64-bit, so inputs past 2**31 elements are indexed correctly.
  """
  rows = (row0 + tl.arange(0, BQ)).to(tl.int64)
  cols = (col0 + tl.arange(0, BK)).to(tl.int64)
  d = tl.arange(0, BD)
  xp = x_ptr + rows[:, None] * D_PAD + d[None, :]
  yp = y_ptr + cols[:, None] * D_PAD + d[None, :]
  acc = tl.zeros((BQ, BK), dtype=tl.float32)
  for _ in range(0, D_PAD // BD):
    xa = tl.load(xp)
    yb = tl.load(yp)
    acc = tl.dot(xa, tl.trans(yb), acc, input_precision=PREC)
    xp += BD
    yp += BD
  return acc


@triton.jit
def logit_tile(params_ptr, x_ptr, y_ptr, row0, col0, D_PAD: tl.constexpr,
               BQ: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
               PREC: tl.constexpr):
  """(s, s0): the (BQ, BK) logits ``scale * s0 + bias`` of the raw dot
  products ``s0`` (``tile_dot``); scale and bias are the first two float32
  entries of every kernel's ``params`` (the softmax kernels' in base 2)."""
  s0 = tile_dot(x_ptr, y_ptr, row0, col0, D_PAD, BQ, BK, BD, PREC)
  return s0 * tl.load(params_ptr) + tl.load(params_ptr + 1), s0


@triton.jit
def store_tile_sums(dsc_ptr, dbi_ptr, g, s0, i, j, M_PAD: tl.constexpr,
                    BK: tl.constexpr):
  """A panel tile's float32 partials of the scale and bias gradients (sum
  G * (x y^T) with ``s0`` the raw dot products, and sum G) at tile (i, j)'s
  slot, row-major over the panel's tiles: both panel kernels' layout."""
  slot = i * (M_PAD // BK) + j
  tl.store(dsc_ptr + slot, tl.sum(g * s0))
  tl.store(dbi_ptr + slot, tl.sum(g))


@triton.jit
def safe_max(m):
  """A running max usable as a shift: -inf (nothing seen yet) becomes 0, so
  that exp2(-inf - shift) is 0 rather than NaN."""
  return tl.where(m == -float("inf"), 0.0, m)


@triton.jit
def log1p_unit(e):
  """log(1 + e) for e in [0, 1], to full relative precision as e -> 0.

  log(w) * e / (w - 1) with w = 1 + e cancels the rounding of w (the
  classic log1p identity); w == 1 means e is below half an ulp of 1, where
  log1p(e) = e. ``tl.log`` is libdevice's accurate logf on the GPU.
  """
  w = 1.0 + e
  return tl.where(w == 1.0, e, tl.log(w) * (e / (w - 1.0)))


@triton.jit
def softplus(u):
  """log(1 + e^u) = max(u, 0) + log1p(e^-|u|): no overflow for u >> 0, full
  relative precision (e^u) for u << 0 (``_math.softplus``).

  On the GPU, libdevice's ``log1pf``: the identity's IEEE division per logit
  made the sigmoid forward 2x slower on the H200 (38.5 vs 18.9 ms at
  B = 65,536, D = 768, bf16). The interpreter takes the
  identity; both legs check the loss against float64.
  """
  e = tl.exp(-tl.abs(u))
  if INTERPRETED:
    lp = log1p_unit(e)
  else:
    lp = libdevice.log1p(e)
  return tl.maximum(u, 0.0) + lp


@triton.jit
def sigmoid(u):
  """1 / (1 + e^-u): exact to rounding for any u (e^-u overflows to inf for
  u << 0 and gives 0, never NaN)."""
  return 1.0 / (1.0 + tl.exp(-u))
