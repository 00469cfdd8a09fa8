"""Where an odd batch loses the Mosaic forward's rate (one GPU).

The forward (both LSEs) at B = 65,536, at 50,176 (a multiple of the 256
columns of a CTA's tile pair and of the 128 rows of a row block: nothing is
masked) and at 50,000 (padded rows and columns, masked in every tile): the
same tile count for the two last, so their difference is the mask's.

Then the A/B of where the padding is masked (``lse_fwd``'s ``edge_mask``:
False = every tile, "cond" = only the tiles holding padding, "vec" = -inf
biases from 1-D vectors): ``lse_fwd`` called directly at B = 50,000 on the
inputs padded as the backend pads them, at its GPU tiles, each variant
first checked against ``edge_mask=False`` (max |difference| of the LSEs).
The A/B runs first: it is what the probe is for. Then the unchecked pass
alone (``check="rerun"``'s first kernel) at 50,000: its time, and whether it
flags a NaN (then ``lse_fwd`` pays a second, checked forward).

    PYTHONPATH=. python3 benchmarks/probes/odd_batch.py
    PYTHONPATH=. python3 benchmarks/probes/odd_batch.py --ab-only # 4 items
    PYTHONPATH=. python3 benchmarks/probes/odd_batch.py --smoke   # CPU
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.probes.common import bench, inputs, record, summary
from infcl_jax import _device
from infcl_jax.backends import mosaic as mosaic_backend
from infcl_jax.backends import registry
from infcl_jax.backends.padding import pad_inputs
from infcl_jax.kernels.mosaic import lse_fwd as mlse_fwd

SCALE = 14.3
BASE = {}   # edge_mask=False's LSEs, for the variants' check


def rate(b, d, ms):
  return f"{ms:.3f} ms, {2 * b * b * d / ms / 1e9:.0f} TFLOP/s"


def forward(b, d, reps):
  tiles = registry.get("mosaic", "softmax")
  x, y = inputs(b, d, jnp.bfloat16, seed=2)
  f = jax.jit(lambda x, y: tiles.lse(x, y, SCALE, 0.0, rows=True, cols=True))
  return rate(b, d, bench(f, x, y, reps=reps))


def _call_kw(b):
  """Padded inputs and ``lse_fwd``'s keywords as ``MosaicBackend._lse``
  passes them (its GPU tiles, one program per SM); off the GPU, the
  interpreter."""
  bs = mosaic_backend.GPU_TILES
  mb = mosaic_backend.mosaic_blocks(bs)
  kw = dict(n=b, m=b, rows=True, cols=True, block_q=mb.bq, block_k=mb.bk,
            block_d=mb.bd, num_programs=bs.num_programs or _device.num_sms(),
            interpret=jax.default_backend() != "gpu",
            single_exp=bs.single_exp)
  return mb, kw


def _padded(b, d, mb):
  x, y = inputs(b, d, jnp.bfloat16, seed=2)
  return pad_inputs(x, y, mb.bq, 2 * mb.bk, mb.bd)


def direct(b, d, edge_mask, reps):
  """``lse_fwd`` with ``edge_mask`` (see ``_call_kw``)."""
  mb, kw = _call_kw(b)
  xp, yp = _padded(b, d, mb)
  f = jax.jit(lambda a, c: mlse_fwd.lse_fwd(
      a, c, jnp.float32(SCALE), jnp.float32(0.0), edge_mask=edge_mask, **kw))
  t0 = time.perf_counter()
  r, c = jax.block_until_ready(f(xp, yp))
  first = time.perf_counter() - t0
  r, c = np.asarray(r), np.asarray(c)
  if edge_mask is False:
    BASE["lse"] = (r, c)
    check = f"finite {np.isfinite(r).all() and np.isfinite(c).all()}"
  elif "lse" not in BASE:
    check = "no edge_mask=False result to check against"
  else:
    br, bc = BASE["lse"]
    check = (f"max|d row| {np.max(np.abs(r - br)):.3g}, "
             f"max|d col| {np.max(np.abs(c - bc)):.3g}")
  ms = bench(f, xp, yp, reps=reps)
  return f"{rate(b, d, ms)}; {check}; first call {first:.1f} s"


def first_pass(b, d, reps):
  """The unchecked pass alone (``edge_mask=False``): its time, and whether
  it flags NaN, which would make ``lse_fwd`` run the checked one too (a
  second forward)."""
  mb, kw = _call_kw(b)
  xp, yp = _padded(b, d, mb)
  f = jax.jit(lambda a, c: mlse_fwd._lse_fwd_once(  # pylint: disable=protected-access
      a, c, jnp.float32(SCALE), jnp.float32(0.0), num_stages=3,
      check="rerun", groups=None, **kw))
  r, c = (np.asarray(v) for v in f(xp, yp))
  nans = f"NaN rows {np.isnan(r).sum()}, NaN cols {np.isnan(c).sum()}"
  return f"{rate(b, d, bench(f, xp, yp, reps=reps))}; {nans}"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true",
                  help="tiny sizes (a CPU run of every item)")
  ap.add_argument("--ab-only", action="store_true",
                  help="only the edge_mask A/B and the unchecked pass")
  args = ap.parse_args()
  if args.smoke:
    d, reps, odd, sizes = 64, 1, 300, (512, 256, 300)
  else:
    d, reps, odd, sizes = 768, 7, 50000, (65536, 50176, 50000)
  print("jax", jax.__version__, jax.devices(), flush=True)
  for em in mlse_fwd.EDGE_MASKS:
    record(f"lse_fwd B={odd} edge_mask={em!r}",
           lambda em=em: direct(odd, d, em, reps))
  record(f"unchecked pass B={odd}", lambda: first_pass(odd, d, reps))
  for b in () if args.ab_only else sizes:
    record(f"mosaic forward B={b}", lambda b=b: forward(b, d, reps))
  summary(36)


if __name__ == "__main__":
  main()
