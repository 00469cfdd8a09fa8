"""What ``groups=`` costs the Triton-family kernels: tile ops with and
without group ids, fwd + bwd.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_groups_kernels.py

For each backend ("pallas", and "triton" where its extra is installed),
family and dtype, one step of the tile seam at B x B (softmax: both LSEs
then ``lse_grad`` with both statistics; sigmoid: ``sigmoid_sum`` then
``sigmoid_grad`` with the diagonal) is timed without groups and with pair
groups (ids i // 2 on both sides; sigmoid in both modes). One line per case
with both medians and the ratio, then a JSON line per case (tag
``groups_bench``). The target is a ratio <= 1.05 at B = 65,536 on an H200.
``--b 512`` smoke-tests the script anywhere (off the GPU the kernels are
interpreted: slow, and the times mean nothing).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks import harness


def _inputs(b, d, dtype):
  kx, ky = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (b, d), jnp.float32)
  y = jax.random.normal(ky, (b, d), jnp.float32)
  x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
  y = y / jnp.linalg.norm(y, axis=1, keepdims=True)
  return x.astype(dtype), y.astype(dtype)


def _step(be, family, b, mode):
  """fn(x, y, gx, gy) of one fwd + bwd step; ``mode`` None: no groups."""
  t = jnp.float32(20.0)
  bias = jnp.float32(-10.0 if family == "sigmoid" else 0.0)

  def fn(x, y, gx, gy):
    g = None if mode is None else (gx, gy)
    if family == "softmax":
      r, c = be.lse(x, y, t, bias, rows=True, cols=True, groups=g)
      return be.lse_grad(x, y, t, bias, r, c, 0.5 / b, 0.5 / b, groups=g)
    kw = {} if mode is None else {"groups": g, "group_mode": mode}
    total = be.sigmoid_sum(x, y, t, bias, has_diagonal=True, **kw)
    return (total,) + tuple(be.sigmoid_grad(x, y, t, bias, 1.0 / b,
                                            has_diagonal=True, **kw))
  return jax.jit(fn)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--backends", default="pallas,triton")
  ap.add_argument("--reps", type=int, default=7)
  args = ap.parse_args()
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  ids = jnp.arange(args.b, dtype=jnp.int32) // 2
  rows = []
  for name in args.backends.split(","):
    try:
      registry.get(name, "softmax")
    except ImportError as e:  # the triton extra is not installed
      print(f"{name}: not importable here ({e}), skipped", flush=True)
      continue
    for dtype_name in args.dtypes.split(","):
      dtype = jnp.dtype(dtype_name)
      x, y = _inputs(args.b, args.d, dtype)
      for family, modes in (("softmax", ("mask",)),
                            ("sigmoid", ("mask", "positives"))):
        be = registry.get(name, family)
        try:
          base = harness.timeit(_step(be, family, args.b, None), x, y, ids,
                                ids, reps=args.reps)
        except Exception as e:  # pylint: disable=broad-except
          print(f"{name} {family} {dtype_name}: {harness.failure(e)}",
                flush=True)
          continue
        for mode in modes:
          try:
            tg = harness.timeit(_step(be, family, args.b, mode), x, y, ids,
                                ids, reps=args.reps)
          except Exception as e:  # pylint: disable=broad-except
            print(f"{name} {family} {mode} {dtype_name}: "
                  f"{harness.failure(e)}", flush=True)
            continue
          ratio = tg.median / base.median
          row = dict(backend=name, family=family, mode=mode,
                     dtype=dtype_name, b=args.b, d=args.d,
                     ms_without=base.median * 1e3, ms_with=tg.median * 1e3,
                     ratio=ratio, within_5pct=ratio <= 1.05)
          rows.append(row)
          print(f"{name:7s} {family:8s} {mode:9s} {dtype_name:9s} "
                f"without {base.median * 1e3:9.3f} ms  with "
                f"{tg.median * 1e3:9.3f} ms  ratio {ratio:6.3f}"
                f"{'' if ratio <= 1.05 else '  OVER 5%'}", flush=True)
  for row in rows:
    print("groups_bench " + json.dumps(row), flush=True)
  if not rows:
    raise SystemExit("no case ran")


if __name__ == "__main__":
  main()
