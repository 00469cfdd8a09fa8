"""What ``groups=`` costs the whole loss, as a user calls it (one GPU).

fwd+bwd of ``contrastive_loss`` / ``sigmoid_loss`` at B = 65,536, D = 768,
bf16, each kernel backend without groups, with "mask" and with
"positives" (pairs: every image has two captions somewhere in the batch),
in one job; the O(B) id work (sorts, grouped sums) is included. Every
grouped variant is first checked against the xla backend at 3001 rows.
The target: <= 5% over the same backend without groups.

    PYTHONPATH=. python3 benchmarks/bench_groups.py [--backends mosaic,triton,pallas]
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import infcl_jax
from benchmarks.harness import bench, inputs, print_device, record, rel, summary


def pairs(b):
  """Group ids with every id used twice, shuffled (two captions per image,
  anywhere in the batch)."""
  return jnp.asarray(np.random.default_rng(0).permutation(b) // 2, jnp.int32)


def loss_fn(family, backend, mode):
  def f(x, y, g):
    kw = {} if mode is None else dict(groups=g, group_mode=mode)
    if family == "softmax":
      return infcl_jax.contrastive_loss(x, y, 14.3, backend=backend, **kw)
    return infcl_jax.sigmoid_loss(x, y, 10.0, -10.0, backend=backend, **kw)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def check(family, backend, mode):
  """Relative errors vs xla at 3001 rows (odd, several tiles)."""
  x, y = inputs(3001, 768, jnp.bfloat16, seed=3)
  g = pairs(3001)
  v, (gx, _) = loss_fn(family, backend, mode)(x, y, g)
  rv, (rgx, _) = loss_fn(family, "xla", mode)(x, y, g)
  return f"loss rel {abs(float(v) - float(rv)) / abs(float(rv)):.1e} dx rel {rel(gx, rgx):.1e}"


def cost(b, backends, rounds, families=("softmax", "sigmoid"),
         modes=("none", "mask", "positives", "none again")):
  """Per (family, backend): the variants compiled, then timed in
  ``rounds`` interleaved rounds (none, mask, positives, none again, ...),
  so a drift of the clocks during the job lands on all alike; each row is
  the median over the rounds, with the rounds' spread. "none again" is
  the plain loss compiled a second time: its distance from "none" is the
  noise floor (XLA autotunes the dX / dY GEMMs per compile; run with
  ``--xla_gpu_per_fusion_autotune_cache_dir`` so that every compile gets
  the same GEMMs)."""
  x, y = inputs(b, 768, jnp.bfloat16, seed=1)
  g = pairs(b)
  rows = [(f, be) for be in backends for f in families]
  for family, backend in rows:
    fns = {}
    for mode in modes:
      group_mode = None if mode.startswith("none") else mode
      # A fresh trace and compile per variant ("none again" is the plain
      # loss compiled twice): JAX caches the loss's inner traces.
      jax.clear_caches()
      fns[mode] = loss_fn(family, backend, group_mode).lower(x, y, g).compile()
      if group_mode:
        record(f"check {family} {backend} {mode}",
               lambda: check(family, backend, group_mode))
    times = {m: [] for m in modes}
    for _ in range(rounds):
      for mode in modes:
        times[mode].append(bench(fns[mode], x, y, g, reps=5))
    med = {m: float(np.median(t)) for m, t in times.items()}
    for mode in modes:
      record(f"time B={b} {family} {backend} {mode} ms",
             lambda m=mode: f"{med[m]:.3f} (rounds {min(times[m]):.3f}-"
             f"{max(times[m]):.3f})")
    for mode in modes[1:]:
      record(f"cost {family} {backend} {mode} %",
             lambda m=mode: round(100 * (med[m] / med["none"] - 1), 1))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--b", type=int, default=65536)
  p.add_argument("--backends", default="mosaic,triton,pallas")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--families", default="softmax,sigmoid")
  p.add_argument("--modes", default="none,mask,positives,none again",
                 help="'none' first; 'none again' is the noise floor")
  a = p.parse_args()
  print_device()
  cost(a.b, a.backends.split(","), a.rounds, a.families.split(","),
       tuple(a.modes.split(",")))
  summary(50)


if __name__ == "__main__":
  main()
