"""Times the Mosaic GPU kernels (and, where importable, the Triton ones).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mosaic_kernels.py --b 65536 --d 768

Each kernel is compiled, run twice as warm-up, then timed as the median of
``--reps`` runs, each a sync'd wall-clock measurement of ``--inner``
back-to-back calls (inputs are far larger than L2). TFLOP/s counts the
logit matmul only: 2 * rows * cols * D.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp

from infcl_jax._math import LOG2E
from infcl_jax.kernels.mosaic import g_panel as mg
from infcl_jax.kernels.mosaic import lse_fwd as mf


def timeit(fn, *args, reps=7, inner=5):
  out = fn(*args)
  jax.block_until_ready(out)
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / inner)
  return statistics.median(ts), min(ts), max(ts)


def report(name, flops, t):
  med, lo, hi = t
  print(f"{name:44s} {med * 1e3:8.3f} ms  [{lo * 1e3:.3f}-{hi * 1e3:.3f}]  "
        f"{flops / med / 1e12:7.1f} TFLOP/s", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--panel", type=int, default=4096)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--fwd_stages", default="4")
  ap.add_argument("--bwd_stages", default="3")
  ap.add_argument("--triton", type=int, default=1)
  ap.add_argument("--ceiling", type=int, default=1)
  args = ap.parse_args()
  b, d, r = args.b, args.d, args.panel
  dtype = jnp.dtype(args.dtype)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, B={b} "
        f"D={d} {dtype.name}", flush=True)
  kx, ky = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  y = (jax.random.normal(ky, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  scale, bias = jnp.float32(20.0), jnp.float32(-3.0)
  fwd_flops = 2.0 * b * b * d
  if args.ceiling:
    a = jax.random.normal(kx, (8192, 8192), jnp.float32).astype(dtype)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32
                                      ).astype(dtype))
    report("XLA GEMM 8192^3 (ceiling)", 2.0 * 8192**3,
           timeit(mm, a, a, reps=args.reps))
  for st in [int(v) for v in args.fwd_stages.split(",")]:
    for rows, cols, pp, se, rsb in ((1, 1, 1, 1, 0), (1, 1, 1, 1, 16384),
                                    (1, 1, 1, 0, 16384), (1, 0, 0, 0, 0)):
      fn = jax.jit(lambda p, q, st=st, rows=rows, cols=cols, pp=pp, se=se,
                   rsb=rsb: mf.lse_fwd(
                       p, q, scale, bias, n=b, m=b, rows=bool(rows),
                       cols=bool(cols), num_stages=st, pingpong=bool(pp),
                       single_exp=bool(se), reduction_scratch_bytes=rsb))
      try:
        report(f"mosaic fwd r={rows} c={cols} pp={pp} 1exp={se} rsb={rsb} "
               f"st={st}", fwd_flops,
               timeit(fn, x, y, reps=args.reps))
      except Exception as e:  # pylint: disable=broad-except
        print(f"mosaic fwd stages={st} failed: {type(e).__name__}: "
              f"{str(e)[:400]}", flush=True)
  xp = x[:r]
  r2 = jnp.full((r,), 5.0, jnp.float32)
  c2 = jnp.full((b,), 5.0, jnp.float32)
  params = jnp.asarray([20.0 * LOG2E, -3.0 * LOG2E, 0.5, 0.5], jnp.float32)
  panel_flops = 2.0 * r * b * d
  for st, pp in [(int(v), pp) for v in args.bwd_stages.split(",")
                 for pp in (False,)]:
    fn = jax.jit(lambda p, q, rr, cc, st=st, pp=pp: mg.g_panel(
        p, q, rr, cc, params, rows=True, cols=True, mask=False,
        num_stages=st, pingpong=pp))
    try:
      report(f"mosaic g_panel R={r} pp={pp:d} stages={st}", panel_flops,
             timeit(fn, xp, y, r2, c2, reps=args.reps))
    except Exception as e:  # pylint: disable=broad-except
      print(f"mosaic g_panel stages={st} failed: {type(e).__name__}: "
            f"{str(e)[:400]}", flush=True)
  if args.triton:
    try:
      from infcl_jax.kernels import lse_bwd as tb  # pylint: disable=g-import-not-at-top
      from infcl_jax.kernels import lse_fwd as tf  # pylint: disable=g-import-not-at-top
    except Exception as e:  # pylint: disable=broad-except
      print(f"triton kernels not importable: {e}", flush=True)
      return
    fn = jax.jit(lambda p, q: tf.lse_fwd(
        p, q, scale, bias, n=b, m=b, rows=True, cols=True, block_q=128,
        block_k=256, block_d=64, num_programs=132, num_warps=8, num_stages=3,
        precision=jax.lax.Precision.DEFAULT, interpret=False))
    report("triton fwd rows+cols", fwd_flops, timeit(fn, x, y, reps=args.reps))
    fn = jax.jit(lambda p, q, rr, cc: tb.g_panel(
        p, q, rr, cc, params, rows=True, cols=True, mask=False, g_dtype=dtype,
        block_q=128, block_k=256, block_d=64, num_warps=8, num_stages=3,
        precision=jax.lax.Precision.DEFAULT, interpret=False))
    report(f"triton g_panel R={r}", panel_flops,
           timeit(fn, xp, y, r2, c2, reps=args.reps))




if __name__ == "__main__":
  main()
