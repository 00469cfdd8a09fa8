"""What the GPU probes share: timing, isolated items, inputs, the summary.

A probe is a list of ``record(name, fn)`` items: each runs on its own, a
failure prints its error and the probe goes on (one device call should not
be lost to one broken variant), and ``summary()`` prints every result.
"""
from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness

RESULTS = []


def bench(f, *args, reps=5, warmup=2):
  """Median wall time of ``f(*args)`` in ms, after warm-up (compilation)."""
  return harness.timeit(f, *args, reps=reps, warmup=warmup).median * 1e3


def record(name, fn):
  """Runs one probe item; its result or its error goes to RESULTS."""
  try:
    out = fn()
  except Exception as e:  # pylint: disable=broad-except
    out = f"FAILED {type(e).__name__}: {str(e)[:800]}"
    traceback.print_exc(limit=3)
  RESULTS.append((name, out))
  print(f"{name}: {out}", flush=True)


def inputs(b, d, dtype, seed=0, m=None):
  """Unit-norm random (b, d) images and (m or b, d) texts of ``dtype``."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (b, d), jnp.float32)
  y = jax.random.normal(k2, (m or b, d), jnp.float32)
  x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
  y = y / jnp.linalg.norm(y, axis=1, keepdims=True)
  return x.astype(dtype), y.astype(dtype)


def rel(a, b):
  """Relative norm error of ``a`` against ``b``, in float64."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def summary(width=45):
  stats = jax.devices()[0].memory_stats() or {}
  print("peak_bytes_in_use", stats.get("peak_bytes_in_use"))
  print("\n==== SUMMARY ====")
  for name, out in RESULTS:
    print(f"{name:{width}s} {out}")
