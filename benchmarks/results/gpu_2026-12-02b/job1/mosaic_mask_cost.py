"""EXPERIMENT: where the Mosaic softmax "mask" cost goes (kernel variants).

The variants are switches of variants.patch (beside this file), applied to
the kernels of commit c65c8d2 (job 1: both kernels; job 3: the panel's part
alone, ``git apply --include='*g_panel.py'``, the forward as of 45cd683):

    git apply benchmarks/results/gpu_2026-12-02b/job1/variants.patch
    PYTHONPATH=. python3 benchmarks/results/gpu_2026-12-02b/job1/mosaic_mask_cost.py [--parts ...] [--variants ...]
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import infcl_jax
from benchmarks import harness
from benchmarks.probes.common import inputs, record, summary
from infcl_jax import _math
from infcl_jax.kernels.mosaic import g_panel as P
from infcl_jax.kernels.mosaic import lse_fwd as F

ap = argparse.ArgumentParser()
ap.add_argument("--b", type=int, default=65536)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--dump", action="store_true")
ap.add_argument("--parts", default="fwd,panel,loss")
ap.add_argument("--variants", default="")
args = ap.parse_args()
B, D, R = args.b, 768, 4096
x, y = inputs(B, D, jnp.bfloat16, seed=1)
shuf = jnp.asarray(np.random.default_rng(0).permutation(B) // 2, jnp.int32)
srt = jnp.arange(B, dtype=jnp.int32) // 2


def set_exp(**kw):
  for mod in (F, P):
    if hasattr(mod, "_EXP"):
      mod._EXP.clear(); mod._EXP.update(kw)


def fwd_fn(grouped):
  if grouped:
    return jax.jit(lambda x, y, g: F.lse_fwd(
        x, y, 14.3, 0.0, n=B, m=B, rows=True, cols=True, groups=(g, g)))
  return jax.jit(lambda x, y, g: F.lse_fwd(
      x, y, 14.3, 0.0, n=B, m=B, rows=True, cols=True))


# Real statistics for the panel (base 2).
set_exp()
r_nat, c_nat = fwd_fn(False)(x, y, shuf)
r2 = (r_nat * _math.LOG2E)[:R]
c2 = c_nat * _math.LOG2E
params = jnp.array([14.3 * _math.LOG2E, 0.0, 1.0 / B, 1.0 / B], jnp.float32)
xp = x[:R]


def panel_fn(grouped):
  if grouped:
    return jax.jit(lambda xp, y, g: P.g_panel(
        xp, y, r2, c2, params, rows=True, cols=True, mask=False,
        groups=(g[:R], g))[1:])
  return jax.jit(lambda xp, y, g: P.g_panel(
      xp, y, r2, c2, params, rows=True, cols=True, mask=False)[1:])


def loss_fn(grouped):
  def f(x, y, g):
    kw = dict(groups=g) if grouped else {}
    return infcl_jax.contrastive_loss(x, y, 14.3, backend="mosaic", **kw)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


# name: (exp, grouped, ids)
VARIANTS = {
    "none": ({}, False, shuf),
    "mask": ({}, True, shuf),
    "mask_late": ({"gy": "late"}, True, shuf),
    "mask_nocolrel": ({"colrel": False}, True, shuf),
    "mask_iota": ({"gy": "iota", "colrel": False}, True, shuf),
    "mask_sorted": ({}, True, srt),
    "mask_cond_sorted": ({"cond": True}, True, srt),
    "mask_cond_shuf": ({"cond": True}, True, shuf),
    "none again": ({}, False, shuf),
}


def run(part, make, names, inner):
  fns = {}
  for name in names:
    exp, grouped, g = VARIANTS[name]
    set_exp(**exp)
    f = make(grouped)
    def go(f=f, g=g):
      out = f(x if part != "panel" else xp, y, g)
      jax.block_until_ready(out)
      return out
    record(f"{part} compile {name}", lambda go=go: str(
        jax.tree.map(lambda a: float(jnp.ravel(a)[0]), go())[:1])[:60])
    fns[name] = (f, g)
  set_exp()
  times = {n: [] for n in fns}
  for _ in range(args.rounds):
    for n, (f, g) in fns.items():
      t = harness.timeit(f, x if part != "panel" else xp, y, g, reps=7,
                         inner=inner, warmup=1).median * 1e3
      times[n].append(t)
  base = statistics.median(times["none"])
  for n, ts in times.items():
    med = statistics.median(ts)
    record(f"time {part} {n}",
           lambda: f"{med:.3f} ms ({100 * (med / base - 1):+.1f}%) "
                   f"range {min(ts):.3f}-{max(ts):.3f}")


def checks():
  """Exact variants against the committed one (same ids)."""
  for name, ref in (("mask_late", "mask"), ("mask_cond_sorted", "mask_sorted"),
                    ("mask_cond_shuf", "mask")):
    outs = []
    for n in (name, ref):
      exp, grouped, g = VARIANTS[n]
      set_exp(**exp)
      outs.append(jax.device_get(fwd_fn(True)(x, y, g)))
      set_exp(**exp)
      outs.append(jax.device_get(panel_fn(True)(xp, y, g)))
    set_exp()
    d_r = float(np.max(np.abs(outs[0][0] - outs[2][0])))
    d_c = float(np.max(np.abs(outs[0][1] - outs[2][1])))
    d_p = [float(a) - float(b) for a, b in zip(outs[1], outs[3])]
    record(f"check {name} vs {ref}", lambda: f"fwd row {d_r:.2e} col {d_c:.2e} panel sums {d_p}")


parts = args.parts.split(",")
if args.variants:
  VARIANTS = {k: v for k, v in VARIANTS.items() if k in args.variants.split(",")}
if "check" in parts:
  checks()
if "fwd" in parts:
  run("fwd", fwd_fn, list(VARIANTS), inner=5)
if "panel" in parts:
  run("panel", panel_fn, list(VARIANTS), inner=20)
if "loss" in parts:
  run("loss", loss_fn, [k for k in ["none", "mask", "mask_late", "mask_nocolrel",
                        "mask_sorted", "mask_cond_sorted", "none again"] if k in VARIANTS],
      inner=2)
summary(34)
