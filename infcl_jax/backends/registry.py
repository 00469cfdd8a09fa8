"""The seam between the losses and the code that computes tiles.

A loss (one device or a ring / gather across devices) needs only two
block-level operations per family, on one pair of embedding blocks x (n, D)
and y (m, D) with logits ``s = scale * x @ y.T + bias``:

softmax family (``SoftmaxTiles``)
  * ``lse(x, y, scale, bias, rows=, cols=)`` -> (row_lse (n,), col_lse (m,))
    in float32, either one ``None`` when not asked for; one sweep gives both.
  * ``lse_grad(x, y, scale, bias, row_lse, col_lse, row_coef, col_coef)``
    -> (dx, dy, dscale, dbias), float32, of the tile gradient
    ``G_ij = row_coef * exp(s_ij - row_lse_i) + col_coef * exp(s_ij - col_lse_j)``
    (dx = scale G y, dy = scale G^T x, dscale = sum G * x y^T, dbias = sum G);
    a ``None`` lse means its coefficient is zero. The statistics may be
    *global* (merged over other blocks or devices), which is what lets the
    ring reuse one call for every tile it visits.

sigmoid family (``SigmoidTiles``), z_ij = +1 on the positives, -1 elsewhere;
``has_diagonal`` (static) says whether the positives of this block pair are
its diagonal (n == m) or absent (two different shards of a ring):
  * ``sigmoid_sum(x, y, scale, bias, has_diagonal=)`` -> float32
    ``sum_ij softplus(-z_ij s_ij)``, every term evaluated on its own.
  * ``sigmoid_grad(x, y, scale, bias, coef, has_diagonal=)`` -> (dx, dy,
    dscale, dbias) of ``coef * sigmoid_sum``.

The positive-pair terms are O(B * D) and belong to the losses, so a backend
never needs to know where positives are (beyond ``has_diagonal``).

Registration. ``BUILTIN`` maps each name to the module that implements it;
the module is imported on first use and must define ``BACKEND``, a class
whose instances implement one or both families (``families`` lists which)
and take an optional ``platform``. ``register`` adds a third-party backend
the same way. ``names()`` is what argument checking validates against, so a
new backend needs no change to the public API. Tile ops also run inside
``shard_map`` (the ring and gather call them on shards): see ``_axes`` for
the typing rules a backend must follow there.
"""
from __future__ import annotations

import importlib
from typing import Protocol

import jax

FAMILIES = ("softmax", "sigmoid")

# name -> module defining BACKEND. Strings, so nothing is imported here.
BUILTIN = {
    "xla": "infcl_jax.backends.xla",
    "pallas": "infcl_jax.backends.pallas_triton",
}
_TABLE: dict[str, object] = dict(BUILTIN)


class SoftmaxTiles(Protocol):
  name: str

  def lse(self, x, y, scale, bias, *, rows: bool, cols: bool,
          block_sizes=None): ...

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
               col_coef, *, block_sizes=None): ...


class SigmoidTiles(Protocol):
  name: str

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal: bool,
                  block_sizes=None): ...

  def sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal: bool,
                   block_sizes=None): ...


_METHODS = {"softmax": ("lse", "lse_grad"),
            "sigmoid": ("sigmoid_sum", "sigmoid_grad")}


def register(name: str, target) -> None:
  """Registers backend ``name``.

  ``target`` is the import path of a module that defines ``BACKEND``
  (imported on first use: keep kernel imports out of ``import infcl_jax``),
  or the backend class itself.
  """
  if not isinstance(name, str) or name in ("auto", "reference"):
    raise ValueError(f"a backend cannot be registered as {name!r}")
  _TABLE[name] = target


def names() -> tuple[str, ...]:
  """The registered tiled backend names, in registration order."""
  return tuple(_TABLE)


def _backend_class(name: str):
  if name not in _TABLE:
    raise ValueError(f"backend {name!r} is not registered; known: "
                     f"{sorted(_TABLE)}")
  target = _TABLE[name]
  if isinstance(target, str):
    return importlib.import_module(target).BACKEND
  return target


def get(name: str, family: str, platform: str | None = None):
  """An instance of backend ``name`` that implements ``family``."""
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  cls = _backend_class(name)
  if family not in cls.families or not all(
      hasattr(cls, m) for m in _METHODS[family]):
    raise ValueError(f"backend {name!r} has no {family} tiles; it implements "
                     f"{list(cls.families)}")
  return cls(platform=platform)


def available(name: str, family: str) -> bool:
  """Whether backend ``name`` of ``family`` can be built here."""
  try:
    get(name, family)
  except (ImportError, ValueError, NotImplementedError, RuntimeError):
    return False
  return True


def default_platform() -> str:
  return jax.default_backend()


def resolve(backend: str, family: str, platform: str | None = None) -> str:
  """Maps "auto" to the best tiled backend of ``family`` for the platform.

  "pallas" only on a GPU: elsewhere it runs in interpret mode, for tests.
  """
  if backend != "auto":
    return backend
  platform = platform or default_platform()
  if platform == "gpu" and available("pallas", family):
    return "pallas"
  return "xla"
