"""GPU probe: where the ``triton`` backend's sigmoid loses to Pallas-Triton.

Both run the same algorithm with the same tiles, yet the first H200 bench
had the Triton-language sigmoid slower (B = 65,536, D = 768, bf16, fwd+bwd)
while its softmax matched. This times the forward alone and fwd+bwd for
``pallas`` and for ``triton`` variants, each variant in a fresh process
(a patched device function must not meet a cached compile):

* block-size variants (warps, stages, tiles of either kernel);
* math variants of the epilogue: softplus through libdevice's ``log1pf``
  instead of the log(w) e / (w - 1) identity (whose IEEE division is ~10
  instructions per logit), the sigmoid with an approximate division.

Each variant is checked against xla (B = 4096 by default) before it is timed.

  python benchmarks/probes/triton_sigmoid.py [--b 65536] [--variants a,b]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position

TAG = "PROBE_RESULT "

# name -> (backend, BlockSizes overrides, math patch)
VARIANTS = {
    "pallas": ("pallas", {}, None),
    "triton": ("triton", {}, None),
    "triton_log1p": ("triton", {}, "log1p"),
    "triton_log1p_fdiv": ("triton", {}, "log1p+fdiv"),
    "triton_fwd_w4": ("triton", dict(num_warps=4), None),
    "triton_fwd_s4": ("triton", dict(num_stages=4), None),
    "triton_fwd_128": ("triton", dict(block_k=128), None),
    "triton_bwd_w4": ("triton", dict(bwd_num_warps=4), None),
    "triton_bwd_s4": ("triton", dict(bwd_num_stages=4), None),
    "triton_bwd_128": ("triton", dict(bwd_block_k=128), None),
}


def _patch(kind):
  """Swaps the shared device functions before anything compiles."""
  import triton  # pylint: disable=import-outside-toplevel
  import triton.language as tl  # pylint: disable=import-outside-toplevel
  from triton.language.extra import libdevice  # pylint: disable=import-outside-toplevel
  from infcl_jax.kernels.triton import common  # pylint: disable=import-outside-toplevel

  if "log1p" in kind:
    @triton.jit
    def softplus(u):
      return tl.maximum(u, 0.0) + libdevice.log1p(tl.exp(-tl.abs(u)))
    common.softplus = softplus
  if "fdiv" in kind:
    @triton.jit
    def sigmoid(u):
      return tl.fdiv(1.0, 1.0 + tl.exp(-u))
    common.sigmoid = sigmoid


def child(name, b, check_b):
  backend, over, patch = VARIANTS[name]
  if patch:
    _patch(patch)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import infcl_jax  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  from benchmarks.probes.common import inputs  # pylint: disable=import-outside-toplevel

  base = registry.get(backend, "sigmoid").default_block_sizes(jax.default_backend(), jnp.bfloat16)
  bs = dataclasses.replace(base, **over)

  def loss(x, y, t, bi, be=backend, bs=bs):
    return infcl_jax.sigmoid_loss(x, y, t, bi, backend=be, block_sizes=bs)
  vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  fwd = jax.jit(loss)
  t, bi = jnp.float32(10.0), jnp.float32(-10.0)
  out = dict(variant=name, block_sizes=str(bs))
  # Exactness first: against xla at a small size.
  x, y = inputs(check_b, 768, jnp.bfloat16, seed=3)
  v, (gx, _) = vg(x, y, t, bi)
  vr, (gxr, _) = jax.jit(jax.value_and_grad(
      lambda x, y: infcl_jax.sigmoid_loss(x, y, t, bi, backend="xla"),
      argnums=(0, 1)))(x, y)
  out["loss_rel_vs_xla"] = abs(float(v) - float(vr)) / abs(float(vr))
  g, gr = np.asarray(gx, np.float32), np.asarray(gxr, np.float32)
  out["dx_rel_vs_xla"] = float(np.linalg.norm(g - gr) / np.linalg.norm(gr))
  x, y = inputs(b, 768, jnp.bfloat16, seed=1)
  out["fwd_ms"] = harness.timeit(fwd, x, y, t, bi, reps=7, warmup=2).median * 1e3
  out["fwd_bwd_ms"] = harness.timeit(vg, x, y, t, bi, reps=7,
                                     warmup=2).median * 1e3
  print(TAG + json.dumps(out), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--b", type=int, default=65536)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--check-b", type=int, default=4096)
  p.add_argument("--one", help=argparse.SUPPRESS)
  p.add_argument("--timeout-s", type=int, default=90)
  a = p.parse_args()
  if a.one:
    child(a.one, a.b, a.check_b)
    return
  rows = []
  for name in a.variants.split(","):
    r = harness.run_child([os.path.abspath(__file__), "--one", name, "--b",
                           str(a.b), "--check-b", str(a.check_b)], result_tag=TAG, timeout_s=a.timeout_s)
    r.setdefault("variant", name)
    rows.append(r)
    print(json.dumps(r), flush=True)
  print(f"\n{'variant':22s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} "
        f"{'loss vs xla':>11s} {'dx vs xla':>9s}")
  for r in rows:
    if "fwd_ms" in r:
      print(f"{r['variant']:22s} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:10.2f} "
            f"{r['loss_rel_vs_xla']:11.1e} {r['dx_rel_vs_xla']:9.1e}")
    else:
      print(f"{r['variant']:22s} {str(r.get('status', r))[:80]}")


if __name__ == "__main__":
  main()
