"""Loss and memory of the tiled loss vs the full-matrix reference, growing B.

Runs on whatever JAX platform is present (CPU here). For each batch size it
compiles loss + all gradients, reads XLA's temp-buffer size, runs it once on
random unit embeddings and prints both losses. The reference is skipped once
its B x B logits would not fit in a fraction of host memory.

  python benchmarks/memory_demo.py [--sizes 1024,4096,16384] [--dim 256]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

import infcl_jax  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position


def compile_grad(backend, b, d, dtype):
  f = lambda x, y, t: infcl_jax.contrastive_loss(x, y, t, backend=backend)
  spec = jax.ShapeDtypeStruct((b, d), dtype)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(spec, spec, t).compile()


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="1024,4096,8192,16384")
  ap.add_argument("--dim", type=int, default=256)
  ap.add_argument("--reference-limit-gb", type=float, default=4.0,
                  help="skip the reference when its temp memory exceeds this")
  args = ap.parse_args()
  dtype = jnp.float32
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; D={args.dim}, "
        f"{jnp.dtype(dtype).name}, loss + grads of both embeddings and the scale")
  header = f"{'B':>8} {'backend':>9} {'loss':>10} {'temp MiB':>10} {'seconds':>8}"
  print(header)
  print("-" * len(header))
  rng = np.random.default_rng(0)
  for b in [int(s) for s in args.sizes.split(",")]:
    x = rng.standard_normal((b, args.dim)).astype(np.float32)
    y = x + 0.5 * rng.standard_normal((b, args.dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
    for backend in ("reference", "xla"):
      fn = compile_grad(backend, b, args.dim, dtype)
      temp = fn.memory_analysis().temp_size_in_bytes
      if backend == "reference" and temp > args.reference_limit_gb * 2**30:
        print(f"{b:>8} {backend:>9} {'(skipped)':>10} {temp / 2**20:>10.1f} {'-':>8}")
        continue
      t = jnp.float32(10.0)
      secs = harness.timeit(fn, x, y, t, reps=1, warmup=0).median
      loss = float(fn(x, y, t)[0])
      print(f"{b:>8} {backend:>9} {loss:>10.6f} {temp / 2**20:>10.1f} {secs:>8.2f}")


if __name__ == "__main__":
  main()
