"""Mosaic GPU kernels for Hopper (``backend="mosaic"``), both families.

The kernels (``infcl_jax.kernels.mosaic``) are persistent and
warp-specialized: one TMA producer warpgroup streams x and y chunks through
a shared-memory ring, two consumer warpgroups run wgmma into float32
accumulators and the epilogues. The plumbing (padding, the panel loop and its
cuBLAS GEMMs, the shard_map typing of the panel carry) is
``padding`` and ``panel_backward``, shared with the Triton backend.

Which implementation each stage uses (bf16 / f16 inputs). Measured on one
H200, jax 0.11.2, B = 65536, D = 768, bf16, all in one job (the current
figures: https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#loss):

* softmax ``lse`` (both directions): Mosaic ``lse_fwd``, 11.59 ms
  (569 TFLOP/s); Triton 14.40 ms.
* softmax panel G: Mosaic ``g_panel``, 0.713 ms per
  4096-row panel (578 TFLOP/s); Triton 1.135 ms.
* sigmoid sum: Mosaic ``sigmoid_tiles("sum")``, 13.76 ms (480); Triton
  18.11 ms.
* sigmoid panel G: Mosaic ``sigmoid_tiles("g")``, 0.94 ms per 4096 rows
  (438); Triton 1.21 ms.
* dx = G y, dy += G^T x: cuBLAS (XLA), ~1.0-1.4 ms per 4096-row panel.

Full fwd+bwd step (loss, both embedding grads, scale and bias grads):
softmax 43.99 ms (600 TFLOP/s of 8 B^2 D) vs 52.82 ms with ``pallas``;
sigmoid 47.66 ms vs 56.56 ms; at B = 16384 softmax 2.87 vs 3.49 ms, sigmoid
2.97 vs 3.81 ms.

``STAGES`` holds the choice per stage ("mosaic" or "pallas"); a subclass
registered under its own name can override it (the tests run every hybrid).

float32 inputs: routed to the Triton path (``fallback``: the Triton kernels'
tile ops, ``triton_tiles.TritonTiles``, which the backend has beside its own
kernels), whose precisions are ``backends.precision``'s (TF32 with the
operands rounded to nearest and the positives put back in float32 from D = 64
on, 3-pass TF32 below it, IEEE float32 with "highest"). The Mosaic kernels
take 16-bit operands only (TF32 wgmma would need float32 SMEM tiles, half the
K-depth per stage, and is not written). That path runs the Triton-language
kernels (``backend="triton"``'s) where the triton extra imports, else
Pallas-Triton's (``TRITON_PATH``): a device profile of the float32 softmax
step at B = 65,536 on the H200 put the first at 108.2 ms and the second at
143.0 ms, the kernels 56.7 against 92.0 ms of it (the float32 GEMMs, ~50 ms,
are the same cuBLAS calls).

Where it runs: sm90 only (``RUNS_ON``, read by ``capability.support``). On
any other GPU ``backend="mosaic"`` fails in one line that names the GPU and
the backend ``auto`` picks there; ``auto`` picks "mosaic" on sm90 alone.

Block sizes: the defaults are this backend's own (``GPU_TILES``, and
``INTERPRET_TILES`` off the GPU; float32 takes the Triton path's). A
user's ``BlockSizes`` keeps its meaning where the kernels allow it.
``block_q`` / ``bwd_block_q`` are rows per CTA tile (64 or 128);
``block_k`` / ``bwd_block_k`` are columns per CTA tile (128 or 256: the two
consumers take half each); ``block_d`` is the K-step (64: one 128-byte
swizzled row of bf16). Other values are rounded to the nearest allowed one
(so Triton-tuned sizes, e.g. the H200's 128 x 256 x 64, map one to one).
The pipeline depths and the kernels' other settings are the kernels' own
defaults (``kernels.mosaic``): what fits 227 KB of shared memory and
measured fastest; the backend runs them as they are. ``num_programs``, ``panel_rows`` (rounded up to a multiple of
``bwd_block_q``), ``single_exp`` and ``bwd_impl`` are read
as in the Triton backend.

Padding: x rows to ``block_q``, y rows to ``block_k`` (two consumer
halves), D to 64; the kernels mask the padding.

Off the GPU the same kernel bodies run in jax's Mosaic GPU interpreter
(``interpret=True``), which simulates the warpgroups, TMA and mbarriers on
the CPU (slow; for tests).

Groups (``groups=``, ``base``): the Mosaic kernels take the rows' and
columns' int32 ids behind a static switch (a call without them compiles
the ungrouped kernels, unchanged), loaded like the kernels' other per-row /
per-column vectors; per logit one compare and one select
(``kernels.mosaic``). The softmax kernels run on rows and columns sorted
by id (``GroupOrder``) and pay the compare and select only in the tiles
whose id ranges overlap (``kernels.mosaic.group_tiles``). The Triton path is
handed the ids only when given.

Inside ``shard_map``: the Mosaic kernels' outputs are typed device-varying
like their inputs (``kernels.mosaic.common.vary_like``), the panel carry by
``panel_backward.panel_backward``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from infcl_jax import _device
from infcl_jax.backends import base
from infcl_jax.backends import capability
from infcl_jax.backends import pallas
from infcl_jax.backends import panel_backward as pb
from infcl_jax.backends.padding import check_int32
from infcl_jax.backends.padding import pad_ids
from infcl_jax.backends.padding import pad_inputs
from infcl_jax.backends.padding import round_up
from infcl_jax.backends.padding import row_ids
from infcl_jax.block_sizes import BlockSizes
from infcl_jax.kernels.mosaic import group_tiles
from infcl_jax.kernels.mosaic import common as mcommon
from infcl_jax.kernels.mosaic import g_panel as mg_panel
from infcl_jax.kernels.mosaic import lse_fwd as mlse_fwd
from infcl_jax.kernels.mosaic import sigmoid as msigmoid

F32 = jnp.float32
def _rows(v):
  return 64 if v <= 64 else 128


def _cols(v):
  # Columns per CTA tile: two consumer halves of 64 or 128.
  return 128 if v <= 128 else 256


def mosaic_blocks(bs: BlockSizes) -> BlockSizes:
  """``bs`` rounded to the block shapes the Mosaic kernels take: rows per CTA
  tile 64 or 128, columns per CTA tile 128 or 256 (a kernel's ``block_k``
  is one consumer's half), the K-step 64, panels of whole row blocks."""
  bwd_bq = _rows(bs.bwd_block_q)
  return dataclasses.replace(
      bs, block_q=_rows(bs.block_q), block_k=_cols(bs.block_k), block_d=64,
      bwd_block_q=bwd_bq, bwd_block_k=_cols(bs.bwd_block_k),
      panel_rows=round_up(bs.panel_rows, bwd_bq))


# The Mosaic kernels' own default tiles (bf16 / f16): 128-row CTA tiles of
# 2 x 128 columns (one half per consumer), K-step 64 (one 128-byte swizzled
# row of bf16), 4096-row panels. Off the GPU, for the interpreter, the
# smallest tiles the kernels take, two programs: several tiles, programs and
# panels even on small test shapes.
GPU_TILES = BlockSizes(block_q=128, block_k=256, block_d=64,
                       bwd_block_q=128, bwd_block_k=256, panel_rows=4096)
INTERPRET_TILES = BlockSizes(block_q=64, block_k=128, block_d=64,
                             num_programs=2, bwd_block_q=64,
                             bwd_block_k=128, panel_rows=64)


class MosaicBackend(base.KernelBackend):
  """Mosaic GPU tiles for bf16 / f16; the Triton path (``fallback``) for the
  rest."""

  name = "mosaic"
  # Hopper only: wgmma and TMA are sm90 instructions; sm100 (B200) has
  # neither wgmma nor a Mosaic GPU lowering tested here.
  RUNS_ON = capability.RunsOn(
      tuned=((9, 0),), unknown_gpu=capability.UNSUPPORTED,
      needs="an sm90 GPU (H100, H200: its kernels use Hopper's wgmma)")
  # Per stage: "mosaic" (the Mosaic GPU kernel) or "pallas" (Triton's).
  STAGES = {"lse": "mosaic", "lse_grad": "mosaic", "sigmoid_sum": "mosaic",
            "sigmoid_grad": "mosaic"}
  # ``groups=`` (``base.KernelBackend.GROUPS``): the Mosaic kernels take
  # the group ids; the Triton path passes them to its own kernels.
  # ``diagonal=``: the ids (i, i) of the kernels' groups, already sorted, so
  # without ``GroupOrder``'s sorts and permutations: the kernels mask only
  # the column blocks that cross a row block's diagonal.
  DIAGONAL = True
  # Whose Triton kernels the Triton path (float32 inputs, stages set to
  # "pallas") runs: "triton" (the Triton-language ones where the extra
  # imports, else Pallas-Triton's; the faster, see above) or "pallas"
  # (always Pallas-Triton's).
  TRITON_PATH = "triton"

  def __init__(self, platform: str | None = None):
    super().__init__(platform=platform)
    # The capability rule decides (off the GPU: the interpreter).
    self.mosaic_ok = capability.support(
        self.RUNS_ON, self.platform,
        capability.device_info(self.platform)) in (capability.NATIVE,
                                                   capability.INTERPRET)
    if self.TRITON_PATH not in ("pallas", "triton"):
      raise ValueError(f"{type(self).__name__}.TRITON_PATH must be 'pallas' "
                       f"or 'triton', got {self.TRITON_PATH!r}")
    # The Triton path: the tile ops of the Triton kernels for this backend.
    self.fallback = self._triton_kernels().tiles(self)

  def _triton_kernels(self):
    """The Triton-language kernels when ``TRITON_PATH`` asks for them and
    they can run compiled here (the triton extra imports), else
    Pallas-Triton's (which also run in the interpreter off the GPU)."""
    if self.TRITON_PATH == "triton" and not self.interpret:
      try:
        from infcl_jax.backends import triton as triton_backend  # pylint: disable=import-outside-toplevel
      except ImportError:
        pass
      else:
        return triton_backend.KERNELS
    return pallas.KERNELS

  def _mosaic(self, stage, *arrays):
    return (self.mosaic_ok and self.STAGES[stage] == "mosaic"
            and all(jnp.dtype(a.dtype) in mcommon.SUPPORTED_DTYPES
                    for a in arrays)
            and len({jnp.dtype(a.dtype) for a in arrays}) == 1)

  def default_block_sizes(self, platform, dtype):
    """Mosaic's own tiles for the 16-bit inputs its kernels take; the Triton
    path's defaults for the rest (float32)."""
    if jnp.dtype(dtype) not in mcommon.SUPPORTED_DTYPES:
      return self.fallback.default_block_sizes(platform, dtype)
    return GPU_TILES if platform == "gpu" else INTERPRET_TILES

  @staticmethod
  def _panel_layout(mb, n, m, d):
    # Columns pad to the CTA's two consumer halves.
    return pb.panel_layout(n, m, d, block_q=mb.bwd_block_q,
                           block_k=mb.bwd_block_k, block_d=mb.block_d,
                           panel_rows=mb.panel_rows)

  @staticmethod
  def _padded_groups(groups, xp, yp):
    """The group ids padded like the inputs (``pad_ids``), or None."""
    if groups is None:
      return None
    gx, gy = groups
    return pad_ids(gx, xp.shape[0]), pad_ids(gy, yp.shape[0])

  # ------------------------------------------------------------ softmax

  def _lse(self, x, y, scale, bias, *, rows, cols, bs, groups=None,
           diagonal=False):
    if diagonal:
      groups = _iota_ids(x, y)
    if not self._mosaic("lse", x, y):
      return self.fallback.lse(x, y, scale, bias, rows=rows, cols=cols,
                               bs=bs, **_group_kw(groups))
    mb = mosaic_blocks(bs)
    n, m = x.shape[0], y.shape[0]
    nprog = bs.num_programs or _device.num_sms()

    def lse(x, y, groups):
      xp, yp = pad_inputs(x, y, mb.block_q, mb.block_k, mb.block_d)
      check_int32(self.name, column_workspace=min(
          nprog, xp.shape[0] // mb.block_q) * yp.shape[0])
      return mlse_fwd.lse_fwd(
          xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
          rows=rows, cols=cols, block_q=mb.block_q, block_k=mb.block_k // 2,
          block_d=mb.block_d,
          num_programs=nprog, interpret=self.interpret,
          single_exp=bs.single_exp,
          groups=self._padded_groups(groups, xp, yp))

    if groups is None or diagonal:
      return lse(x, y, groups)
    order = GroupOrder(groups)
    r, c = lse(order.rows(x), order.cols(y), order.groups)
    return order.rows_back(r), order.cols_back(c)

  def _lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
                col_coef, *, bs, groups=None, diagonal=False):
    if diagonal:
      groups = _iota_ids(x, y)
    if not self._mosaic("lse_grad", x, y):
      return self.fallback.lse_grad(x, y, scale, bias, row_lse, col_lse,
                                    row_coef, col_coef, bs=bs,
                                    **_group_kw(groups))
    mb = mosaic_blocks(bs)
    panel = None if bs.bwd_impl == "xla" else functools.partial(
        mg_panel.g_panel, g_dtype=x.dtype, block_q=mb.bwd_block_q,
        block_k=mb.bwd_block_k // 2, block_d=mb.block_d,
        num_programs=bs.num_programs, interpret=self.interpret)

    def tiles(gx, gy, rows):
      # Every panel's tile order at once (a few XLA ops, not a few per
      # panel).
      return jax.vmap(lambda g: group_tiles.tile_order(
          g, gy, mb.bwd_block_q, mb.bwd_block_k))(gx.reshape(-1, rows))

    grad = lambda x, y, row_lse, col_lse, groups: pb.softmax_grad(
        x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
        layout=self._panel_layout(mb, x.shape[0], y.shape[0], x.shape[1]),
        precision=self.precision(bs, x.dtype, x.shape[-1]), panel=panel,
        groups=groups,
        group_tiles=None if panel is None else tiles)
    if groups is None or panel is None or diagonal:
      return grad(x, y, row_lse, col_lse, groups)
    order = GroupOrder(groups)
    dx, dy, dscale, dbias = grad(order.rows(x), order.cols(y),
                                 order.rows(row_lse), order.cols(col_lse),
                                 order.groups)
    return order.rows_back(dx), order.cols_back(dy), dscale, dbias

  # ------------------------------------------------------------ sigmoid

  def _sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, bs,
                   groups=None, group_mode="mask"):
    if not self._mosaic("sigmoid_sum", x, y):
      return self.fallback.sigmoid_sum(x, y, scale, bias,
                                       has_diagonal=has_diagonal, bs=bs,
                                       **_group_kw(groups, group_mode))
    n, m = x.shape[0], y.shape[0]
    mb = mosaic_blocks(bs)
    xp, yp = pad_inputs(x, y, mb.block_q, mb.block_k, mb.block_d)
    params = jnp.stack([jnp.asarray(scale, F32), jnp.asarray(bias, F32),
                        jnp.ones((), F32), jnp.zeros((), F32)])
    return msigmoid.sigmoid_tiles(
        xp, yp, row_ids(n, xp.shape[0]), params, mode="sum", m=m,
        mask=xp.shape[0] != n or yp.shape[0] != m, has_diagonal=has_diagonal,
        block_q=mb.block_q, block_k=mb.block_k // 2, block_d=mb.block_d,
        num_programs=bs.num_programs, interpret=self.interpret,
        groups=self._padded_groups(groups, xp, yp), group_mode=group_mode)

  def _sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal, bs,
                    groups=None, group_mode="mask"):
    if not self._mosaic("sigmoid_grad", x, y):
      return self.fallback.sigmoid_grad(x, y, scale, bias, coef,
                                        has_diagonal=has_diagonal, bs=bs,
                                        **_group_kw(groups, group_mode))
    mb = mosaic_blocks(bs)

    def panel(x_p, yp, rid_p, params, mode, **kw):
      return msigmoid.sigmoid_tiles(
          x_p, yp, rid_p, params, mode=mode, block_q=mb.bwd_block_q,
          block_k=mb.bwd_block_k // 2, block_d=mb.block_d,
          num_programs=bs.num_programs, interpret=self.interpret, **kw)

    return pb.sigmoid_grad(
        x, y, scale, bias, coef, has_diagonal=has_diagonal,
        layout=self._panel_layout(mb, x.shape[0], y.shape[0], x.shape[1]),
        precision=self.precision(bs, x.dtype, x.shape[-1]),
        panel=None if bs.bwd_impl == "xla" else panel,
        **({} if groups is None else {
            "groups": groups, "group_mode": group_mode,
            "diagonal_outside": self.GROUP_DIAGONAL_OUTSIDE}))


class GroupOrder:
  """The rows and the columns of a grouped tile sorted by group id.

  The softmax kernels run on sorted rows and columns: a row block's related
  pairs then lie in the few column blocks that hold its ids, and every
  other tile runs without the compare and select
  (``kernels.mosaic.group_tiles``). The sorts and permutations cost
  O(B log B + B D) beside the tiles' O(B^2 D); what the kernels return is
  put back in the caller's order.
  """

  def __init__(self, groups):
    gx, gy = groups
    self._px, self._py = jnp.argsort(gx), jnp.argsort(gy)
    self.groups = (gx[self._px], gy[self._py])

  def rows(self, a):
    return None if a is None else a[self._px]

  def cols(self, a):
    return None if a is None else a[self._py]

  def rows_back(self, a):
    return None if a is None else a[_inverse(self._px)]

  def cols_back(self, a):
    return None if a is None else a[_inverse(self._py)]


def _iota_ids(x, y):
  """The group ids that relate exactly the pairs (i, i): sorted."""
  return (jnp.arange(x.shape[0], dtype=jnp.int32),
          jnp.arange(y.shape[0], dtype=jnp.int32))


def _inverse(p):
  return jnp.zeros_like(p).at[p].set(jnp.arange(p.shape[0], dtype=p.dtype))


def _group_kw(groups, group_mode=None):
  """``groups`` (and ``group_mode``) for the Triton path, only when given:
  without them its calls stay as they are."""
  if groups is None:
    return {}
  kw = {"groups": groups}
  if group_mode is not None:
    kw["group_mode"] = group_mode
  return kw


BACKEND = MosaicBackend
