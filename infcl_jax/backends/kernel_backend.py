"""The base of the kernel backends: interpret mode off the GPU, its warning,
and the block sizes every Pallas kernel accepts."""
from __future__ import annotations

from infcl_jax.backends import base
from infcl_jax.backends import capability
from infcl_jax.backends import precision as precision_lib


class KernelBackend(base.TileBackend):
  """A kernel backend: interpret mode off the GPU, defaults by the GPU.

  Off the GPU the kernels run through the Pallas interpreter: exact, but
  several times slower than ``backend="xla"``; the first kernel call in a
  process warns about it (``capability.InfclPerformanceWarning``). On the
  GPU each backend's ``default_block_sizes`` follow the device, so that
  they fit its shared memory.
  """

  name = "kernel"
  # float32 within 1e-3 of float64 by default: TF32 with the positive put
  # back where the depth allows it, else 3-pass TF32 (``backends.precision``).
  F32_DEFAULT = precision_lib.BY_DEPTH

  def __init__(self, platform: str | None = None):
    super().__init__(platform)
    # Anything but a GPU runs the same kernels through the interpreter.
    self.interpret = self.platform != "gpu"

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
