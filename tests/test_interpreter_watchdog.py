"""Every kernel family in its CPU interpreter at the tiles it runs on the GPU.

The other interpreter tests use small tiles, so that a case stays cheap; a
bug that shows only at the GPU's tiles (a barrier protocol, a padding mask, a
loop bound) would pass them. Here each family runs one forward + backward
under ``jit`` per dtype class at its Hopper tiles, in a child process under
a watchdog (``tests/watchdog.py``), against float64. The Triton family's
case is in ``tests/test_native_triton.py`` (its own CI leg, which has
Triton).
"""
import os
import subprocess
import sys

import pytest

from tests import watchdog

# The bound on every backend: 1e-3 for float32 inputs, 3e-2 for
# 16-bit ones (the G panel is stored in the input dtype).
BOUND = {"float32": 1e-3, "bfloat16": 3e-2, "float16": 3e-2}

CASES = [
    ("mosaic", "softmax", "bfloat16"),
    ("mosaic", "sigmoid", "float16"),
    # float32 inputs: Mosaic's Triton path (Pallas-Triton off the GPU).
    ("mosaic", "softmax", "float32"),
    ("pallas", "softmax", "bfloat16"),
    ("pallas", "sigmoid", "float32"),
]


@pytest.mark.parametrize("backend,loss,dtype", CASES)
def test_forward_and_backward_at_gpu_tiles(backend, loss, dtype):
  result = watchdog.run_case(backend, loss, dtype)
  worst = max(result["errors"].values())
  assert worst <= BOUND[dtype], (backend, loss, dtype, result)


def test_mosaic_interpreter_refuses_a_pool_that_could_hang():
  """With XLA:CPU's pool at 2 threads (a 2-core machine's default) the
  Mosaic interpreter could deadlock: it is refused in one line that says
  what to set, at once, instead."""
  env = dict(os.environ, PJRT_NPROC="2")
  code = ("import jax.numpy as jnp, infcl_jax\n"
          "x = jnp.ones((8, 64), jnp.bfloat16)\n"
          "infcl_jax.contrastive_loss(x, x, 10.0, backend='mosaic')\n")
  done = subprocess.run([sys.executable, "-c", code], env=env, timeout=120,
                        capture_output=True, text=True, check=False)
  assert done.returncode != 0
  errors = [l for l in done.stderr.splitlines() if l.startswith("RuntimeError")]
  assert len(errors) == 1, done.stderr[-2000:]
  assert errors[0].startswith(
      "RuntimeError: infcl_jax: backend='mosaic' off the GPU runs the Mosaic "
      "GPU interpreter"), errors
  assert "this process has 2" in errors[0] and "PJRT_NPROC=" in errors[0]
