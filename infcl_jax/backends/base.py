"""What every tile backend shares: the seam's guards, block sizes, precision.

A backend subclasses ``TileBackend`` and implements the underscored operations
(``_lse``, ``_lse_grad``, ``_sigmoid_sum``, ``_sigmoid_grad``) of the families
it lists; a backend of GPU kernels subclasses ``KernelBackend`` (interpret
mode off the GPU), which has the kernels it runs and hands those operations to
their tile ops. The public operations of the seam (``registry.SoftmaxTiles`` /
``SigmoidTiles``) are defined here once, so that each guard has one home: a
softmax call that asks for no statistic, a sigmoid block pair whose diagonal
cannot exist, the block sizes resolved (with the backend's defaults) and the
float32 precision policy (``precision``).

Groups. Every operation takes ``groups=None`` or ``(gx, gy)``: (n,) and
(m,) int32 group ids of the tile's rows and columns; pair (i, j) is
*related* when ``gx[i] == gy[j]``. The softmax tiles leave related pairs out
of both LSEs and their gradient (the loss puts its own positive back:
``losses.groups``); a row or column with only related pairs has LSE -inf.
The sigmoid tiles treat them by ``group_mode``: "mask" leaves related pairs
out of the sum (the diagonal of ``has_diagonal`` stays a positive),
"positives" gives them the label z = +1. A backend that implements groups
sets ``GROUPS = True`` and accepts the keyword in its underscored
operations.

The sigmoid tiles of a diagonal block pair with groups run without the
diagonal's test where a backend sets ``GROUP_DIAGONAL_OUTSIDE`` (it costs
a compare and a select or an or per logit, which a latency-bound kernel
pays in full): they treat only the related pairs ("mask": drop them,
"positives": make them positives), and the diagonal's terms are corrected
here (``panel_backward.diagonal_sum_fix``; the gradient's in
``panel_backward.sigmoid_grad``), O(B * D) beside the tiles' O(B^2 * D).
The correction depends on the ids per row, not on a branch: a ``lax.cond``
on the ids would cost the GPU a host round trip per call.

Positives. The softmax operations also take ``positives=None`` or an (n,)
int32 vector: for each row, one column of y that is left out like a related
pair (the row's positive; -1: none), together with ``groups=``: a row whose
positive is not in its group (``labels=``, or a pair of id arrays) needs
both, and no one id per row and per column can say that (the loss keeps
every positive out of its tiles: ``losses.softmax``). A backend that
implements it sets ``POSITIVES = True``; the others' calls with
``positives=`` run the ``xla`` backend's tiles instead (exact, at XLA's
speed, with an ``InfclPerformanceWarning`` on the GPU the first time).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from infcl_jax.backends import capability
from infcl_jax.backends import panel_backward as pb
from infcl_jax.backends import precision as precision_lib
from infcl_jax.backends import registry

F32 = jnp.float32


GROUP_MODES = ("mask", "positives")


def check_diagonal(has_diagonal, n, m):
  if has_diagonal and n != m:
    raise ValueError(
        "has_diagonal=True needs square block pairs (positives at i == j), "
        f"got x with {n} rows and y with {m} rows")


class TileBackend:
  """The seam's operations with their guards; subclasses do the tiles."""

  name = "base"
  families: tuple[str, ...] = ()
  # Float32 inputs without an explicit setting: see ``precision``.
  F32_DEFAULT = "highest"
  # Whether the underscored operations accept ``groups=`` (see above).
  GROUPS = False
  # Whether grouped sigmoid tiles run without their diagonal (see
  # above); the backend's ``_sigmoid_grad`` passes it to
  # ``panel_backward.sigmoid_grad``.
  GROUP_DIAGONAL_OUTSIDE = False
  # Whether the softmax operations take ``diagonal=True`` themselves (see
  # ``lse``); otherwise they get it as the group ids (i, i): an iota.
  DIAGONAL = False
  # Whether the softmax operations take ``positives=`` (see above);
  # otherwise those calls run on the ``xla`` backend's tiles.
  POSITIVES = False

  def __init__(self, platform: str | None = None):
    self.platform = platform or jax.default_backend()

  # ------------------------------------------------------- configuration

  def default_block_sizes(self, platform, dtype):
    raise NotImplementedError

  def block_sizes(self, block_sizes, dtype):
    """``block_sizes``, or this backend's default for ``dtype`` here."""
    if block_sizes is None:
      return self.default_block_sizes(self.platform, dtype)
    if not block_sizes.tiles:
      return block_sizes.over(self.default_block_sizes(self.platform, dtype))
    return block_sizes

  def precision(self, bs, dtype, depth):
    """The precision of this backend's XLA matmuls for inputs of ``dtype``
    and embedding depth ``depth`` (one policy: ``backends.precision``;
    "high" as XLA takes it here: ``xla_dot_precision``)."""
    return precision_lib.xla_dot_precision(
        precision_lib.matmul_precision(dtype, bs.f32_precision,
                                       self.F32_DEFAULT, depth),
        self.platform)

  def _group_kw(self, x, y, groups, group_mode=None, diagonal=False):
    """The keywords that pass ``groups`` (or ``diagonal``) on, after the
    guards."""
    if diagonal:
      if groups is not None:
        raise ValueError("diagonal=True and groups= cannot be combined")
      if self.DIAGONAL:
        return {"diagonal": True}
      groups = (jnp.arange(x.shape[0], dtype=jnp.int32),
                jnp.arange(y.shape[0], dtype=jnp.int32))
    if groups is None:
      return {}
    if not self.GROUPS:
      raise NotImplementedError(
          f"backend={self.name!r} does not implement groups=; use "
          f"backend='xla' (or 'auto', which picks a backend that does)")
    gx, gy = groups
    if gx.shape != (x.shape[0],) or gy.shape != (y.shape[0],):
      raise ValueError(
          f"groups must be ((n,), (m,)) for a {x.shape[0]} x {y.shape[0]} "
          f"tile, got {gx.shape} and {gy.shape}")
    kw = {"groups": (gx.astype(jnp.int32), gy.astype(jnp.int32))}
    if group_mode is not None:
      if group_mode not in GROUP_MODES:
        raise ValueError(f"group_mode must be one of {GROUP_MODES}, got "
                         f"{group_mode!r}")
      kw["group_mode"] = group_mode
    return kw

  def _positives_backend(self, x, positives, diagonal):
    """None, or the backend that runs a call with ``positives`` (this one
    where it implements them, else ``xla``), after the guards."""
    if positives is None:
      return None
    if diagonal:
      raise ValueError("diagonal=True and positives= cannot be combined")
    if positives.shape != (x.shape[0],):
      raise ValueError(f"positives must be ({x.shape[0]},) for a tile of "
                       f"{x.shape[0]} rows, got {positives.shape}")
    if self.POSITIVES:
      return self
    if self.platform == "gpu":
      capability.warn_once(
          f"positives-{self.name}",
          f"infcl_jax: backend={self.name!r} runs a grouped softmax whose "
          f"positives may lie outside their groups (labels= with groups=, "
          f"or a pair of id arrays in group_mode='mask') on the 'xla' "
          f"backend's tiles: exact, but slower than its kernels.",
          stacklevel=6)
    # Through the registry: ``xla`` builds on this module.
    return registry.get("xla", "softmax", self.platform)

  # ------------------------------------------------------------ softmax

  def lse(self, x, y, scale, bias, *, rows, cols, block_sizes=None,
          groups=None, diagonal=False, positives=None):
    """(row_lse (n,), col_lse (m,)), float32; None where not asked for.

    ``diagonal``: the pairs (i, i) (x row i, y row i) are left out, as
    related pairs are (a confident loss keeps its positive out of the
    tiles: ``losses.terms.confident``); only the tiles that cross the
    diagonal need the mask. ``positives``: (n,) int32, each row's one
    more column left out (-1: none), with or without ``groups``.
    """
    if not (rows or cols):
      return None, None
    other = self._positives_backend(x, positives, diagonal)
    if other is not None and other is not self:
      return other.lse(x, y, scale, bias, rows=rows, cols=cols,
                       block_sizes=block_sizes, groups=groups,
                       positives=positives)
    kw = {} if other is None else {"positives": positives.astype(jnp.int32)}
    return self._lse(x, y, scale, bias, rows=rows, cols=cols,
                     bs=self.block_sizes(block_sizes, x.dtype),
                     **self._group_kw(x, y, groups, diagonal=diagonal), **kw)

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
               *, block_sizes=None, groups=None, diagonal=False,
               positives=None):
    """(dx, dy, dscale, dbias), float32; a None statistic has no term."""
    if row_lse is None and col_lse is None:
      zero = jnp.zeros((), F32)
      return (jnp.zeros(x.shape, F32), jnp.zeros(y.shape, F32), zero, zero)
    other = self._positives_backend(x, positives, diagonal)
    if other is not None and other is not self:
      return other.lse_grad(x, y, scale, bias, row_lse, col_lse, row_coef,
                            col_coef, block_sizes=block_sizes, groups=groups,
                            positives=positives)
    kw = {} if other is None else {"positives": positives.astype(jnp.int32)}
    return self._lse_grad(x, y, scale, bias, row_lse, col_lse, row_coef,
                          col_coef, bs=self.block_sizes(block_sizes, x.dtype),
                          **self._group_kw(x, y, groups, diagonal=diagonal),
                          **kw)

  # ------------------------------------------------------------ sigmoid

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal, block_sizes=None,
                  groups=None, group_mode="mask"):
    """sum_ij softplus(-z_ij * s_ij) over the block pair, float32 scalar."""
    check_diagonal(has_diagonal, x.shape[0], y.shape[0])
    kw = self._group_kw(x, y, groups, group_mode)
    outside = (has_diagonal and groups is not None
               and self.GROUP_DIAGONAL_OUTSIDE)
    total = self._sigmoid_sum(
        x, y, scale, bias, has_diagonal=has_diagonal and not outside,
        bs=self.block_sizes(block_sizes, x.dtype), **kw)
    if outside:
      total += pb.diagonal_sum_fix(x, y, scale, bias, kw["groups"],
                                   group_mode)
    return total

  def sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal,
                   block_sizes=None, groups=None, group_mode="mask"):
    """(dx, dy, dscale, dbias) of ``coef * sigmoid_sum``, all float32: the
    tile gradient is G_ij = coef * (-z_ij) * sigmoid(-z_ij * s_ij)."""
    check_diagonal(has_diagonal, x.shape[0], y.shape[0])
    return self._sigmoid_grad(
        x, y, scale, bias, coef, has_diagonal=has_diagonal,
        bs=self.block_sizes(block_sizes, x.dtype),
        **self._group_kw(x, y, groups, group_mode))


class KernelBackend(TileBackend):
  """A backend of GPU kernels: interpret mode off the GPU, and its kernels.

  Off the GPU the kernels run through their interpreter: exact, but several
  times slower than ``backend="xla"``; the first kernel call in a process
  warns about it (``capability.InfclPerformanceWarning``). On the GPU each
  backend's ``default_block_sizes`` follow the device, so that they fit its
  shared memory.

  A kernel backend has the kernels it runs. ``KERNELS`` is its kernel set
  (``triton_tiles.Kernels``), whose tile ops (``tiles``, made for this
  backend: ``triton_tiles.TritonTiles``) compute the underscored operations
  and give the default block sizes; a backend that computes them itself
  (``mosaic``) leaves it None and overrides them.

  Every kernel backend here implements both families with ``groups=``, and
  runs the grouped sigmoid tiles of a diagonal block pair without the
  diagonal's test (``GROUP_DIAGONAL_OUTSIDE``, above).
  """

  name = "kernel"
  families = ("softmax", "sigmoid")
  GROUPS = True
  # Without the diagonal's test per logit the grouped "mask" sigmoid ran
  # 8.6 points faster with Pallas-Triton on an H200, and the Triton-language
  # sigmoid panel (latency-bound: one 8-warp CTA per SM) 17% faster.
  GROUP_DIAGONAL_OUTSIDE = True
  # float32 within 1e-3 of float64 by default: TF32 with the positive put
  # back where the depth allows it, else 3-pass TF32 (``backends.precision``).
  F32_DEFAULT = precision_lib.BY_DEPTH
  # The kernel set (see above), or None.
  KERNELS = None

  def __init__(self, platform: str | None = None):
    super().__init__(platform)
    # Anything but a GPU runs the same kernels through the interpreter.
    self.interpret = self.platform != "gpu"
    self.tiles = None if self.KERNELS is None else self.KERNELS.tiles(self)

  def warn_if_interpreted(self):
    """Warns once per process when this backend's kernels are interpreted.

    Called on every kernel op (through ``block_sizes``), not on
    construction, so that probing a backend (``registry.available``) is
    silent.
    """
    if self.interpret:
      capability.warn_once(
          "interpret",
          f"infcl_jax: backend={self.name!r} runs its GPU kernels in "
          f"interpret mode on platform {self.platform!r} (they are GPU "
          f"kernels): exact, but several times slower than backend='xla'. "
          f"Use backend='auto' or 'xla' off the GPU.", stacklevel=5)

  def block_sizes(self, block_sizes, dtype):
    self.warn_if_interpreted()
    bs = super().block_sizes(block_sizes, dtype)
    bs.check_pallas()
    return bs

  # ----------------------------------------------- the kernels' tile ops

  def default_block_sizes(self, platform, dtype):
    return self.tiles.default_block_sizes(platform, dtype)

  def _lse(self, x, y, scale, bias, **kw):
    return self.tiles.lse(x, y, scale, bias, **kw)

  def _lse_grad(self, *args, **kw):
    return self.tiles.lse_grad(*args, **kw)

  def _sigmoid_sum(self, x, y, scale, bias, **kw):
    return self.tiles.sigmoid_sum(x, y, scale, bias, **kw)

  def _sigmoid_grad(self, *args, **kw):
    return self.tiles.sigmoid_grad(*args, **kw)
