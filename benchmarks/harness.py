"""What every benchmark script shares: one timer, one child runner, one OOM
test. Scripts import it as ``from benchmarks import harness``."""
from __future__ import annotations

import statistics
import time


def timeit(fn, *args, reps=7, inner=1, warmup=2):
  """(median, min, max) seconds per call of ``fn(*args)``, device-synced.

  ``warmup`` calls first (the first compiles); then ``reps`` timed runs of
  ``inner`` back-to-back calls each, synchronized at the end of each run.
  """
  import jax  # pylint: disable=import-outside-toplevel
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / inner)
  return statistics.median(ts), min(ts), max(ts)


def report(name, flops, t):
  """One line: median ms, [min-max], TFLOP/s of ``flops`` at the median."""
  med, lo, hi = t
  print(f"{name:44s} {med * 1e3:8.3f} ms  [{lo * 1e3:.3f}-{hi * 1e3:.3f}]  "
        f"{flops / med / 1e12:7.1f} TFLOP/s", flush=True)
