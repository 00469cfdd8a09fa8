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
and take an optional ``platform``, and which declares where it runs
(``RUNS_ON``, a ``capability.RunsOn``). ``auto``, ``available`` and an
explicit name all read that declaration through ``support``: one rule. ``register`` adds a third-party backend
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

from infcl_jax.backends import capability

FAMILIES = ("softmax", "sigmoid")

# name -> module defining BACKEND. Strings, so nothing is imported here.
BUILTIN = {
    "xla": "infcl_jax.backends.xla",
    "pallas": "infcl_jax.backends.pallas",
    "mosaic": "infcl_jax.backends.mosaic",
    "triton": "infcl_jax.backends.triton",
}
_TABLE: dict[str, object] = dict(BUILTIN)


class SoftmaxTiles(Protocol):
  name: str

  def lse(self, x, y, scale, bias, *, rows: bool, cols: bool,
          block_sizes=None, groups=None, diagonal=False,
          positives=None): ...

  def lse_grad(self, x, y, scale, bias, row_lse, col_lse, row_coef,
               col_coef, *, block_sizes=None, groups=None, diagonal=False,
               positives=None): ...


class SigmoidTiles(Protocol):
  name: str

  def sigmoid_sum(self, x, y, scale, bias, *, has_diagonal: bool,
                  block_sizes=None, groups=None, group_mode="mask"): ...

  def sigmoid_grad(self, x, y, scale, bias, coef, *, has_diagonal: bool,
                   block_sizes=None, groups=None, group_mode="mask"): ...


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


def _check_family(name, cls, family):
  if family not in FAMILIES:
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
  if family not in cls.families or not all(
      hasattr(cls, m) for m in _METHODS[family]):
    raise ValueError(f"backend {name!r} has no {family} tiles; it implements "
                     f"{list(cls.families)}")


def get(name: str, family: str, platform: str | None = None):
  """An instance of backend ``name`` that implements ``family`` (no
  capability check: ``resolve`` made it when the loss was traced)."""
  cls = _backend_class(name)
  _check_family(name, cls, family)
  return cls(platform=platform)


def _runs_on(cls) -> capability.RunsOn:
  runs_on = getattr(cls, "RUNS_ON", None)
  if not isinstance(runs_on, capability.RunsOn):
    raise ValueError(f"backend class {cls.__name__} declares no RUNS_ON "
                     f"(an infcl_jax.backends.capability.RunsOn)")
  return runs_on


def support(name: str, platform: str | None = None) -> str:
  """The capability rule's verdict for backend ``name`` here (a
  ``capability`` constant: NATIVE, UNTESTED, INTERPRET or UNSUPPORTED)."""
  platform = platform or default_platform()
  return capability.support(_runs_on(_backend_class(name)), platform,
                            capability.device_info(platform))


def require(name: str, family: str, platform: str | None = None) -> str:
  """Checks that backend ``name`` implements ``family`` and can run here;
  returns the verdict, or raises a one-line ValueError naming the GPU and
  the backend to use instead."""
  platform = platform or default_platform()
  cls = _backend_class(name)
  _check_family(name, cls, family)
  return capability.require(
      name, _runs_on(cls), platform, capability.device_info(platform),
      instead=lambda: _native_choice(family, platform)[0])


def available(name: str, family: str, platform: str | None = None) -> bool:
  """Whether backend ``name`` of ``family`` can run here: importable,
  implementing the family, and not UNSUPPORTED by its ``RUNS_ON``."""
  try:
    require(name, family, platform)
  except (ImportError, ValueError, NotImplementedError, RuntimeError):
    return False
  return True


def default_platform() -> str:
  return jax.default_backend()


ENV_VAR = "INFCL_JAX_BACKEND"


def env_backend(family: str, platform: str | None = None) -> str | None:
  """The backend ``INFCL_JAX_BACKEND`` names for "auto", or None if unset.

  Raises a one-line ValueError naming the variable for a value that is not
  a registered backend of ``family`` or that cannot run here (the same
  capability rule as an explicit name).
  """
  value = os.environ.get(ENV_VAR, "").strip()
  if not value or value == "auto":
    return None
  if value not in _TABLE:
    raise ValueError(
        f"{ENV_VAR}={value!r} is not a registered backend; set it to one of "
        f"{sorted(_TABLE)} or unset it")
  try:
    require(value, family, platform)
  except (ImportError, ValueError) as e:
    raise ValueError(f"{ENV_VAR}={value!r}: {e}; or unset it") from None
  return value


# The order in which "auto" tries the built-in backends: the first that is
# registered, implements the family and is NATIVE here wins. "xla" is
# portable, so the list always ends in a choice.
#
# Hopper (sm90) keeps "mosaic", the fastest there. Every other GPU the
# kernels support (sm80-sm89, sm100+) gets "triton" (the Triton-language
# kernels, where the triton extra is installed), else "pallas" (Pallas'
# Triton lowering, which JAX deprecates). On the H200, in one job (B =
# 65,536, D = 768, bf16, fwd+bwd), "triton" was exact against float64 and
# faster than "pallas": softmax 51.5 vs 53.4 ms, sigmoid 50.4 vs 57.1 ms,
# float32 107.0 vs 140.1 ms (https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#loss).
AUTO_ORDER = ("mosaic", "triton", "pallas", "xla")
KERNEL_BACKENDS = ("mosaic", "triton", "pallas")


def auto_backend(family: str, platform: str | None = None) -> str:
  """The rule behind "auto", without the environment override: the first
  of ``AUTO_ORDER`` that the capability rule calls NATIVE here.

  Off the GPU that is "xla" (the kernel backends would only be
  interpreted). On a GPU, each backend's ``RUNS_ON`` decides: "mosaic" on
  sm90 (H100, H200); "triton" on sm80-sm89, sm100/sm103 and sm120/sm121
  where the triton extra is installed, else "pallas" (both with block sizes
  that fit the GPU's shared memory); elsewhere "xla", with an
  ``InfclPerformanceWarning`` the first time.
  """
  platform = platform or default_platform()
  name, fell_back = _native_choice(family, platform)
  if fell_back:
    _warn_xla_on_gpu(family, platform)
  return name


def _native_choice(family, platform):
  """(the first NATIVE backend of ``AUTO_ORDER``, whether it is "xla" on a
  GPU, i.e. a fallback)."""
  for name in AUTO_ORDER:
    if name not in _TABLE:
      continue
    if platform != "gpu" and name in KERNEL_BACKENDS:
      # Off the GPU a kernel backend is INTERPRET, never NATIVE
      # (capability.support): skip importing its kernels.
      continue
    try:
      cls = _backend_class(name)
      _check_family(name, cls, family)
      verdict = support(name, platform)
    except (ImportError, ValueError, NotImplementedError, RuntimeError):
      continue
    if verdict == capability.NATIVE:
      return name, name == "xla" and platform == "gpu"
  raise ValueError(f"backend='auto': no registered backend runs the {family} "
                   f"family here; register one or pass backend=")


def _warn_xla_on_gpu(family, platform):
  info = capability.device_info(platform)
  what = info.describe() if info is not None else "this GPU"
  hint = ""
  for name in ("pallas", "triton"):
    if name in _TABLE and available(name, family, platform):
      hint = (f" {ENV_VAR}={name} (or backend={name!r}) runs the Triton "
              f"kernels, untested on this GPU.")
      break
  capability.warn_once(
      "auto-fallback",
      f"infcl_jax: backend='auto' uses 'xla' on {what}: the kernel backends "
      f"are built and tuned for NVIDIA GPUs of compute capability 8.0 to "
      f"12.1 (Triton has no bfloat16 dot below 8.0). The xla backend is "
      f"exact but slower.{hint}")


def resolve(backend: str, family: str, platform: str | None = None) -> str:
  """The tiled backend of ``family`` to run here, checked.

  "auto": ``INFCL_JAX_BACKEND`` (any registered name) if set, otherwise
  ``auto_backend``. Read when a loss is traced: set it before the first call
  of a jitted function. An explicit name must implement the family and not
  be UNSUPPORTED on this device (``require``: a one-line error naming the
  GPU and what to use instead).
  """
  if backend == "auto":
    forced = env_backend(family, platform)
    return forced if forced is not None else auto_backend(family, platform)
  require(backend, family, platform)
  return backend
