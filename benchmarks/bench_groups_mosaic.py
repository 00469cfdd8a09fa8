"""What ``groups=`` costs the Mosaic GPU kernels: each stage with and without.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_groups_mosaic.py --b 65536

Per stage (softmax forward over B x B through the backend, softmax and
sigmoid G panels of R rows, sigmoid forward sum), the time without groups
and with group ids of several structures, and the ratio to the time
without: "distinct" (all ids different: the pure cost of the compare and
select), "pairs5" (runs of 5 rows sharing an id, as several captions per
image), "classes1000" (1000 random classes), "sorted64" (64 classes in
sorted order: whole row blocks of one id, rows and columns with no
unrelated pair in a tile). The goal is a ratio <= 1.05 at B = 65536.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks.harness import report
from benchmarks.harness import timeit
from infcl_jax._math import LOG2E
from infcl_jax.backends import mosaic as mosaic_backend
from infcl_jax.kernels.mosaic import g_panel as mg_panel
from infcl_jax.kernels.mosaic import sigmoid as msigmoid

STRUCTURES = ("distinct", "pairs5", "classes1000", "sorted64")


def group_ids(kind, b):
  if kind == "distinct":
    return jnp.arange(b, dtype=jnp.int32)
  if kind == "pairs5":
    return jnp.arange(b, dtype=jnp.int32) // 5
  if kind == "classes1000":
    return jax.random.randint(jax.random.key(3), (b,), 0, 1000, jnp.int32)
  if kind == "sorted64":
    return jnp.arange(b, dtype=jnp.int32) * 64 // b
  raise ValueError(kind)


def bench(b, d, dtype, reps, r):
  kx, ky = jax.random.split(jax.random.key(0))
  norm = lambda a: (a / jnp.linalg.norm(a, axis=1, keepdims=True)).astype(
      dtype)
  x = norm(jax.random.normal(kx, (b, d), jnp.float32) / math.sqrt(d))
  y = norm(jax.random.normal(ky, (b, d), jnp.float32) / math.sqrt(d))
  be = mosaic_backend.MosaicBackend()
  t20 = jnp.float32(20.0)
  xr = x[:r]
  r2 = jnp.full((r,), 5.0, jnp.float32)
  c2 = jnp.full((b,), 5.0, jnp.float32)
  rid = jnp.arange(r, dtype=jnp.int32)
  params = jnp.asarray([20.0 * LOG2E, 0.0, 0.5, 0.5], jnp.float32)
  sparams = jnp.asarray([10.0, -10.0, 1.0, 0.0], jnp.float32)
  padded = b % 256 == 0 and d % 64 == 0  # The panels take padded inputs.

  # name -> (flops, fn(groups or None)); groups = (gx (b,), gy (b,)).
  stages = {
      "softmax lse (both)": (2.0 * b * b * d, lambda g: be.lse(
          x, y, t20, 0.0, rows=True, cols=True, groups=g)),
      "sigmoid sum": (2.0 * b * b * d, lambda g: be.sigmoid_sum(
          x, y, 10.0, -10.0, has_diagonal=True, groups=g)),
  }
  if padded:
    kw = lambda g: {} if g is None else {"groups": (g[0][:r], g[1])}
    stages[f"softmax panel R={r}"] = (2.0 * r * b * d, lambda g: (
        mg_panel.g_panel(xr, y, r2, c2, params, rows=True, cols=True,
                         mask=False, interpret=be.interpret, **kw(g))))
    stages[f"sigmoid panel R={r}"] = (2.0 * r * b * d, lambda g: (
        msigmoid.sigmoid_tiles(xr, y, rid, sparams, mode="g", m=b,
                               mask=False, has_diagonal=True,
                               interpret=be.interpret, **kw(g))))
  for name, (flops, fn) in stages.items():
    try:
      f = jax.jit(fn)
      base = timeit(f, None, reps=reps, inner=5)
      report(f"{name} no groups", flops, base)
      for kind in STRUCTURES:
        g = group_ids(kind, b)
        t = timeit(f, (g, g), reps=reps, inner=5)
        report(f"{name} {kind}", flops, t)
        print(f"  ratio {kind}: {t.median / base.median:.3f}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--r", type=int, default=4096, help="panel rows")
  args, _ = ap.parse_known_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"B={args.b} D={args.d} {args.dtype}", flush=True)
  bench(args.b, args.d, jnp.dtype(args.dtype), args.reps, min(args.r, args.b))


if __name__ == "__main__":
  main()
