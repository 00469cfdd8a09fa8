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
import os
from typing import Protocol

import jax

from infcl_jax import block_sizes
from infcl_jax.backends import capability

FAMILIES = ("softmax", "sigmoid")

# name -> module defining BACKEND. Strings, so nothing is imported here.
BUILTIN = {
    "xla": "infcl_jax.backends.xla",
    "pallas": "infcl_jax.backends.pallas_triton",
    "mosaic": "infcl_jax.backends.mosaic",
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


ENV_VAR = "INFCL_JAX_BACKEND"


def env_backend(family: str) -> str | None:
  """The backend ``INFCL_JAX_BACKEND`` names for "auto", or None if unset.

  Raises a one-line ValueError naming the variable for a value that is not
  a registered backend of ``family``.
  """
  value = os.environ.get(ENV_VAR, "").strip()
  if not value or value == "auto":
    return None
  if value not in _TABLE:
    raise ValueError(
        f"{ENV_VAR}={value!r} is not a registered backend; set it to one of "
        f"{sorted(_TABLE)} or unset it")
  if not available(value, family):
    raise ValueError(
        f"{ENV_VAR}={value!r}: backend {value!r} has no {family} tiles or "
        f"cannot be built here; set it to one of {sorted(_TABLE)} or unset it")
  return value


def auto_backend(family: str, platform: str | None = None) -> str:
  """The rule behind "auto", without the environment override.

  * not a GPU (CPU, TPU): "xla" (the Pallas kernels here target GPUs; off
    the GPU they would only run in the interpreter);
  * a GPU, by compute capability (``capability.device_info``):
    sm90 (H100, H200): "mosaic" where it is registered and implements the
    family (its kernels use Hopper's wgmma), else "pallas";
    sm80-sm89, sm100/sm103, sm120/sm121: "pallas", with ``BlockSizes``
    defaults that fit the GPU's shared memory (``block_sizes.triton_config``);
    below sm80 (no bfloat16 dot in Triton) or an unknown GPU: "xla", with an
    ``InfclPerformanceWarning`` the first time.
  """
  platform = platform or default_platform()
  if platform != "gpu":
    return "xla"
  info = capability.device_info(platform)
  cc = None if info is None else info.capability
  if cc is not None and cc[0] == 9 and "mosaic" in _TABLE and available(
      "mosaic", family):
    return "mosaic"
  if (cc is not None and cc >= (8, 0) and block_sizes.smem_limit(cc) is not None
      and available("pallas", family)):
    return "pallas"
  what = info.describe() if info is not None else "this GPU"
  capability.warn_once(
      "auto-fallback",
      f"infcl_jax: backend='auto' uses 'xla' on {what}: the Pallas kernels "
      f"are tuned and tested for NVIDIA GPUs of compute capability 8.0 to "
      f"12.1 (Triton has no bfloat16 dot below 8.0). The xla backend is "
      f"exact but slower; {ENV_VAR}=pallas (or backend='pallas') tries the "
      f"kernels anyway.")
  return "xla"


def resolve(backend: str, family: str, platform: str | None = None) -> str:
  """Maps "auto" to the tiled backend of ``family`` to use here.

  ``INFCL_JAX_BACKEND`` (any registered name) overrides the rule; otherwise
  ``auto_backend``. Read when a loss is traced: set it before the first call
  of a jitted function. Explicit backend names pass through unchanged.
  """
  if backend != "auto":
    return backend
  forced = env_backend(family)
  if forced is not None:
    return forced
  return auto_backend(family, platform)
