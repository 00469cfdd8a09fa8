"""Compiling a recorded launch for a CUDA GPU on a machine without one.

Triton compiles for any CUDA target from the host alone (it bundles
``ptxas``), so what a GPU run would find out first (a kernel that does not
compile for an architecture, shared memory past the GPU's limit, register
spills) is found on the CPU. ``compile_launch`` compiles a
``launch.Launch`` as jax-triton does (the same signature, 16-byte aligned
pointers, the same options) down to a cubin, and reads back Triton's
shared-memory figure and the cubin's registers and local memory
(``cuobjdump``, bundled with Triton: local memory is where spills go).

Needs ``TRITON_INTERPRET`` unset when the kernel modules are imported (the
interpreter's kernels cannot be compiled).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource

# jax-triton's compile options (``get_or_create_triton_kernel``) beyond the
# launch's own.
JAX_TRITON_OPTIONS = dict(num_ctas=1, enable_fp_fusion=True)


@dataclasses.dataclass(frozen=True)
class Compiled:
  """What one kernel takes on the GPU it was compiled for."""
  name: str
  capability: int  # e.g. 90
  shared: int  # bytes of shared memory per block (Triton's figure)
  registers: int  # 32-bit registers per thread
  local: int  # bytes of local memory per thread (spills, stack arrays)


def compile_launch(spec, capability: int) -> Compiled:
  """Compiles ``spec`` (a ``launch.Launch``) for sm``capability``."""
  sig = spec.signature()
  pointers = [i for i, t in enumerate(sig.values()) if t.startswith("*")]
  src = ASTSource(spec.kernel, signature=sig, constexprs=spec.constexprs,
                  attrs={(i,): [["tt.divisibility", 16]] for i in pointers})
  kernel = triton.compile(
      src, target=GPUTarget("cuda", capability, 32),
      options=dict(num_warps=spec.num_warps, num_stages=spec.num_stages,
                   **JAX_TRITON_OPTIONS))
  registers, local = _resources(kernel.asm["cubin"])
  return Compiled(spec.name, capability, kernel.metadata.shared, registers,
                  local)


def _resources(cubin: bytes) -> tuple[int, int]:
  tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    out = subprocess.run([tool, "--dump-resource-usage", f.name],
                         capture_output=True, text=True, check=True).stdout
  found = re.search(r"REG:(\d+).*LOCAL:(\d+)", out)
  if found is None:
    raise RuntimeError(f"no resource usage in cuobjdump's output: {out!r}")
  return int(found.group(1)), int(found.group(2))
