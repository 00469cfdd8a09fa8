"""Float32 inputs, how exact and how fast each way of running them is.

What the float32 rules ask of a backend: the loss within 3e-5 of float64
at B = 8192 and under 1e-3 in the hard cases (scale 30-50, small D), the
step within 2x of bf16. Variants:

* ``tf32``: ``precision="default"`` (TF32 tensor cores, one pass, the
  positives put back in float32);
* ``high``: the kernel backends' default (3-pass TF32);
* ``highest``: full float32 (``jax.default_matmul_precision("highest")``);
* ``bf16x3``: the split product x.y ~ xh.yh + xh.yl + xl.yh with
  xh = bf16(x), xl = bf16(x - xh), run as ONE bf16 problem of depth 3D
  ([xh | xh | xl] against [yh | yl | yh]); the dropped xl.yl term is ~2^-16
  of the product. Autodiff through the split gives dx = G (yh + yl): only
  the hi copies carry gradient (the lo part's own gradient cancels).
  Here the bf16 problem's gradients come back in bf16, so its gradient
  errors are an upper bound for a backend that keeps them in float32.

Every variant is checked against float64 (loss and both embedding
gradients) before it is timed.

  python benchmarks/bench_f32.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import infcl_jax  # pylint: disable=wrong-import-position
from benchmarks.harness import bench, inputs, record, rel, summary  # pylint: disable=wrong-import-position

BF16 = jnp.bfloat16


def split3(x, y):
  """The depth-3D bf16 operands of the split product (see the docstring)."""
  xh = x.astype(BF16)
  xl = (x - xh.astype(jnp.float32)).astype(BF16)
  yh = y.astype(BF16)
  yl = (y - yh.astype(jnp.float32)).astype(BF16)
  return (jnp.concatenate([xh, xh, xl], axis=1),
          jnp.concatenate([yh, yl, yh], axis=1))


def loss_fn(backend, variant, direction):
  # "tf32": precision="default" (TF32 tiles, the positives put back);
  # "high": the kernel backends' float32 default (3-pass TF32); "highest":
  # JAX's own switch (read when the loss is traced).
  prec = "highest" if variant == "highest" else None
  precision = {"tf32": "default", "high": "high"}.get(variant)

  def f(x, y, t, b):
    if variant == "bf16x3":
      x, y = split3(x, y)
    elif variant == "bf16":
      x, y = x.astype(BF16), y.astype(BF16)
    return infcl_jax.contrastive_loss(x, y, t, logit_bias=b,
                                      direction=direction, backend=backend,
                                      precision=precision)
  g = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))

  def run(*args):
    with jax.default_matmul_precision(prec):
      return g(*args)
  return run


def reference64(x, y, t, b, direction):
  with jax.enable_x64(True):
    f = lambda x, y: infcl_jax.contrastive_loss(  # noqa: E731
        x, y, jnp.float64(t), logit_bias=jnp.float64(b), direction=direction,
        backend="reference")
    v, (gx, gy) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(
        jnp.asarray(np.asarray(x, np.float64)),
        jnp.asarray(np.asarray(y, np.float64)))
    return float(v), np.asarray(gx), np.asarray(gy)


def correlated(n, m, d, seed, noise=3.0):
  """Unit-norm pairs that share a direction (trained-model-like: positives
  score high), so the loss is small and its relative error is sensitive.
  The positives' cosine is ~1/sqrt(1 + noise^2): 0.32 at noise 3, a margin
  of ~16 logits at scale 50, a loss of order 1e-2..1. (At noise 0.7 the
  float64 loss is ~1e-12 and a relative error means nothing.)"""
  x, y = inputs(max(n, m), d, jnp.float32, seed=seed)
  y = x + noise * y
  y = y / jnp.linalg.norm(y, axis=1, keepdims=True)
  return x[:n], y[:m]


CASES = {
    # name: (n, m, d, scale, bias, direction, correlated?)
    "B8192_D768_t14": (8192, 8192, 768, 14.3, 0.0, "both", False),
    "B8192_D768_t50_corr": (8192, 8192, 768, 50.0, 0.0, "both", True),
    "3001x3001x200_t50": (3001, 3001, 200, 50.0, 0.0, "both", False),
    "3001x3001x200_t50_corr": (3001, 3001, 200, 50.0, 0.0, "both", True),
    "2500x1000x96_t30_t2i": (2500, 1000, 96, 30.0, 0.0, "text_to_image",
                             False),
    "2500x1000x96_t30_t2i_corr": (2500, 1000, 96, 30.0, 0.0, "text_to_image",
                                  True),
}


def _errors(backend, variant, x, y, t, b, direction, ref):
  """Loss and gradient relative errors of one way of running, vs float64."""
  v, (gx, gy) = loss_fn(backend, variant, direction)(
      x, y, jnp.float32(t), jnp.float32(b))
  return (f"loss rel {abs(float(v) - ref[0]) / abs(ref[0]):.2e}  "
          f"dx rel {rel(gx, ref[1]):.2e}  dy rel {rel(gy, ref[2]):.2e}")


def fidelity(backends, variants):
  for case, (n, m, d, t, b, direction, corr) in CASES.items():
    x, y = (correlated(n, m, d, seed=n + d) if corr
            else inputs(n, d, jnp.float32, seed=n + d, m=m))
    ref = reference64(x, y, t, b, direction)
    print(f"{case}: float64 loss {ref[0]:.6f}", flush=True)
    # xla in full float32: the exactness baseline beside the kernels.
    for backend, variant in ([(be, v) for be in backends for v in variants]
                             + [("xla", "highest")]):
      record(f"fid {case} {backend} {variant}",
             lambda be=backend, v=variant: _errors(be, v, x, y, t, b,
                                                   direction, ref))


def speed(b, d, rows):
  x, y = inputs(b, d, jnp.float32, seed=1)
  t, bi = jnp.float32(14.3), jnp.float32(0.0)
  for backend, variant in rows:
    record(f"time B={b} {backend} {variant} ms",
           lambda backend=backend, variant=variant: round(bench(
               loss_fn(backend, variant, "both"), x, y, t, bi, reps=5), 3))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--quick", action="store_true",
                 help="fewer cases (a CPU smoke run)")
  p.add_argument("--b", type=int, default=65536)
  a = p.parse_args()
  print("jax", jax.__version__, jax.devices(), flush=True)
  kernel = ["pallas", "mosaic", "triton"]
  if a.quick:
    kernel = ["xla"]
    for k in list(CASES)[1:]:
      CASES.pop(k)
    CASES["B8192_D768_t14"] = (64, 64, 32, 14.3, 0.0, "both", False)
  fidelity(kernel, ["tf32", "highest", "bf16x3"])
  rows = [("mosaic", "bf16"), ("mosaic", "tf32"), ("mosaic", "high"),
          ("mosaic", "bf16x3"), ("pallas", "bf16x3"), ("triton", "tf32"),
          ("triton", "high"), ("triton", "bf16x3")]
  speed(a.b, 768, [("xla", "bf16")] if a.quick else rows)
  if not a.quick:
    speed(16384, 768, [("mosaic", "highest"), ("mosaic", "tf32"),
                       ("mosaic", "bf16x3"), ("mosaic", "bf16")])
  summary(55)


if __name__ == "__main__":
  main()
