"""GPU probe of the Pallas softmax tiles: correctness and per-stage timings.

A development tool for one device call: checks the Pallas backend against a
float64 reference and against the XLA backend, then times kernel variants
and stages (forward with / without column statistics, the probability-panel
kernel alone, the GEMMs alone, whole fwd+bwd) at B=65536, D=768. Every
variant is isolated: a failure prints and the probe goes on.

  python benchmarks/probes/pallas_softmax.py [--b 65536] [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np
from jax import lax

import infcl_jax
from infcl_jax.backends import registry
from infcl_jax.block_sizes import BlockSizes
from benchmarks.probes.common import bench, inputs, record, rel, summary  # pylint: disable=wrong-import-position
from infcl_jax.kernels import lse_bwd


def loss_grads(backend, bs=None, direction="both"):
  def f(x, y, t, b):
    return infcl_jax.contrastive_loss(x, y, t, logit_bias=b,
                                      direction=direction, backend=backend,
                                      block_sizes=bs)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))


def f64_reference(x, y, t, b, direction="both"):
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  s = t * x @ y.T + b
  n = min(s.shape)
  def lse(a, axis):
    mx = a.max(axis=axis, keepdims=True)
    return (mx + np.log(np.exp(a - mx).sum(axis=axis, keepdims=True))).squeeze(axis)
  r, c = lse(s, 1), lse(s, 0)
  pos = np.diag(s)[:n]
  pr = np.exp(s - r[:, None])
  pc = np.exp(s - c[None, :])
  e = np.zeros_like(s)
  e[np.arange(n), np.arange(n)] = 1
  if direction == "both":
    loss = 0.5 * (np.mean(r[:n] - pos) + np.mean(c[:n] - pos))
    g = (pr - e) / (2 * n) + (pc - e) / (2 * n)
  elif direction == "image_to_text":
    loss = np.mean(r - pos)
    g = (pr - e) / s.shape[0]
  s0 = x @ y.T
  return loss, t * g @ y, t * g.T @ x, np.sum(g * s0), np.sum(g)


def check_f64(dtype, b=4096, d=768, bs=None, direction="both", m=None):
  x, y = inputs(b, d, dtype, seed=1, m=m)
  t, bias = jnp.float32(14.3), jnp.float32(-2.1)
  (v, g), ref = loss_grads("pallas", bs, direction)(x, y, t, bias), None
  ref = f64_reference(x, y, 14.3, -2.1, direction)
  return {"loss": rel(v, ref[0]), "dx": rel(g[0], ref[1]),
          "dy": rel(g[1], ref[2]), "dt": rel(g[2], ref[3]),
          "db_abs": float(abs(np.asarray(g[3]) - ref[4]))}


def check_vs_xla(dtype, b, d=768):
  x, y = inputs(b, d, dtype, seed=2)
  t, bias = jnp.float32(20.0), jnp.float32(0.5)
  vp, gp = loss_grads("pallas")(x, y, t, bias)
  vx, gx = loss_grads("xla")(x, y, t, bias)
  return {"loss": rel(vp, vx), "dx": rel(gp[0].astype(jnp.float32), gx[0].astype(jnp.float32)),
          "dy": rel(gp[1].astype(jnp.float32), gx[1].astype(jnp.float32)),
          "dt": rel(gp[2], gx[2])}


def time_fwd(b, d, dtype, bs, rows=True, cols=True):
  x, y = inputs(b, d, dtype)
  be = registry.get("pallas", "softmax")
  f = jax.jit(lambda x, y: be.lse(x, y, 20.0, 0.0, rows=rows, cols=cols,
                                  block_sizes=bs))
  ms = bench(f, x, y)
  fl = 2 * b * b * d
  return f"{ms:.2f} ms  {fl / ms / 1e9:.0f} TFLOP/s(2BBD)"


def time_bwd(b, d, dtype, bs):
  x, y = inputs(b, d, dtype)
  be = registry.get("pallas", "softmax")
  r, c = jax.jit(lambda x, y: be.lse(x, y, 20.0, 0.0, rows=True, cols=True,
                                     block_sizes=bs))(x, y)
  f = jax.jit(lambda x, y, r, c: be.lse_grad(x, y, 20.0, 0.0, r, c, 0.5 / b,
                                             0.5 / b, block_sizes=bs))
  ms = bench(f, x, y, r, c)
  return f"{ms:.2f} ms  {6 * b * b * d / ms / 1e9:.0f} TFLOP/s(6BBD)"


def time_gpanel_only(b, d, dtype, bs):
  """Only the probability-panel kernel over all panels (no GEMMs)."""
  x, y = inputs(b, d, dtype)
  r2 = jnp.full((b,), 30.0, jnp.float32)
  params = jnp.array([20.0 * 1.4427, 0.0, 0.5, 0.5], jnp.float32)
  rr = bs.panel_rows
  xp = x.reshape(b // rr, rr, d)
  def f(xp, y):
    def body(c, xs):
      g, s1, s2 = lse_bwd.g_panel(
          xs, y, r2[:rr], r2, params, rows=True, cols=True, mask=False,
          g_dtype=x.dtype, block_q=bs.bwd_block_q, block_k=bs.bwd_block_k,
          block_d=bs.block_d, num_warps=bs.bwd_num_warps,
          num_stages=bs.bwd_num_stages, precision=lax.Precision.DEFAULT,
          single_exp=bs.single_exp,
          interpret=False)
      return c + s1 + s2 + g[0, 0].astype(jnp.float32), None
    return lax.scan(body, jnp.float32(0), xp)[0]
  ms = bench(jax.jit(f), xp, y)
  return f"{ms:.2f} ms  {2 * b * b * d / ms / 1e9:.0f} TFLOP/s(2BBD)"


def time_gemms_only(b, d, dtype, rr, precision=None):
  x, y = inputs(b, d, dtype)
  g = jax.random.uniform(jax.random.key(5), (rr, b), jnp.float32).astype(dtype)
  xp = x.reshape(b // rr, rr, d)
  def f(xp, y, g):
    def body(dy, xs):
      dx = lax.dot_general(g, y, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32,
                           precision=precision)
      dy = dy + lax.dot_general(g, xs, (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32,
                                precision=precision)
      return dy, dx
    return lax.scan(body, jnp.zeros((b, d), jnp.float32), xp)
  ms = bench(jax.jit(f), xp, y, g)
  return f"{ms:.2f} ms  {4 * b * b * d / ms / 1e9:.0f} TFLOP/s(4BBD)"


def time_full(b, d, dtype, backend, bs=None):
  x, y = inputs(b, d, dtype)
  f = loss_grads(backend, bs)
  ms = bench(f, x, y, jnp.float32(20.0), jnp.float32(0.0))
  return f"{ms:.2f} ms  {8 * b * b * d / ms / 1e9:.0f} TFLOP/s(8BBD)"


def matmul_ceiling(n=8192):
  k1, k2 = jax.random.split(jax.random.key(9))
  a = jax.random.normal(k1, (n, n), jnp.bfloat16)
  c = jax.random.normal(k2, (n, n), jnp.bfloat16)
  f = jax.jit(lambda a, c: jnp.dot(a, c, preferred_element_type=jnp.float32))
  ms = bench(f, a, c, reps=10, warmup=3)
  return f"{2 * n**3 / ms / 1e9:.0f} TFLOP/s"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--set", default="v1")
  args = ap.parse_args()
  b, d = args.b, 768
  print(jax.devices(), jax.__version__, flush=True)
  if args.set == "v2":
    return probe_v2(b, d)
  record("matmul_ceiling_bf16", matmul_ceiling)
  for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
    record(f"f64check_B4096_{jnp.dtype(dt).name}", lambda dt=dt: check_f64(dt))
  record("f64check_odd_B1000x1531_D300_i2t_bf16",
         lambda: check_f64(jnp.bfloat16, b=1000, d=300, m=1531,
                           direction="image_to_text"))
  record("f64check_B4096_f32_highest", lambda: check_f64(
      jnp.float32, bs=dataclasses.replace(
          registry.get("pallas", "softmax").default_block_sizes("gpu", jnp.float32),
          f32_precision="highest")))
  dflt = registry.get("pallas", "softmax").default_block_sizes("gpu", jnp.bfloat16)
  record(f"full_pallas_B{b}_bf16", lambda: time_full(b, d, jnp.bfloat16, "pallas"))
  record(f"full_xla_B{b}_bf16", lambda: time_full(b, d, jnp.bfloat16, "xla"))
  record(f"fwd_rows+cols_B{b}_bf16", lambda: time_fwd(b, d, jnp.bfloat16, dflt))
  record(f"fwd_rows_only_B{b}_bf16",
         lambda: time_fwd(b, d, jnp.bfloat16, dflt, cols=False))
  record(f"bwd_B{b}_bf16", lambda: time_bwd(b, d, jnp.bfloat16, dflt))
  record(f"gpanel_only_B{b}_bf16", lambda: time_gpanel_only(b, d, jnp.bfloat16, dflt))
  record(f"gemms_only_B{b}_bf16", lambda: time_gemms_only(b, d, jnp.bfloat16, 4096))
  record(f"full_pallas_B{b}_f32", lambda: time_full(b, d, jnp.float32, "pallas"))
  record(f"vs_xla_B{b}_bf16", lambda: check_vs_xla(jnp.bfloat16, b))
  if not args.quick:
    variants = {
        "fwd_128x128_w4": dict(block_k=128, num_warps=4),
        "fwd_128x256_s4": dict(num_stages=4),
        "fwd_128x256_d32": dict(block_d=32, num_stages=4),
        "fwd_64x256": dict(block_q=64),
    }
    for name, kw in variants.items():
      bs = dataclasses.replace(dflt, **kw)
      record(f"{name}_B{b}_bf16", lambda bs=bs: time_fwd(b, d, jnp.bfloat16, bs))
    bvariants = {
        "bwd_xla_panel": dict(bwd_impl="xla"),
        "bwd_128x128_w4": dict(bwd_block_k=128, bwd_num_warps=4),
        "bwd_panel8192": dict(panel_rows=8192),
        "bwd_s4": dict(bwd_num_stages=4),
    }
    for name, kw in bvariants.items():
      bs = dataclasses.replace(dflt, **kw)
      record(f"{name}_B{b}_bf16", lambda bs=bs: time_bwd(b, d, jnp.bfloat16, bs))
  summary(45)


def probe_v2(b, d):
  """Second round: single-exp paths, backward tiles, float32 stages."""
  bf, f32 = jnp.bfloat16, jnp.float32
  dflt = registry.get("pallas", "softmax").default_block_sizes("gpu", bf)
  dflt32 = registry.get("pallas", "softmax").default_block_sizes("gpu", f32)
  no1 = dataclasses.replace(dflt, single_exp=False)
  rep = dataclasses.replace
  record("matmul_ceiling_bf16", matmul_ceiling)
  record("full_pallas_bf16", lambda: time_full(b, d, bf, "pallas"))
  record("full_pallas_bf16_twoexp", lambda: time_full(b, d, bf, "pallas", no1))
  record("fwd_bf16", lambda: time_fwd(b, d, bf, dflt))
  record("fwd_bf16_twoexp", lambda: time_fwd(b, d, bf, no1))
  record("fwd_bf16_rows_only", lambda: time_fwd(b, d, bf, dflt, cols=False))
  record("bwd_bf16", lambda: time_bwd(b, d, bf, dflt))
  record("bwd_bf16_twoexp", lambda: time_bwd(b, d, bf, no1))
  record("gpanel_bf16", lambda: time_gpanel_only(b, d, bf, dflt))
  record("gpanel_bf16_twoexp", lambda: time_gpanel_only(b, d, bf, no1))
  record("gpanel_bf16_d128_s2", lambda: time_gpanel_only(
      b, d, bf, rep(dflt, block_d=128, bwd_num_stages=2)))
  record("gpanel_bf16_256x128", lambda: time_gpanel_only(
      b, d, bf, rep(dflt, bwd_block_q=256, bwd_block_k=128)))
  record("gpanel_bf16_128x128_w8", lambda: time_gpanel_only(
      b, d, bf, rep(dflt, bwd_block_k=128)))
  record("fwd_bf16_s4", lambda: time_fwd(b, d, bf, rep(dflt, num_stages=4)))
  record("full_pallas_f32", lambda: time_full(b, d, f32, "pallas"))
  record("fwd_f32", lambda: time_fwd(b, d, f32, dflt32))
  record("fwd_f32_128x256", lambda: time_fwd(b, d, f32, rep(dflt32, block_k=256)))
  record("bwd_f32", lambda: time_bwd(b, d, f32, dflt32))
  record("gemms_f32_default", lambda: time_gemms_only(b, d, f32, 2048))
  record("gemms_f32_tf32alg", lambda: time_gemms_only(
      b, d, f32, 2048, lax.DotAlgorithmPreset.TF32_TF32_F32))
  record("gpanel_f32", lambda: time_gpanel_only(b, d, f32, dflt32))
  record("gpanel_f32_128x256", lambda: time_gpanel_only(
      b, d, f32, rep(dflt32, bwd_block_k=256)))
  summary(45)


if __name__ == "__main__":
  main()
