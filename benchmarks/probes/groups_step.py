"""GPU probe: one loss fwd+bwd with or without ``groups=``, for a profiler.

Runs the jitted value-and-grad of ``contrastive_loss`` / ``sigmoid_loss``
(pairs: every group id twice, as ``bench_groups``) ``--calls`` times, the
first compiling. Meant to run under Nsight Compute, so that one kernel of
a grouped variant can be read beside the same kernel without groups:

  ncu --clock-control none -k regex:infcl --launch-count 4 \
    python3 benchmarks/probes/groups_step.py --family sigmoid --backend triton --mode mask
"""
from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position

from benchmarks.bench_groups import loss_fn, pairs  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks.probes.common import inputs  # noqa: E402  pylint: disable=wrong-import-position


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--family", default="softmax", choices=("softmax", "sigmoid"))
  p.add_argument("--backend", default="mosaic")
  p.add_argument("--mode", default="none", choices=("none", "mask", "positives"))
  p.add_argument("--b", type=int, default=32768)
  p.add_argument("--calls", type=int, default=2)
  a = p.parse_args()
  x, y = inputs(a.b, 768, jnp.bfloat16, seed=1)
  g = pairs(a.b)
  f = loss_fn(a.family, a.backend, None if a.mode == "none" else a.mode)
  for _ in range(a.calls):
    v, _ = jax.block_until_ready(f(x, y, g))
  print(f"{a.family} {a.backend} {a.mode} B={a.b}: loss {float(v):.6f}")


if __name__ == "__main__":
  main()
