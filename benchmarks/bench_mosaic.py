"""Per-stage timing of backend="mosaic" against "pallas" (one GPU).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mosaic.py --b 65536 [--dtype float32]

Each stage jitted alone at B x B: the forward over all tiles (through the
backends, padding included), the G panels per R-row panel (``--r_list``;
B / R of them a step) of the Mosaic and the Pallas-Triton kernels, and the
dX / dY GEMMs of a panel. Whole steps are ``bench_loss.py``'s. Where each
stage's time goes and what would close it: BENCHMARKS.md "Where the Mosaic
step's time goes (B = 65,536)".

``--compare``: whole fwd + bwd steps of ``backend="mosaic"``, compiled in
one process and timed in interleaved rounds (the median of the rounds'
medians): the bf16 steps, and float32's softmax step with its panels G in
float16 and 16-bit GEMMs (``TritonTiles._half_panels``, the default)
beside G in float32 with TF32 GEMMs.

``--profile``: where one whole step's device time goes: three steps of
each backend and dtype traced by ``jax.profiler``, and the GPU kernels'
time summed by name (per step), beside the step's wall time; what the sum
leaves out is the GPU idling between kernels.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.harness import inputs, report, timeit
from infcl_jax._math import LOG2E
from infcl_jax.kernels.mosaic import g_panel as mg


def bench_stages(b, d, dtype, reps, r_list=(4096, 8192)):
  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import mosaic as mb
  from infcl_jax.backends import registry
  from infcl_jax.kernels.pallas import lse_bwd as tb
  from infcl_jax.kernels.pallas import sigmoid_bwd as tsb
  from infcl_jax.kernels.mosaic import sigmoid as ms
  # pylint: enable=import-outside-toplevel
  x, y = inputs(b, d, dtype)
  fwd_flops = 2.0 * b * b * d
  be = mb.MosaicBackend()
  tri = registry.get("pallas", "softmax")
  t20 = jnp.float32(20.0)

  def stage(name, flops, fn, *args):
    try:
      report(name, flops, timeit(jax.jit(fn), *args, reps=reps, inner=5))
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)

  # Forward, both directions, through the backends (padding etc. included).
  stage("stage softmax lse mosaic", fwd_flops, lambda p, q: be.lse(
      p, q, t20, 0.0, rows=True, cols=True), x, y)
  stage("stage softmax lse pallas", fwd_flops, lambda p, q: tri.lse(
      p, q, t20, 0.0, rows=True, cols=True), x, y)
  stage("stage sigmoid sum mosaic", fwd_flops, lambda p, q: be.sigmoid_sum(
      p, q, 10.0, -10.0, has_diagonal=True), x, y)
  stage("stage sigmoid sum pallas", fwd_flops, lambda p, q: tri.sigmoid_sum(
      p, q, 10.0, -10.0, has_diagonal=True), x, y)
  params = jnp.asarray([20.0 * LOG2E, 0.0, 0.5, 0.5], jnp.float32)
  sparams = jnp.asarray([10.0, -10.0, 1.0, 0.0], jnp.float32)
  c2 = jnp.full((b,), 5.0, jnp.float32)
  for r in r_list:
    xp = x[:r]
    r2 = jnp.full((r,), 5.0, jnp.float32)
    rid = jnp.arange(r, dtype=jnp.int32)
    pf = 2.0 * r * b * d
    stage(f"stage softmax panel mosaic R={r}", pf,
          lambda p, q, rr, cc: mg.g_panel(
              p, q, rr, cc, params, rows=True, cols=True, mask=False),
          xp, y, r2, c2)
    stage(f"stage softmax panel pallas R={r}", pf,
          lambda p, q, rr, cc: tb.g_panel(
              p, q, rr, cc, params, rows=True, cols=True, mask=False,
              g_dtype=dtype, block_q=128, block_k=256, block_d=64,
              num_warps=8, num_stages=3, precision=jax.lax.Precision.DEFAULT,
              interpret=False), xp, y, r2, c2)
    stage(f"stage sigmoid panel mosaic R={r}", pf,
          lambda p, q, ri: ms.sigmoid_tiles(
              p, q, ri, sparams, mode="g", m=b, mask=False,
              has_diagonal=True), xp, y, rid)
    stage(f"stage sigmoid panel pallas R={r}", pf,
          lambda p, q, ri: tsb.g_panel(
              p, q, ri, sparams, m=b, mask=False, has_diagonal=True,
              mode="g", g_dtype=dtype, scaled=False, block_q=128,
              block_k=256, block_d=64, num_warps=8, num_stages=3,
              precision=jax.lax.Precision.DEFAULT, interpret=False),
          xp, y, rid)
    g = jnp.ones((r, b), dtype) * jnp.asarray(1e-3, dtype)
    stage(f"stage GEMMs dx=G y, dy=G^T x R={r}", 2 * pf,
          lambda gg, p, q: (jnp.dot(gg, q, preferred_element_type=jnp.float32),
                            jax.lax.dot_general(
                                gg, p, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)),
          g, xp, y)
    del g


def compare(b, d, rounds=3):
  """See the module doc; prints one line per variant."""
  # pylint: disable=import-outside-toplevel
  import numpy as np
  from infcl_jax.backends import triton_tiles as tt
  # pylint: enable=import-outside-toplevel
  half = tt.TritonTiles._half_panels  # pylint: disable=protected-access
  variants = [  # (family, dtype, name, float16 G on TF32 tiles)
      ("softmax", "bfloat16", "default", True),
      ("sigmoid", "bfloat16", "default", True),
      ("softmax", "float32", "G float32", False),
      ("softmax", "float32", "G float16 (default)", True)]
  data = {dt: harness.host_inputs(b, d, dt) for dt in ("bfloat16", "float32")}
  steps = {}
  for family, dt, name, half_g in variants:
    jax.clear_caches()  # the losses' inner traces see the setting below
    tt.TritonTiles._half_panels = half if half_g else (  # pylint: disable=protected-access
        lambda self, x, bs: False)
    step, scalars = harness.loss_step(family, "mosaic")
    args = (*data[dt], *scalars)
    steps[(family, dt, name)] = (step.lower(*args).compile(), args)
  tt.TritonTiles._half_panels = half  # pylint: disable=protected-access
  times = {k: [] for k in steps}
  for _ in range(rounds):
    for k, (fn, args) in steps.items():
      times[k].append(timeit(fn, *args, reps=5, warmup=1).median * 1e3)
  for (family, dt, name), ms in times.items():
    print(f"{family} {dt} {name}: {np.median(ms):.2f} ms (rounds "
          f"{', '.join(f'{t:.2f}' for t in ms)}), "
          f"{8.0 * b * b * d / np.median(ms) / 1e9:.0f} TFLOP/s", flush=True)


def profile(b, d, cases=("softmax:mosaic:bfloat16", "sigmoid:mosaic:bfloat16",
                         "softmax:triton:bfloat16", "softmax:mosaic:float32"),
            top=8, steps=3):
  """See the module doc; prints each case's step time and top kernels."""
  # pylint: disable=import-outside-toplevel
  import collections
  import glob
  import tempfile
  from jax.profiler import ProfileData
  # pylint: enable=import-outside-toplevel
  for case in cases:
    family, backend, dt = case.split(":")
    x, y = harness.host_inputs(b, d, dt)
    step, scalars = harness.loss_step(family, backend)
    args = (x, y, *scalars)
    fn = step.lower(*args).compile()
    wall = timeit(fn, *args, reps=5, warmup=2).median * 1e3
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp):
        for _ in range(steps):
          jax.block_until_ready(fn(*args))
      trace = ProfileData.from_file(
          glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for plane in trace.planes:
      if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
          if "stream" in line.name.lower():
            for ev in line.events:
              kernels[ev.name][0] += 1
              kernels[ev.name][1] += ev.duration_ns / 1e6 / steps
    total = sum(ms for _, ms in kernels.values())
    print(f"{case} B={b}: step {wall:.2f} ms, kernels {total:.2f} ms, "
          f"idle {wall - total:.2f} ms", flush=True)
    for name, (n, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
      print(f"  {ms:8.3f} ms  x{n // steps:<3d} {name[:100]}", flush=True)
    del x, y, fn


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--r_list", default="4096,8192",
                  help="panel rows of the per-panel stages")
  ap.add_argument("--compare", action="store_true",
                  help="whole steps, bf16 and float32's float16 panels")
  ap.add_argument("--profile", action="store_true",
                  help="whole steps' GPU kernels, summed by name")
  args = ap.parse_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"B={args.b} D={args.d} {args.dtype}", flush=True)
  if args.compare or args.profile:
    (compare if args.compare else profile)(args.b, args.d)
    return
  bench_stages(args.b, args.d, jnp.dtype(args.dtype), args.reps,
               r_list=tuple(int(r) for r in args.r_list.split(",")))


if __name__ == "__main__":
  main()
