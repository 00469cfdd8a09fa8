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

A backend is any object with these two methods plus ``name`` and
``default_block_sizes(platform, dtype)``; ``get_backend`` resolves names.
A Mosaic GPU or jax-triton implementation plugs in by registering here,
without touching the public API.
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


_REGISTRY: dict[str, Callable[[], TileBackend]] = {}


def register(name: str, factory: Callable[[], TileBackend]) -> None:
  """Registers a backend factory (called lazily, so imports stay cheap)."""
  _REGISTRY[name] = factory


def available(name: str) -> bool:
  """Whether ``name`` can run on the default platform."""
  if name not in _REGISTRY:
    return False
  try:
    _REGISTRY[name]()
  except (ImportError, NotImplementedError, RuntimeError):
    return False
  return True


def default_platform() -> str:
  return jax.default_backend()


def resolve_name(backend: str, platform: str | None = None) -> str:
  """Maps "auto" to the best tiled backend for the platform."""
  if backend != "auto":
    return backend
  platform = platform or default_platform()
  if platform == "gpu" and available("pallas"):
    return "pallas"
  return "xla"


def get_backend(name: str) -> TileBackend:
  if name not in _REGISTRY:
    raise ValueError(
        f"backend {name!r} is not a tiled backend; known: {sorted(_REGISTRY)}")
  return _REGISTRY[name]()
