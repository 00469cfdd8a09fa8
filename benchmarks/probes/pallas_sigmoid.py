"""GPU probe of the Pallas sigmoid tiles: a quick check and stage timings.

A development tool for one device call (about a minute): checks the Pallas
sigmoid backend against a float64 reference at B=4096, then times the whole
fwd+bwd step against the XLA backend, the forward and backward tile ops
alone, and a few block-size variants at B=65536, D=768. Every item is
isolated: a failure prints and the probe goes on.

  python benchmarks/probes/pallas_sigmoid.py [--b 65536] [--quick]
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

import infcl_jax
from infcl_jax.backends import registry
from infcl_jax.block_sizes import BlockSizes
from benchmarks.probes.common import bench, inputs, record, rel, summary  # pylint: disable=wrong-import-position


def loss_grads(backend, bs=None):
  def f(x, y, t, b):
    return infcl_jax.sigmoid_loss(x, y, t, b, backend=backend, block_sizes=bs)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))


def check_f64(dtype, b=4096, d=768):
  x, y = inputs(b, d, dtype, seed=1)
  t, bias = 10.0, -10.0
  v, g = loss_grads("pallas")(x, y, jnp.float32(t), jnp.float32(bias))
  x64 = np.asarray(x.astype(jnp.float32), np.float64)
  y64 = np.asarray(y.astype(jnp.float32), np.float64)
  s0 = x64 @ y64.T
  s = t * s0 + bias
  z = -np.ones_like(s)
  np.fill_diagonal(z, 1.0)
  loss = np.sum(np.logaddexp(0.0, -z * s)) / b
  gm = -z * np.exp(-np.logaddexp(0.0, z * s)) / b
  return {"loss": rel(v, loss),
          "dx": rel(g[0].astype(jnp.float32), t * gm @ y64),
          "dy": rel(g[1].astype(jnp.float32), t * gm.T @ x64),
          "dt": rel(g[2], np.sum(gm * s0)), "db": rel(g[3], np.sum(gm))}


def time_full(b, d, dtype, backend, bs=None):
  x, y = inputs(b, d, dtype)
  ms = bench(loss_grads(backend, bs), x, y, jnp.float32(10.0),
             jnp.float32(-10.0))
  return f"{ms:.2f} ms  {8 * b * b * d / ms / 1e9:.0f} TFLOP/s(8BBD)"


def time_fwd(b, d, dtype, bs):
  x, y = inputs(b, d, dtype)
  be = registry.get("pallas", "sigmoid")
  f = jax.jit(lambda x, y: be.sigmoid_sum(x, y, 10.0, -10.0, has_diagonal=True,
                                          block_sizes=bs))
  ms = bench(f, x, y)
  return f"{ms:.2f} ms  {2 * b * b * d / ms / 1e9:.0f} TFLOP/s(2BBD)"


def time_bwd(b, d, dtype, bs):
  x, y = inputs(b, d, dtype)
  be = registry.get("pallas", "sigmoid")
  f = jax.jit(lambda x, y: be.sigmoid_grad(x, y, 10.0, -10.0, 1.0 / b,
                                           has_diagonal=True, block_sizes=bs))
  ms = bench(f, x, y)
  return f"{ms:.2f} ms  {6 * b * b * d / ms / 1e9:.0f} TFLOP/s(6BBD)"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  b, d = args.b, 768
  print(jax.devices(), jax.__version__, flush=True)
  for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
    record(f"f64check_B4096_{jnp.dtype(dt).name}", lambda dt=dt: check_f64(dt))
  for dt in (jnp.bfloat16, jnp.float32):
    name = jnp.dtype(dt).name
    record(f"full_pallas_B{b}_{name}",
           lambda dt=dt: time_full(b, d, dt, "pallas"))
    record(f"full_xla_B{b}_{name}", lambda dt=dt: time_full(b, d, dt, "xla"))
  dflt = registry.get("pallas", "softmax").default_block_sizes("gpu", jnp.bfloat16)
  record(f"fwd_B{b}_bf16", lambda: time_fwd(b, d, jnp.bfloat16, dflt))
  record(f"bwd_B{b}_bf16", lambda: time_bwd(b, d, jnp.bfloat16, dflt))
  record(f"bwd_B{b}_f16", lambda: time_bwd(b, d, jnp.float16, dflt))
  if not args.quick:
    # 128 x 128 with 8 warps compiles without register spills (ptxas, sm_90);
    # the 128 x 256 default spills a few hundred bytes in the epilogue.
    fvariants = {"fwd_128x128": dict(block_k=128),
                 "fwd_128x128_w4": dict(block_k=128, num_warps=4),
                 "fwd_128x256_s4": dict(num_stages=4)}
    for name, kw in fvariants.items():
      bs = dataclasses.replace(dflt, **kw)
      record(f"{name}_B{b}_bf16",
             lambda bs=bs: time_fwd(b, d, jnp.bfloat16, bs))
    bvariants = {"bwd_128x128": dict(bwd_block_k=128),
                 "bwd_xla_panel": dict(bwd_impl="xla"),
                 "bwd_panel8192": dict(panel_rows=8192)}
    for name, kw in bvariants.items():
      bs = dataclasses.replace(dflt, **kw)
      record(f"{name}_B{b}_bf16",
             lambda bs=bs: time_bwd(b, d, jnp.bfloat16, bs))
  summary(40)


if __name__ == "__main__":
  main()
