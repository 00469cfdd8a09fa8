"""Accuracy of the softmax loss on a confident model, against float64.

  python benchmarks/bench_confident.py --out OUT.jsonl [--library PATH]

Unit embeddings with each query near its positive (``tests.np_reference.
confident_inputs``), the scale set so that the float64 loss is each of
``--losses``; per (loss, backend, dtype) the relative error of the loss and
of the embedding gradients (one norm over d image and d text), both against
the float64 reference on the inputs as rounded to the dtype. ``--library``
imports ``infcl_jax`` from another checkout (e.g. an older commit unpacked
with ``git archive``), so that a before/after table comes from one job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="rows appended here (jsonl)")
  ap.add_argument("--library", default=REPO,
                  help="the checkout whose infcl_jax is measured")
  ap.add_argument("--backends", default="mosaic,triton,pallas,xla,reference")
  ap.add_argument("--dtypes", default="float32,bfloat16")
  ap.add_argument("--losses", default="6.0,2.5e-4,8e-9,1e-30")
  ap.add_argument("--b", type=int, default=2048)
  ap.add_argument("--d", type=int, default=64)
  args = ap.parse_args(argv)
  sys.path.insert(0, REPO)
  sys.path.insert(0, os.path.abspath(args.library))

  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import infcl_jax  # pylint: disable=import-outside-toplevel
  from tests import np_reference  # pylint: disable=import-outside-toplevel
  from benchmarks import harness  # pylint: disable=import-outside-toplevel

  meta = dict(harness.device_meta(),
              library=os.path.relpath(os.path.dirname(infcl_jax.__file__),
                                      os.getcwd()))
  rel = lambda a, r: float(np.linalg.norm(a - r) / np.linalg.norm(r))
  print(f"{'loss':>9} {'backend':>9} {'dtype':>9} {'loss err':>9} "
        f"{'grad err':>9}  ({meta['library']})", flush=True)
  for target in map(float, args.losses.split(",")):
    rng = np.random.default_rng(0)
    x64, y64, t = np_reference.confident_inputs(rng, args.b, args.b, args.d,
                                                target)
    for dtype in args.dtypes.split(","):
      x, y = jnp.asarray(x64, dtype), jnp.asarray(y64, dtype)
      ref = np_reference.clip_loss_and_grads(
          np.asarray(x, np.float64), np.asarray(y, np.float64), t)
      ref_g = np.concatenate([ref[1], ref[2]])
      for backend in args.backends.split(","):
        f = lambda x, y: infcl_jax.contrastive_loss(x, y, t, backend=backend)
        try:
          val, (dx, dy) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, y)
          g = np.concatenate([np.asarray(dx, np.float64),
                              np.asarray(dy, np.float64)])
          row = dict(loss_err=abs(float(val) - ref[0]) / ref[0],
                     grad_err=rel(g, ref_g), status="ok")
        except Exception as e:  # pylint: disable=broad-except
          row = dict(status=f"{type(e).__name__}: {str(e)[:200]}")
        row = dict(meta, true_loss=ref[0], scale=t, backend=backend,
                   dtype=dtype, b=args.b, d=args.d, **row)
        with open(args.out, "a", encoding="utf-8") as fh:
          fh.write(json.dumps(row) + "\n")
        if row["status"] == "ok":
          print(f"{ref[0]:9.2e} {backend:>9} {dtype:>9} "
                f"{row['loss_err']:9.1e} {row['grad_err']:9.1e}", flush=True)
        else:
          print(f"{ref[0]:9.2e} {backend:>9} {dtype:>9} {row['status']}",
                flush=True)


if __name__ == "__main__":
  main()
