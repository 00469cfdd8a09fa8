"""The tiles of the Triton kernels: their tile ops, where they run, their
block sizes.

Two kernel sets run the same algorithms with the same block sizes: Pallas'
(``kernels/pallas/``, lowered through Pallas' Triton backend: the
``pallas`` backend) and the Triton-language one (``kernels/triton/``,
launched through jax-triton: the ``triton`` backend). A backend has its
set (``Kernels``: four entry points with the contracts of the Pallas-Triton
kernels ``kernels.pallas.lse_fwd.lse_fwd``, ``kernels.pallas.lse_bwd
.g_panel``, ``kernels.pallas.sigmoid_fwd.sigmoid_row_sums`` and
``kernels.pallas.sigmoid_bwd.g_panel``, and how a call is made), and
``TritonTiles`` runs the seam's four operations over it: the fused forward
sweeps and the panel backward (``panel_backward``) over the padded inputs
(``padding``), with the int32 guard, the persistent grid size, the panel
layout and the precision policy. The ``mosaic`` backend runs the same for
what its own kernels do not cover (float32 inputs).

Groups (``backends.base``): the forward kernels take the rows' and columns'
group ids padded like the inputs, the panel kernels the panel's and the
columns' (``panel_backward``); without groups the kernels are the same
programs as ever (the groups are a static switch of each kernel).

Where they run (``RUNS_ON``) and the block sizes that fit each GPU
(``CONFIGS``, ``default``; the notes of "tuning" below derive them) are the
same for both sets.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp
import numpy as np

from infcl_jax import _device
from infcl_jax.backends import capability
from infcl_jax.backends import panel_backward as pb
from infcl_jax.backends import precision as precision_lib
from infcl_jax.backends.capability import smem_limit
from infcl_jax.backends.padding import check_int32
from infcl_jax.backends.padding import pad1
from infcl_jax.backends.padding import pad_inputs
from infcl_jax.block_sizes import BlockSizes

F32 = jnp.float32

# Where Triton's kernels run, for both launch paths: every GPU from sm80
# whose shared memory per block is known (the configs fit it). Newer GPUs
# are untested; below sm80 Triton has no bfloat16 dot.
RUNS_ON = capability.RunsOn(
    tuned=tuple(cc for cc in capability.SMEM_PER_BLOCK if cc >= (8, 0)),
    floor=(8, 0), unknown_gpu=capability.UNTESTED,
    needs="an NVIDIA GPU of compute capability 8.0 or newer (Triton has "
          "no bfloat16 dot below)")


def _as_given(prec, interpret):
  del interpret
  return prec


@dataclasses.dataclass(frozen=True)
class Kernels:
  """A Triton kernel set: its four entry points, and how a call is made.

  ``takes_interpret``: whether the kernels take ``interpret=`` (Pallas'
  do; the Triton-language ones run in Triton's interpreter by the
  environment, ``kernels.triton.launch``). ``precision(prec, interpret)``:
  what the kernels take for a ``lax.Precision`` (the Triton-language ones
  map it to ``tl.dot``'s input precision themselves).
  """
  lse_fwd: Callable
  lse_panel: Callable
  sigmoid_rows: Callable
  sigmoid_panel: Callable
  takes_interpret: bool = False
  precision: Callable = _as_given

  def tiles(self, backend) -> TritonTiles:
    """The tile ops over this set for ``backend`` (a ``base.KernelBackend``:
    its name, interpret mode, float32 default and grouped sigmoid
    diagonal)."""
    return TritonTiles(self, name=backend.name, interpret=backend.interpret,
                       f32_default=backend.F32_DEFAULT,
                       diagonal_outside=backend.GROUP_DIAGONAL_OUTSIDE)


def padded_groups(groups, xp, yp):
  """The group ids padded to the padded inputs' rows, or None. The fill is
  arbitrary: the kernels mask padded rows and columns anyway."""
  if groups is None:
    return None
  gx, gy = groups
  return pad1(gx, xp.shape[0], -1), pad1(gy, yp.shape[0], -1)


def layout(bs, x, y):
  """The panel backward's layout for the Triton panel kernels' tiles."""
  return pb.panel_layout(x.shape[0], y.shape[0], x.shape[1],
                         block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
                         block_d=bs.block_d, panel_rows=bs.panel_rows)


class TritonTiles:
  """The seam's four operations over one Triton kernel set, after the
  guards (``base``): the underscored operations of a kernel backend, with
  its block sizes ``bs`` resolved."""

  def __init__(self, kernels: Kernels, *, name: str, interpret: bool,
               f32_default, diagonal_outside: bool):
    self.kernels = kernels
    self.name = name  # The backend's, for the int32 guard's message.
    self.interpret = interpret
    self.f32_default = f32_default
    self.diagonal_outside = diagonal_outside

  @staticmethod
  def default_block_sizes(platform, dtype):
    """The ``CONFIGS`` entry that fits this GPU (``default_here``)."""
    return default_here(platform, dtype)

  def precision(self, bs, dtype, depth):
    """The matmul precision (``backends.precision``, as ``base``'s)."""
    return precision_lib.matmul_precision(dtype, bs.f32_precision,
                                          self.f32_default, depth)

  def _kernel_kw(self) -> dict:
    return {"interpret": self.interpret} if self.kernels.takes_interpret \
        else {}

  def _kernel_precision(self, prec):
    """What the kernels take for ``prec`` (a ``lax.Precision``)."""
    return self.kernels.precision(prec, self.interpret)

  def _gemm_precision(self, prec):
    """What the backward's XLA GEMMs take for ``prec``
    (``precision.xla_dot_precision``)."""
    return precision_lib.xla_dot_precision(
        prec, "cpu" if self.interpret else "gpu")

  @property
  def tf32_numerics(self) -> bool:
    """Whether TF32 tiles round as the GPU's do: operands to nearest TF32,
    the softmax panels float16 (compiled; the interpreters' dots are exact
    float32). The project's tests turn it on in the interpreter, to see
    the GPU's float32 numbers on the CPU."""
    return not self.interpret

  def _operands(self, x, y, bs):
    """x and y as the kernels take them: on TF32 tiles, compiled, rounded
    to nearest TF32 (``backends.precision``: Triton's TF32 dot truncates);
    the interpreters' dots are exact float32, so there as they are."""
    if not self.tf32_numerics or not precision_lib.tf32_tiles(
        x.dtype, bs.f32_precision, self.f32_default, x.shape[-1]):
      return x, y
    return precision_lib.round_tf32(x), precision_lib.round_tf32(y)

  @staticmethod
  def _groups_kw(groups, xp, yp, group_mode=None):
    """A forward kernel's group keywords: none without groups, so that the
    kernel compiles as it does without them."""
    if groups is None:
      return {}
    kw = {"groups": padded_groups(groups, xp, yp)}
    if group_mode is not None:
      kw["group_mode"] = group_mode
    return kw

  # ------------------------------------------------------------ softmax

  def lse(self, x, y, scale, bias, *, rows, cols, bs, groups=None):
    n, m = x.shape[0], y.shape[0]
    x, y = self._operands(x, y, bs)
    xp, yp = pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    nprog = bs.num_programs or _device.num_sms()
    check_int32(self.name, column_workspace=min(
        nprog, xp.shape[0] // bs.block_q) * yp.shape[0])
    return self.kernels.lse_fwd(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        rows=rows, cols=cols, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, num_programs=nprog, num_warps=bs.num_warps,
        num_stages=bs.num_stages,
        precision=self._kernel_precision(
            self.precision(bs, x.dtype, x.shape[-1])),
        single_exp=bs.single_exp, **self._groups_kw(groups, xp, yp),
        **self._kernel_kw())

  def _half_panels(self, x, bs) -> bool:
    """Whether the softmax panels of ``x`` are float16 with 16-bit GEMMs
    (``panel_backward.softmax_grad``'s ``gemm_dtype``): float32 on TF32
    tiles, compiled. G's float16 rounding (~3e-4 of the gradients) sits
    beside TF32's own error there; where float32 is asked to be exact
    ("high", "highest"), where ``bs.f32_panels`` asks for it and in the
    exact interpreters G stays float32."""
    return (self.tf32_numerics and not bs.f32_panels
            and precision_lib.tf32_tiles(x.dtype, bs.f32_precision,
                                         self.f32_default, x.shape[-1]))

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
               col_coef, *, bs, groups=None):
    prec = self.precision(bs, x.dtype, x.shape[-1])
    half = self._half_panels(x, bs)
    x, y = self._operands(x, y, bs)
    panel = None if bs.bwd_impl == "xla" else functools.partial(
        self.kernels.lse_panel, g_dtype=jnp.float16 if half else x.dtype,
        block_q=bs.bwd_block_q,
        block_k=bs.bwd_block_k, block_d=bs.block_d,
        num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages,
        precision=self._kernel_precision(prec), single_exp=bs.single_exp,
        **self._kernel_kw())
    return pb.softmax_grad(
        x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
        layout=layout(bs, x, y), precision=self._gemm_precision(prec),
        panel=panel, gemm_dtype=jnp.float16 if half else None,
        **({} if groups is None else {"groups": groups}))

  # ------------------------------------------------------------ sigmoid

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, bs,
                  groups=None, group_mode="mask"):
    n, m = x.shape[0], y.shape[0]
    x, y = self._operands(x, y, bs)
    xp, yp = pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    rows = self.kernels.sigmoid_rows(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        has_diagonal=has_diagonal, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, target_programs=bs.num_programs or _device.num_sms(),
        num_warps=bs.num_warps, num_stages=bs.num_stages,
        precision=self._kernel_precision(
            self.precision(bs, x.dtype, x.shape[-1])),
        **self._groups_kw(groups, xp, yp, group_mode), **self._kernel_kw())
    return jnp.sum(rows)

  def sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal, bs,
                   groups=None, group_mode="mask"):
    prec = self.precision(bs, x.dtype, x.shape[-1])
    kprec = self._kernel_precision(prec)
    x, y = self._operands(x, y, bs)
    kernel, kernel_kw = self.kernels.sigmoid_panel, self._kernel_kw()

    def panel(x_p, yp, rid_p, params, mode, **kw):
      return kernel(
          x_p, yp, rid_p, params, mode=mode, g_dtype=x.dtype,
          block_q=bs.bwd_block_q, block_k=bs.bwd_block_k, block_d=bs.block_d,
          num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages,
          precision=kprec, **kernel_kw, **kw)

    return pb.sigmoid_grad(
        x, y, scale, bias, coef, has_diagonal=has_diagonal,
        layout=layout(bs, x, y), precision=self._gemm_precision(prec),
        panel=None if bs.bwd_impl == "xla" else panel,
        **({} if groups is None else {
            "groups": groups, "group_mode": group_mode,
            "diagonal_outside": self.diagonal_outside}))


# ------------------------------------------------------------------ tuning
#
# The block sizes that fit each GPU: one table for both Triton kernel sets
# (``pallas``, ``triton``, and Mosaic's float32 path), which have the same
# structure. ``default`` is what a backend runs without a ``BlockSizes``: on
# a GPU the ``CONFIGS`` entry that fits its shared memory per block (and
# keeps the logit tile in registers), off the GPU small tiles for the
# interpreters (tests).
#
# Shared memory. Every Triton kernel here (``kernels/pallas/lse_fwd.py``,
# ``lse_bwd.py``, ``sigmoid_fwd.py``, ``sigmoid_bwd.py`` and their twins in
# ``kernels/triton/``) starts from a K-loop over D in ``block_d`` steps that
# loads a (block_q, block_d) slice of x and a (block_k, block_d) slice of y
# and feeds them to one tensor-core dot. Triton's software pipeliner keeps up
# to ``num_stages`` copies of both slices in shared memory (cp.async / TMA
# prefetch; on sm80 it needs num_stages - 1, on sm90 with wgmma
# num_stages), so the K-loop holds
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
# The Triton-language kernels are compiled ahead of time in CI for sm80,
# sm86, sm89, sm90 and sm100 with these entries, and Triton's own figures
# checked: shared memory within the limit (sm80 96 KB, sm86 / sm89 48 KB,
# sm90 / sm100 144 KB for bf16), no spills (ptxas gives most kernels all
# 255 registers a thread may have, and needs no local memory).
#
# Registers. The float32 logit tile lives in registers across the K-loop,
# ``block_q * block_k / (32 * num_warps)`` per thread, and the epilogue's
# exponentials need about as many again for a moment; ``REG_BUDGET`` (128
# of the 255 a thread may have) keeps the tile from spilling (a fully fused
# dX kernel with three 256-wide accumulators spilled on the H200:
# ``panel_backward``). Every entry fits its limit by the no-reuse bound
# (``SmemEstimate.total``) and the register budget, which the CPU tests
# check for every GPU kind.
#
# On the H200 the 227 KB entry is exact with both kernel sets, and the
# Triton-language kernels at least as fast as Pallas-Triton's
# (https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#loss); the
# Triton-language sigmoid's gap was its softplus (``kernels/triton/common.py``),
# not the tiles: of the forward variants probed on the H200 (4 warps, 4
# stages, 128-wide tiles) none was faster, 4 warps 10x slower; the backward
# variants were not probed.


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


def smem(bs: BlockSizes, dtype, kernel: str) -> SmemEstimate:
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


# 32-bit registers per thread the logit tile may take (see above).
REG_BUDGET = 128


def tile_registers(bs: BlockSizes, kernel: str) -> int:
  """32-bit registers per thread of the float32 logit tile of the forward
  (``"fwd"``) or backward (``"bwd"``) kernel."""
  if kernel == "fwd":
    return bs.block_q * bs.block_k // (32 * bs.num_warps)
  if kernel == "bwd":
    return bs.bwd_block_q * bs.bwd_block_k // (32 * bs.bwd_num_warps)
  raise ValueError(f"kernel must be 'fwd' or 'bwd', got {kernel!r}")


# name -> (the smallest per-block limit it is meant for, bf16/f16 config,
# float32 config). The bf16 configs of sm80 and sm86 are the faster on the
# H200 of two candidates each, both exact there at B = 4096 (the other and
# the times: https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#pallas-configs-for-smaller-gpus).
CONFIGS: dict[str, tuple[int, BlockSizes, BlockSizes]] = {
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


def config_name(capability) -> str:
  """The largest ``CONFIGS`` entry whose limit the GPU meets.

  Unknown capabilities get the H200 configs (``"smem227k"``); a GPU below
  every limit gets the smallest (best effort: Triton may still reject it).
  """
  limit = smem_limit(capability)
  if limit is None:
    return "smem227k"
  fitting = [(v[0], name) for name, v in CONFIGS.items() if v[0] <= limit]
  if not fitting:
    return min((v[0], name) for name, v in CONFIGS.items())[1]
  return max(fitting)[1]


def config(capability, dtype) -> BlockSizes:
  """The default ``BlockSizes`` of the Triton kernels on a GPU."""
  _, narrow, wide = CONFIGS[config_name(capability)]
  return wide if dtype is not None and np.dtype(dtype).itemsize >= 4 else narrow


# Off the GPU the kernels run in the interpreters, for tests: small tiles
# keep them quick and still give several blocks, programs and panels.
INTERPRET = BlockSizes(block_q=32, block_k=32, block_d=32, num_programs=2,
                       bwd_block_q=32, bwd_block_k=32, panel_rows=64)


def default(platform, capability, dtype) -> BlockSizes:
  """The default ``BlockSizes`` of the Triton kernels here."""
  if platform != "gpu":
    return INTERPRET
  return config(capability, dtype)


def default_here(platform, dtype) -> BlockSizes:
  """``default`` for the first device of ``platform`` (what a backend's
  ``default_block_sizes`` returns)."""
  cc = capability.device_capability() if platform == "gpu" else None
  return default(platform, cc, dtype)
