"""The tile ops of both Triton backends, written once.

``pallas`` (Pallas' Triton lowering, ``pallas.py``) and ``triton``
(Triton-language kernels through jax-triton, ``triton.py``) run the
same algorithms with the same block sizes: the fused forward sweeps and the
panel backward (``panel_backward``) over the padded inputs (``padding``).
They differ only in the four kernel entry points, which a subclass names
(``KERNELS``, a ``Kernels`` of its kernel package); everything around them
(padding, the int32 guard, the persistent grid size, the panel layout and
math, the precision policy) is here.

Groups (``backends.base``): the forward kernels take the rows' and columns'
group ids padded like the inputs, the panel kernels the panel's and the
columns' (``panel_backward``); without groups the kernels are the same
programs as ever (the groups are a static switch of each kernel).

A kernel set (``KERNELS``) has four functions with the contracts of the
Pallas-Triton kernels (``kernels.pallas.lse_fwd.lse_fwd``,
``kernels.pallas.lse_bwd.g_panel``, ``kernels.pallas.sigmoid_fwd
.sigmoid_row_sums``, ``kernels.pallas.sigmoid_bwd.g_panel``); ``_kernel_kw``
adds the subclass's own keyword arguments (Pallas' ``interpret``).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp

from infcl_jax import _device
from infcl_jax.backends import capability
from infcl_jax.backends import kernel_backend
from infcl_jax.backends import panel_backward as pb
from infcl_jax.backends import precision as precision_lib
from infcl_jax.backends.padding import check_int32
from infcl_jax.backends.padding import pad1
from infcl_jax.backends.padding import pad_inputs

F32 = jnp.float32


class Kernels:
  """The four kernel entry points of a Triton backend, taken from its kernel
  package's four modules: both packages (``infcl_jax.kernels`` and
  ``infcl_jax.kernels.triton``) give them the same names."""

  def __init__(self, lse_fwd, lse_bwd, sigmoid_fwd, sigmoid_bwd):
    self.lse_fwd: Callable = lse_fwd.lse_fwd
    self.lse_panel: Callable = lse_bwd.g_panel
    self.sigmoid_rows: Callable = sigmoid_fwd.sigmoid_row_sums
    self.sigmoid_panel: Callable = sigmoid_bwd.g_panel


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


class TritonTilesBackend(kernel_backend.KernelBackend):
  """Both families over a subclass's ``KERNELS``."""

  families = ("softmax", "sigmoid")
  GROUPS = True
  # Where Triton's kernels run, for both launch paths: every GPU from sm80
  # whose shared memory per block is known (the configs fit it). Newer GPUs
  # are untested; below sm80 Triton has no bfloat16 dot.
  RUNS_ON = capability.RunsOn(
      tuned=tuple(cc for cc in capability.SMEM_PER_BLOCK if cc >= (8, 0)),
      floor=(8, 0), unknown_gpu=capability.UNTESTED,
      needs="an NVIDIA GPU of compute capability 8.0 or newer (Triton has "
            "no bfloat16 dot below)")

  # Without the diagonal's test per logit the grouped "mask" sigmoid ran
  # 8.6 points faster with Pallas-Triton on an H200, and the Triton-language
  # sigmoid panel (latency-bound: one 8-warp CTA per SM) 17% faster.
  GROUP_DIAGONAL_OUTSIDE = True
  KERNELS: Kernels  # The subclass's kernel set.

  def kernels(self) -> Kernels:
    return self.KERNELS

  def _kernel_kw(self) -> dict:
    return {}

  def _kernel_precision(self, prec):
    """What the kernels take for ``prec`` (a ``lax.Precision``; the
    Triton-language kernels map it to ``tl.dot``'s input precision)."""
    return prec

  def _operands(self, x, y, bs):
    """x and y as the kernels take them: on TF32 tiles, compiled, rounded
    to nearest TF32 (``backends.precision``: Triton's TF32 dot truncates);
    the interpreters' dots are exact float32, so there as they are."""
    if self.interpret or not precision_lib.tf32_tiles(
        x.dtype, bs.f32_precision, self.F32_DEFAULT, x.shape[-1]):
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

  def _lse(self, x, y, scale, bias, *, rows, cols, bs, groups=None):
    n, m = x.shape[0], y.shape[0]
    x, y = self._operands(x, y, bs)
    xp, yp = pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    nprog = bs.num_programs or _device.num_sms()
    check_int32(self.name, column_workspace=min(
        nprog, xp.shape[0] // bs.block_q) * yp.shape[0])
    return self.kernels().lse_fwd(
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
    ("high", "highest") and in the exact interpreters G stays float32."""
    return not self.interpret and precision_lib.tf32_tiles(
        x.dtype, bs.f32_precision, self.F32_DEFAULT, x.shape[-1])

  def _lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
                col_coef, *, bs, groups=None):
    prec = self.precision(bs, x.dtype, x.shape[-1])
    half = self._half_panels(x, bs)
    x, y = self._operands(x, y, bs)
    panel = None if bs.bwd_impl == "xla" else functools.partial(
        self.kernels().lse_panel, g_dtype=jnp.float16 if half else x.dtype,
        block_q=bs.bwd_block_q,
        block_k=bs.bwd_block_k, block_d=bs.block_d,
        num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages,
        precision=self._kernel_precision(prec), single_exp=bs.single_exp,
        **self._kernel_kw())
    return pb.softmax_grad(
        x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
        layout=layout(bs, x, y), precision=prec, panel=panel,
        gemm_dtype=jnp.float16 if half else None,
        **({} if groups is None else {"groups": groups}))

  # ------------------------------------------------------------ sigmoid

  def _sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, bs,
                   groups=None, group_mode="mask"):
    n, m = x.shape[0], y.shape[0]
    x, y = self._operands(x, y, bs)
    xp, yp = pad_inputs(x, y, bs.block_q, bs.block_k, bs.block_d)
    rows = self.kernels().sigmoid_rows(
        xp, yp, jnp.asarray(scale, F32), jnp.asarray(bias, F32), n=n, m=m,
        has_diagonal=has_diagonal, block_q=bs.block_q, block_k=bs.block_k,
        block_d=bs.block_d, target_programs=bs.num_programs or _device.num_sms(),
        num_warps=bs.num_warps, num_stages=bs.num_stages,
        precision=self._kernel_precision(
            self.precision(bs, x.dtype, x.shape[-1])),
        **self._groups_kw(groups, xp, yp, group_mode), **self._kernel_kw())
    return jnp.sum(rows)

  def _sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal, bs,
                    groups=None, group_mode="mask"):
    prec = self.precision(bs, x.dtype, x.shape[-1])
    kprec = self._kernel_precision(prec)
    x, y = self._operands(x, y, bs)
    kernel, kernel_kw = self.kernels().sigmoid_panel, self._kernel_kw()

    def panel(x_p, yp, rid_p, params, mode, **kw):
      return kernel(
          x_p, yp, rid_p, params, mode=mode, g_dtype=x.dtype,
          block_q=bs.bwd_block_q, block_k=bs.bwd_block_k, block_d=bs.block_d,
          num_warps=bs.bwd_num_warps, num_stages=bs.bwd_num_stages,
          precision=kprec, **kernel_kw, **kw)

    return pb.sigmoid_grad(
        x, y, scale, bias, coef, has_diagonal=has_diagonal,
        layout=layout(bs, x, y), precision=prec,
        panel=None if bs.bwd_impl == "xla" else panel,
        **({} if groups is None else {
            "groups": groups, "group_mode": group_mode,
            "diagonal_outside": self.GROUP_DIAGONAL_OUTSIDE}))
