"""The seam between the losses and the code that computes tiles.

A loss (single-device, ring, gather) needs only two block-level operations on
one pair of embedding blocks x (n, D) and y (m, D), with logits
``s = scale * x @ y.T + bias``:

* ``lse(x, y, scale, bias, rows=..., cols=...)`` -> (row_lse (n,), col_lse (m,))
  in float32, either one ``None`` when not asked for. One sweep over the tiles
  gives both.
* ``lse_grad(x, y, scale, bias, row_lse, col_lse, row_coef, col_coef)``
  -> (dx, dy, dscale, dbias), all float32, for the tile gradient

      G_ij = row_coef * exp(s_ij - row_lse_i) + col_coef * exp(s_ij - col_lse_j)

  as dx = scale * G @ y, dy = scale * G.T @ x, dscale = sum(G * x @ y.T),
  dbias = sum(G). A ``None`` lse means its coefficient is zero.

The positive (diagonal) term of the loss is O(B * D) and handled by the loss,
not by the tiles, so a backend never needs to know where positives are. The
row / column LSE passed to ``lse_grad`` may be *global* statistics (merged
over other blocks or devices), which is what lets the ring reuse the same
code for every tile it visits.

The sigmoid (SigLIP) loss is a second *family* with its own two operations,
on the same block pair and logits, where z_ij = +1 on the positives and -1
elsewhere, and ``has_diagonal`` (static) says whether the positives of this
block pair are its diagonal (i == j; requires n == m) or absent (a tile of
two different shards in the ring):

* ``sigmoid_sum(x, y, scale, bias, *, has_diagonal)`` -> float32 scalar
  sum_ij softplus(-z_ij * s_ij)  (= -sum_ij log sigmoid(z_ij s_ij)).
* ``sigmoid_grad(x, y, scale, bias, coef, *, has_diagonal)``
  -> (dx, dy, dscale, dbias) for G_ij = coef * (-z_ij) * sigmoid(-z_ij s_ij),
  the gradient of ``coef * sigmoid_sum``.

Each term is computed per element (never as softplus(s) - s), so the loss
stays accurate when it is tiny.

Tile ops also run inside ``jax.shard_map`` (the ring and gather losses
call them on per-device shards), where JAX types every value as varying or
not over each mesh axis (``check_vma=True``, the default). A loop carry
started from a constant must then get the inputs' varying axes, or
``lax.scan`` rejects it: build such carries with ``vary_like``, and the
output structs of a ``pallas_call`` with ``out_struct``.

A backend is any object with its family's two methods plus ``name`` and
``default_block_sizes(platform, dtype)``; it is registered under
(name, family) and ``get_backend`` resolves it. A Mosaic GPU or jax-triton
implementation plugs in by registering here, without touching the public API.
"""
from __future__ import annotations

from typing import Callable, Protocol

import jax


class TileBackend(Protocol):
  name: str

  def default_block_sizes(self, platform: str, dtype): ...

  def lse(self, x, y, scale, bias, *, rows: bool, cols: bool,
          block_sizes=None): ...

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
               col_coef, *, block_sizes=None): ...


FAMILIES = ("softmax", "sigmoid")
_REGISTRY: dict[tuple[str, str], Callable[[], TileBackend]] = {}


def register(name: str, factory: Callable[[], TileBackend],
             family: str = "softmax") -> None:
  """Registers a backend factory (called lazily, so imports stay cheap)."""
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  _REGISTRY[(name, family)] = factory


def available(name: str, family: str = "softmax") -> bool:
  """Whether backend ``name`` of ``family`` can be built here."""
  if (name, family) not in _REGISTRY:
    return False
  try:
    _REGISTRY[(name, family)]()
  except (ImportError, NotImplementedError, RuntimeError):
    return False
  return True


def default_platform() -> str:
  return jax.default_backend()


def resolve_name(backend: str, platform: str | None = None,
                 family: str = "softmax") -> str:
  """Maps "auto" to the best tiled backend of ``family`` for the platform.

  "pallas" only on GPU: on CPU it runs in interpret mode, for tests only.
  """
  if backend != "auto":
    return backend
  platform = platform or default_platform()
  if platform == "gpu" and available("pallas", family):
    return "pallas"
  return "xla"


def varying_axes(a) -> frozenset:
  """The mesh axes over which ``a`` is typed device-varying (in shard_map)."""
  t = jax.typeof(a)
  mat = getattr(t, "manual_axis_type", None)  # jax >= 0.11
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(t, "vma", ()))  # Older spelling.


def vary_like(tree, *refs):
  """Casts every leaf of ``tree`` to device-varying over the mesh axes that
  any of ``refs`` varies over (no data movement; a no-op outside shard_map).
  """
  want = frozenset()
  for r in jax.tree_util.tree_leaves(refs):
    want |= varying_axes(r)
  if not want:
    return tree

  def cast(a):
    missing = tuple(sorted(want - varying_axes(a)))
    return jax.lax.pcast(a, missing, to="varying") if missing else a
  return jax.tree_util.tree_map(cast, tree)


def out_struct(shape, dtype, *refs):
  """``jax.ShapeDtypeStruct`` for a kernel output computed from ``refs``.

  Inside ``shard_map`` with ``check_vma=True``, ``pallas_call`` needs every
  output's varying mesh axes: those of its inputs.
  """
  want = frozenset()
  for r in jax.tree_util.tree_leaves(refs):
    want |= varying_axes(r)
  mat_type = getattr(jax.sharding, "ManualAxisType", None)
  if mat_type is None:  # Older JAX: no manual axis types on the struct.
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=mat_type(varying=want))


def get_backend(name: str, family: str = "softmax") -> TileBackend:
  if (name, family) not in _REGISTRY:
    known = sorted(n for n, f in _REGISTRY if f == family)
    raise ValueError(
        f"backend {name!r} has no tiled {family} implementation; known: {known}")
  return _REGISTRY[(name, family)]()
