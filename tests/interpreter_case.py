"""One loss forward + backward under ``jit``, in a kernel family's interpreter
at the tiles that family runs on a Hopper GPU, against float64.

Run as a child process by ``tests/test_interpreter_watchdog.py`` (and by
``tests/test_native_triton.py`` for the Triton family), so that a call that
never returns is killed and reported rather than hanging the suite:

  python -m tests.interpreter_case BACKEND LOSS DTYPE

It prints one JSON line: the seconds the call took and the relative error
of the loss and of each gradient against float64.
"""
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import infcl_jax
from tests import helpers
from tests import np_reference

# Padding on both axes (not multiples of the GPU tiles: 128 x 256 x 64 for
# Mosaic) and two D chunks; several row and column blocks per kernel.
B, D = 300, 96
SCALE, BIAS = 10.0, -2.0
HOPPER = (9, 0)


def gpu_tiles(backend, loss, dtype):
  """The ``BlockSizes`` ``backend`` runs on a Hopper GPU for ``dtype``."""
  # pylint: disable=import-outside-toplevel
  if backend in ("triton", "pallas") or jnp.dtype(dtype) == jnp.float32:
    # Mosaic's float32 inputs take the Triton path, with its tiles.
    from infcl_jax.backends import triton_tiles
    bs = triton_tiles.default("gpu", HOPPER, dtype)
  else:
    from infcl_jax.backends import mosaic
    bs = mosaic.GPU_TILES
  del loss
  # num_programs: the GPU launches one program per SM, i.e. one per tile at
  # this size; say so rather than depend on the default's fallback.
  return dataclasses.replace(bs, num_programs=132)


def run(backend, loss, dtype_name):
  dtype = jnp.dtype(dtype_name)
  rng = np.random.default_rng(helpers.seed_of(backend, loss, dtype_name))
  x = helpers.rand_emb(rng, B, D, dtype)
  y = helpers.rand_emb(rng, B, D, dtype)
  bs = gpu_tiles(backend, loss, dtype)
  fn = {"softmax": infcl_jax.contrastive_loss,
        "sigmoid": infcl_jax.sigmoid_loss}[loss]
  grad = jax.jit(jax.value_and_grad(
      lambda x, y, t, b: fn(x, y, t, logit_bias=b, backend=backend,
                            block_sizes=bs),
      argnums=(0, 1, 2, 3)))
  start = time.perf_counter()
  value, grads = jax.block_until_ready(
      grad(x, y, jnp.float32(SCALE), jnp.float32(BIAS)))
  seconds = time.perf_counter() - start
  x64, y64 = helpers.as64(x), helpers.as64(y)
  if loss == "softmax":
    ref = np_reference.clip_loss_and_grads(x64, y64, SCALE, BIAS)
  else:
    ref = np_reference.sigmoid_loss_and_grads(x64, y64, SCALE, BIAS)
  errors = {}
  for name, got, want in zip(("loss", "dx", "dy", "dscale"),
                             (value,) + tuple(grads[:3]), ref[:4]):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    errors[name] = (float(np.linalg.norm((got - want).ravel()))
                    / max(float(np.linalg.norm(np.ravel(want))), 1e-30))
    if not np.all(np.isfinite(got)):
      errors[name] = float("nan")
  return {"seconds": round(seconds, 1), "tiles": str(bs), "errors": errors}


if __name__ == "__main__":
  print(json.dumps(run(*sys.argv[1:4])), flush=True)
