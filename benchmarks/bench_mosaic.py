"""Per-stage and full-step timing of backend="mosaic" against "pallas".

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mosaic.py --b 65536

Stages at B x B (the forward over all tiles; the panel stages per R-row
panel, times B / R for a step), for the Mosaic and the Triton kernels, then
full fwd+bwd steps of the public losses with backend "mosaic", "pallas",
and hybrids (``MosaicBackend.STAGES``, each registered under its own name).
The kernel variants that lost (BENCHMARKS.md "Mosaic GPU backend") are not
in the library any more; they and their runner are at commit c48c339.
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks.harness import report
from benchmarks.harness import timeit
from infcl_jax._math import LOG2E
from infcl_jax.kernels.mosaic import g_panel as mg


def bench_backends(b, d, dtype, reps, r_list=(4096, 8192), full=True,
                   f32=True):
  # pylint: disable=import-outside-toplevel
  import infcl_jax
  from infcl_jax import BlockSizes
  from infcl_jax.backends import mosaic as mb
  from infcl_jax.backends import registry
  from infcl_jax.kernels import lse_bwd as tb
  from infcl_jax.kernels import sigmoid_bwd as tsb
  from infcl_jax.kernels import sigmoid_fwd as tsf
  from infcl_jax.kernels.mosaic import sigmoid as ms
  # pylint: enable=import-outside-toplevel
  kx, ky = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  y = (jax.random.normal(ky, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  x = x / jnp.linalg.norm(x.astype(jnp.float32), axis=1,
                          keepdims=True).astype(dtype)
  y = y / jnp.linalg.norm(y.astype(jnp.float32), axis=1,
                          keepdims=True).astype(dtype)
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
  rid_all = jnp.arange(b, dtype=jnp.int32)
  sparams_all = jnp.asarray([10.0, -10.0, 1.0, 0.0], jnp.float32)
  if b % 256 == 0 and d % 64 == 0:  # The kernel takes padded inputs.
    stage("stage sigmoid sum mosaic", fwd_flops,
          lambda p, q, ri: ms.sigmoid_tiles(
              p, q, ri, sparams_all, mode="sum", m=b, mask=False,
              has_diagonal=True), x, y, rid_all)
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
  del tsf
  if not full:
    return
  step_flops = 8.0 * b * b * d

  def step(name, loss, backend, xx, yy, bs=None, stages=None):
    if stages:
      # A hybrid under its own name: JAX reuses a loss traced for the same
      # backend name and block sizes, so changing STAGES in place is unseen.
      backend = "mosaic_bench_" + "_".join(
          f"{k}_{v}" for k, v in sorted(stages.items()))
      registry.register(backend, type("Hybrid", (mb.MosaicBackend,), {
          "STAGES": dict(mb.MosaicBackend.STAGES, **stages)}))
    try:
      if loss == "softmax":
        f = lambda p, q, t, c: infcl_jax.contrastive_loss(
            p, q, t, logit_bias=c, backend=backend, block_sizes=bs)
        t, c = jnp.float32(20.0), jnp.float32(0.0)
      else:
        f = lambda p, q, t, c: infcl_jax.sigmoid_loss(
            p, q, t, c, backend=backend, block_sizes=bs)
        t, c = jnp.float32(10.0), jnp.float32(-10.0)
      fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))
      report(f"step {name}", 8.0 * xx.shape[0] ** 2 * d,
             timeit(fn, xx, yy, t, c, reps=reps, inner=3))
    except Exception as e:  # pylint: disable=broad-except
      print(f"step {name} failed: {type(e).__name__}: {str(e)[:300]}",
            flush=True)

  del step_flops
  p8k = BlockSizes(block_q=128, block_k=256, panel_rows=8192)
  step(f"softmax mosaic B={b}", "softmax", "mosaic", x, y)
  step(f"softmax mosaic panel_rows=8192 B={b}", "softmax", "mosaic", x, y,
       bs=p8k)
  if b <= 16384:
    step(f"softmax mosaic panel_rows={b} B={b}", "softmax", "mosaic", x, y,
         bs=BlockSizes(block_q=128, block_k=256, panel_rows=b))
  step(f"softmax mosaic fwd=pallas B={b}", "softmax", "mosaic", x, y,
       stages={"lse": "pallas"})
  step(f"softmax pallas B={b}", "softmax", "pallas", x, y)
  step(f"sigmoid mosaic B={b}", "sigmoid", "mosaic", x, y)
  step(f"sigmoid mosaic fwd=pallas B={b}", "sigmoid", "mosaic", x, y,
       stages={"sigmoid_sum": "pallas"})
  step(f"sigmoid mosaic panel=pallas B={b}", "sigmoid", "mosaic", x, y,
       stages={"sigmoid_grad": "pallas"})
  step(f"sigmoid pallas B={b}", "sigmoid", "pallas", x, y)
  b16 = min(16384, b // 4)
  step(f"softmax mosaic B={b16}", "softmax", "mosaic", x[:b16], y[:b16])
  # A small batch has few panels: fewer, larger GEMMs may keep cuBLAS nearer
  # its peak (the panel is R x B in the input dtype: 512 MB at 16k x 16k).
  for r in (8192, 16384):
    if r <= b16:
      step(f"softmax mosaic panel_rows={r} B={b16}", "softmax", "mosaic",
           x[:b16], y[:b16],
           bs=BlockSizes(block_q=128, block_k=256, panel_rows=r))
  step(f"softmax pallas B={b16}", "softmax", "pallas", x[:b16], y[:b16])
  step(f"sigmoid mosaic B={b16}", "sigmoid", "mosaic", x[:b16], y[:b16])
  step(f"sigmoid pallas B={b16}", "sigmoid", "pallas", x[:b16], y[:b16])
  if f32:
    xf, yf = x.astype(jnp.float32), y.astype(jnp.float32)
    step(f"softmax mosaic float32 (Triton path) B={b}", "softmax", "mosaic",
         xf, yf)
    step(f"softmax mosaic float32 B={b16}", "softmax", "mosaic", xf[:b16],
         yf[:b16])


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--full", type=int, default=1)
  ap.add_argument("--f32", type=int, default=1)
  ap.add_argument("--r_list", default="4096,8192",
                  help="panel rows of the per-panel stages")
  args, _ = ap.parse_known_args()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"B={args.b} D={args.d} {args.dtype}", flush=True)
  bench_backends(args.b, args.d, jnp.dtype(args.dtype), args.reps,
                 r_list=tuple(int(r) for r in args.r_list.split(",")),
                 full=bool(args.full), f32=bool(args.f32))


if __name__ == "__main__":
  main()
