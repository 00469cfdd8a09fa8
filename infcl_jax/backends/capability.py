"""What the GPU in front of us can run: the one capability rule.

Each backend class declares where it runs (``RUNS_ON``, a ``RunsOn``), and
``support`` here is the only function that reads such a declaration against
the device. ``backend="auto"``, ``registry.available`` and an explicit
``backend=`` name all go through it (``registry.support``), and so does the
Mosaic backend's choice of kernels; the kernel backends' default block
sizes read the device through ``device_info`` too, so tests can replace one
function (or ``jax.devices``) to pretend to be any GPU.

The verdicts (``support``):

* ``NATIVE``: compiled, on a GPU it is built and tuned for (or, for a
  portable backend, any platform). Only these are picked by ``auto``.
* ``UNTESTED``: a GPU newer than the tuned range, or one whose compute
  capability cannot be read, that the kernels may well run on: an explicit
  name is honoured, ``auto`` does not pick it.
* ``INTERPRET``: off the GPU, a kernel backend runs in the Pallas
  interpreter (exact, slow; for tests).
* ``UNSUPPORTED``: cannot run here; an explicit name fails in one line that
  names the GPU and the backend to use instead (``require``).

The capability comes from ``Device.compute_capability`` (a string such as
"9.0" on CUDA devices in jaxlib 0.11.2); where a device does not expose it,
from its ``device_kind`` ("NVIDIA H200", "NVIDIA L4", "Tesla T4", ...) by a
table of known models. An unknown GPU has capability ``None``.

Warnings: ``warn_once`` emits an ``InfclPerformanceWarning`` (a
``UserWarning``) the first time per process for each key, for the cases
that cost a newcomer speed without any error: ``auto`` falling back to
``xla`` on a GPU the kernels do not support, and a kernel backend running in
interpret mode off the GPU. ``warnings.simplefilter("ignore",
InfclPerformanceWarning)`` silences them.
"""
from __future__ import annotations

import dataclasses
import re
import warnings

import jax

Capability = tuple[int, int]


class InfclPerformanceWarning(UserWarning):
  """A setting that works but runs much slower than it could."""


_WARNED: set[str] = set()


def warn_once(key: str, message: str, stacklevel: int = 3) -> bool:
  """Warns with ``message`` the first time ``key`` is seen in this process.

  Returns whether it warned.
  """
  if key in _WARNED:
    return False
  _WARNED.add(key)
  warnings.warn(message, InfclPerformanceWarning, stacklevel=stacklevel)
  return True


def reset_warnings() -> None:
  """Forgets which warnings were emitted (tests)."""
  _WARNED.clear()


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  """The first device of a platform, as far as backend choice cares."""
  platform: str                 # "gpu", "cpu", "tpu", ...
  kind: str                     # Device.device_kind, e.g. "NVIDIA H200"
  capability: Capability | None  # CUDA compute capability, None if unknown

  def describe(self) -> str:
    cc = ("compute capability unknown" if self.capability is None else
          f"compute capability {self.capability[0]}.{self.capability[1]}")
    return f"{self.kind or self.platform} ({cc})"


# device_kind -> capability, for devices that do not expose
# compute_capability. Checked in order with word boundaries, so "A100" is
# not read as "A10" nor "L40" as "L4".
_KIND_TABLE: tuple[tuple[str, Capability], ...] = (
    (r"GB300|B300", (10, 3)),
    (r"GB200|B200|B100", (10, 0)),
    (r"GH200|H200|H100|H800|H20", (9, 0)),
    (r"RTX PRO \d+ Blackwell|RTX 50\d0", (12, 0)),
    (r"A100|A800|A30", (8, 0)),
    (r"L40S?|L4|L20|RTX 40\d0|RTX \d+ Ada|RTX 6000 Ada", (8, 9)),
    (r"A10G?|A40|A16|RTX A\d+|RTX 30\d0", (8, 6)),
    (r"T4|RTX 20\d0|Quadro RTX", (7, 5)),
    (r"V100|TITAN V", (7, 0)),
    (r"P100", (6, 0)),
)


def capability_from_kind(kind: str) -> Capability | None:
  """The compute capability of a known ``device_kind``, else None."""
  for pattern, cc in _KIND_TABLE:
    if re.search(rf"(?<![A-Za-z0-9])(?:{pattern})(?![A-Za-z0-9])", kind or ""):
      return cc
  return None


def parse_capability(value) -> Capability | None:
  """"9.0", "90", 9.0, (9, 0) -> (9, 0); anything else -> None."""
  if value is None:
    return None
  if isinstance(value, (tuple, list)) and len(value) == 2:
    try:
      return int(value[0]), int(value[1])
    except (TypeError, ValueError):
      return None
  s = str(value).strip()
  m = re.fullmatch(r"(\d+)\.(\d+)", s)
  if m:
    return int(m.group(1)), int(m.group(2))
  m = re.fullmatch(r"(?:sm_?)?(\d+)(\d)[a-z]?", s)  # "90", "sm_90a", "120"
  if m:
    return int(m.group(1)), int(m.group(2))
  return None


# Maximum dynamic shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin),
# by compute capability, from NVIDIA's CUDA C++ Programming Guide.
SMEM_PER_BLOCK = {
    (7, 0): 96 * 1024,    # V100
    (7, 5): 64 * 1024,    # T4, RTX 20xx
    (8, 0): 163 * 1024,   # A100, A30
    (8, 6): 99 * 1024,    # A10, A40, RTX 30xx
    (8, 7): 163 * 1024,   # Jetson Orin
    (8, 9): 99 * 1024,    # L4, L40, RTX 40xx
    (9, 0): 227 * 1024,   # H100, H200
    (10, 0): 227 * 1024,  # B200
    (10, 3): 227 * 1024,  # B300
    (12, 0): 99 * 1024,   # RTX 50xx, RTX PRO Blackwell
    (12, 1): 99 * 1024,   # GB10
}


def smem_limit(capability) -> int | None:
  """Maximum shared memory per block of a compute capability, or None."""
  return None if capability is None else SMEM_PER_BLOCK.get(tuple(capability))


NATIVE, UNTESTED, INTERPRET, UNSUPPORTED = (
    "native", "untested", "interpret", "unsupported")


@dataclasses.dataclass(frozen=True)
class RunsOn:
  """Where a backend runs, declared once by its class as ``RUNS_ON``.

  Attributes:
    portable: runs natively on every platform (the XLA backend); the other
      fields are then unused.
    tuned: the GPU compute capabilities it is compiled and tuned for.
    floor: known GPUs at or above this capability but outside ``tuned``
      are UNTESTED; below it (or with no floor) UNSUPPORTED.
    unknown_gpu: the verdict for a GPU whose capability cannot be read.
    needs: what it needs, in a few words, for the error message.
  """
  portable: bool = False
  tuned: tuple[Capability, ...] = ()
  floor: Capability | None = None
  unknown_gpu: str = UNSUPPORTED
  needs: str = ""


def support(runs_on: RunsOn, platform: str, info: "DeviceInfo | None") -> str:
  """The verdict of ``runs_on`` for ``platform`` and its first device.

  ``platform="gpu"`` with no readable GPU (``info`` None) counts as a GPU of
  unknown capability.
  """
  if runs_on.portable:
    return NATIVE
  if platform != "gpu":
    return INTERPRET
  cc = None if info is None or info.platform != "gpu" else info.capability
  if cc is None:
    return runs_on.unknown_gpu
  if tuple(cc) in runs_on.tuned:
    return NATIVE
  if runs_on.floor is not None and tuple(cc) >= runs_on.floor:
    return UNTESTED
  return UNSUPPORTED


def require(name: str, runs_on: RunsOn, platform: str,
            info: "DeviceInfo | None", instead) -> str:
  """``support``'s verdict; a one-line ValueError when UNSUPPORTED that
  names the GPU and ``instead()``, the backend to use instead."""
  verdict = support(runs_on, platform, info)
  if verdict == UNSUPPORTED:
    what = info.describe() if info is not None and info.platform == "gpu" \
        else "this GPU (compute capability unknown)"
    raise ValueError(
        f"backend={name!r} cannot run on {what}: it needs {runs_on.needs}; "
        f"use backend={instead()!r} ('auto' picks it here)")
  return verdict


def device_info(platform: str | None = None) -> DeviceInfo | None:
  """The first device of ``platform`` (default: JAX's default), or None."""
  try:
    devs = jax.devices(platform) if platform else jax.devices()
  except RuntimeError:  # No such platform here.
    return None
  if not devs:
    return None
  dev = devs[0]
  kind = str(getattr(dev, "device_kind", "") or "")
  plat = str(getattr(dev, "platform", platform or "") or "")
  if plat in ("cuda", "rocm"):
    plat = "gpu"
  cc = None
  if plat == "gpu":
    try:
      cc = parse_capability(getattr(dev, "compute_capability", None))
    except Exception:  # pylint: disable=broad-except
      cc = None  # An attribute that raises: fall back to the name.
    if cc is None:
      cc = capability_from_kind(kind)
  return DeviceInfo(plat, kind, cc)


def device_capability(platform: str = "gpu") -> Capability | None:
  """The compute capability of the first ``platform`` device, or None."""
  info = device_info(platform)
  return None if info is None or info.platform != "gpu" else info.capability
