"""Whether an odd batch keeps the Mosaic forward's rate (one GPU).

The forward (both LSEs) at B = 65,536, at 50,176 (a multiple of the 256
columns of a CTA's tile pair and of the 128 rows of a row block: nothing is
masked) and at 50,000 (padded rows and columns): the same tile count for
the two last, so their difference is what the padding costs. (Building the
mask in every tile, before, took 50,000 from 6.6 to 12.6 ms:
BENCHMARKS.md.)

    PYTHONPATH=. python3 benchmarks/probes/odd_batch.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.probes.common import bench, inputs, record, summary
from infcl_jax.backends import registry


def forward(b):
  tiles = registry.get("mosaic", "softmax")
  x, y = inputs(b, 768, jnp.bfloat16, seed=2)
  f = jax.jit(lambda x, y: tiles.lse(x, y, 14.3, 0.0, rows=True, cols=True))
  ms = bench(f, x, y, reps=7)
  return f"{ms:.3f} ms, {2 * b * b * 768 / ms / 1e9:.0f} TFLOP/s"


def main():
  print("jax", jax.__version__, jax.devices(), flush=True)
  for b in (65536, 50176, 50000):
    record(f"mosaic forward B={b}", lambda b=b: forward(b))
  summary(30)


if __name__ == "__main__":
  main()
