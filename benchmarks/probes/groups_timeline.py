"""Where a grouped step's extra time goes between kernels: the device
timeline of fwd+bwd steps without groups and with them.

Per variant, after a warm-up, ``jax.profiler`` traces a few steps (XLA's
command buffers off, so that the trace names each kernel) and prints: the
wall time per step, the device's busy time (the union of its kernels'
intervals) and idle time inside the step, the largest idle gaps with the
kernels on either side, and the kernels' time by op.

    PYTHONPATH=. python3 benchmarks/probes/groups_timeline.py \\
        [--b 65536] [--family softmax] [--backend mosaic] [--modes none,mask]
        [--hlo 8]

``--hlo N`` also prints the compiled HLO instruction of each of the N
costliest ops and of the ops beside the largest gaps (what an XLA fusion
named in the trace does).
"""
from __future__ import annotations

import argparse
import collections
import os
import tempfile

from benchmarks import harness


def timeline(events, steps, top=8):
  """Busy and idle time of the traced span per step, the ``top`` largest
  gaps (us, op before, op after), and the kernels' ms per step by op."""
  busy, gaps = 0.0, []
  end, last_op = None, None
  for t0, t1, op in events:
    if end is not None and t0 > end:
      gaps.append((t0 - end, last_op, op))
    if end is None or t1 > end:
      busy += t1 - max(t0, end if end is not None else t0)
      end, last_op = t1, op
  span = events[-1][1] - events[0][0] if events else 0.0
  by_op = collections.defaultdict(float)
  for t0, t1, op in events:
    by_op[op] += (t1 - t0) / 1e3 / steps
  return dict(span_ms=span / 1e3 / steps, busy_ms=busy / 1e3 / steps,
              idle_ms=(span - busy) / 1e3 / steps,
              gaps=sorted(gaps, reverse=True)[:top],
              by_op=sorted(by_op.items(), key=lambda kv: -kv[1]))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--b", type=int, default=65536)
  p.add_argument("--family", default="softmax")
  p.add_argument("--backend", default="mosaic")
  p.add_argument("--modes", default="none,mask")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--hlo", type=int, default=0)
  a = p.parse_args()
  # Read when the backend starts (the imports below), not at import.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_enable_command_buffer=")
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks import bench_groups  # pylint: disable=import-outside-toplevel
  from benchmarks.probes.common import inputs  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  x, y = inputs(a.b, 768, jnp.bfloat16, seed=1)
  g = bench_groups.pairs(a.b)
  for mode in a.modes.split(","):
    group_mode, _ = bench_groups.variant(mode)
    fn = bench_groups.loss_fn(a.family, a.backend, group_mode).lower(
        x, y, g).compile()
    wall = harness.timeit(fn, x, y, g, reps=5).median * 1e3
    jax.block_until_ready(fn(x, y, g))
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        for _ in range(a.steps):
          jax.block_until_ready(fn(x, y, g))
      t = timeline(harness.traced_kernels(d), a.steps)
    print(f"== {a.family} {a.backend} {mode}: wall {wall:.3f} ms/step; "
          f"traced span {t['span_ms']:.3f}, device busy {t['busy_ms']:.3f}, "
          f"idle {t['idle_ms']:.3f} ms/step", flush=True)
    for us, before, after in t["gaps"]:
      print(f"   gap {us:9.1f} us  after {before[:50]}  before {after[:50]}")
    for op, ms in t["by_op"][:12]:
      print(f"   {op[:60]:60s} {ms:8.3f} ms")
    if a.hlo:
      text = fn.as_text()
      ops = [op for op, _ in t["by_op"][:a.hlo]]
      ops += [op for _, b, e in t["gaps"] for op in (b, e) if op not in ops]
      for op in dict.fromkeys(ops):
        for line in instructions(text, op):
          print(f"   hlo {line[:400]}")


def instructions(text, op):
  """The lines of HLO ``text`` that define instruction ``op``, and the
  root of the computation it calls (a fusion's body)."""
  lines = text.splitlines()
  found = [ln.strip() for ln in lines
           if ln.strip().startswith((f"%{op} = ", f"{op} = "))]
  for ln in list(found):
    if "calls=" in ln:
      called = ln.split("calls=")[1].split(",")[0].split(" ")[0].lstrip("%")
      body, inside = [], False
      for l2 in lines:
        if l2.startswith((f"%{called} ", f"{called} ")):
          inside = True
        elif inside and l2.startswith("}"):
          break
        elif inside:
          body.append(l2.strip())
      found += [b for b in body if "ROOT" in b or "gather" in b or
                "sort" in b or "scatter" in b][:6]
  return found


if __name__ == "__main__":
  main()
