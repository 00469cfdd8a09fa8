"""A/B speed check of the loss: this checkout against a reference tree, in
one job on one GPU.

  python benchmarks/bench_ab.py --ref-tree DIR [--cases C1,C2,...]
      [--rounds 2] [--calls 5] [--slower 0.03] [--out OUT]

A case is LOSS:DTYPE:B (D = 768, backend "auto", fwd+bwd as
``harness.loss_step``). Two worker processes, A importing ``infcl_jax``
from this checkout and B from ``DIR`` (a tree holding the reference
commit's ``infcl_jax/``), each compile every case once and keep it; then,
per case, the driver asks A, B, A, B (``--rounds`` times each) for
``--calls`` timed calls after a warm-up, and compares the medians of all
of each side's calls. A case more than ``--slower`` (3%) slower on A than
on B is marked SLOWER and the exit code is 1. Interleaving keeps the
card's drift (clocks, temperature) out of the difference; stored figures
from another card or day never enter it.

Writes bench_ab.json (every call's time, the medians, the device, both
trees) to --out, and prints one table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Appended, not prepended: a worker's infcl_jax must come from its tree
# (first on its PYTHONPATH), only ``benchmarks`` from here.
sys.path.append(ROOT)

DEFAULT_CASES = ("softmax:bfloat16:65536,sigmoid:bfloat16:65536,"
                 "softmax:float32:65536,sigmoid:float32:65536")
D = 768


def parse_case(text):
  loss, dtype, b = text.split(":")
  if loss not in ("softmax", "sigmoid"):
    raise ValueError(f"case {text!r}: loss must be softmax or sigmoid")
  if dtype not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"case {text!r}: dtype must be bfloat16, float16 or "
                     "float32")
  return loss, dtype, int(b)


# ------------------------------------------------------------------ worker


def worker(calls):
  """Reads case lines from stdin; answers each with one JSON line of the
  seconds of ``calls`` timed calls (compiling and warming up a case the
  first time it is asked)."""
  import jax  # pylint: disable=import-outside-toplevel
  import infcl_jax  # pylint: disable=import-outside-toplevel
  from benchmarks import harness  # pylint: disable=import-outside-toplevel
  compiled = {}
  print(json.dumps({"ready": True, "infcl_jax": os.path.dirname(
      infcl_jax.__file__), "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__}), flush=True)
  for line in sys.stdin:
    case = line.strip()
    if not case:
      continue
    try:
      if case not in compiled:
        loss, dtype, b = parse_case(case)
        x, y = harness.host_inputs(b, D, dtype)
        step, scalars = harness.loss_step(loss, "auto")
        args = (x, y, *scalars)
        fn = step.lower(*args).compile()
        for _ in range(2):
          jax.block_until_ready(fn(*args))
        compiled[case] = (fn, args)
      fn, args = compiled[case]
      times = []
      for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
      print(json.dumps({"case": case, "s": times}), flush=True)
    except Exception as e:  # pylint: disable=broad-except
      print(json.dumps({"case": case, "error": f"{type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300]}"}), flush=True)


# ------------------------------------------------------------------ driver


class Side:
  """A worker process importing ``infcl_jax`` from ``tree``."""

  def __init__(self, name, tree, calls):
    self.name, self.tree = name, tree
    env = dict(os.environ)
    # The tree's infcl_jax first; this checkout's benchmarks package after.
    env["PYTHONPATH"] = os.pathsep.join(
        [tree, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker",
         "--calls", str(calls)], cwd=tree, env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, bufsize=1)
    self.meta = self._read()

  def _read(self):
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"worker {self.name} ({self.tree}) exited with "
                         f"{self.proc.wait()}")
    return json.loads(line)

  def ask(self, case):
    self.proc.stdin.write(case + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self):
    if self.proc.stdin:
      self.proc.stdin.close()
    try:
      self.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      self.proc.kill()


def compare(a_times, b_times, slower):
  a, b = statistics.median(a_times), statistics.median(b_times)
  delta = (a - b) / b
  return a, b, delta, ("SLOWER" if delta > slower else "ok")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--ref-tree", help="the reference tree (its infcl_jax/)")
  ap.add_argument("--ref-name", default="", help="what B is (a commit), for "
                  "the table")
  ap.add_argument("--cases", default=DEFAULT_CASES)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--slower", type=float, default=0.03)
  ap.add_argument("--out", default="")
  ap.add_argument("--worker", action="store_true")
  args = ap.parse_args(argv)
  if args.worker:
    worker(args.calls)
    return 0
  if not args.ref_tree or not os.path.isdir(
      os.path.join(args.ref_tree, "infcl_jax")):
    ap.error(f"--ref-tree {args.ref_tree!r} holds no infcl_jax/")
  cases = [c for c in args.cases.split(",") if c]
  for c in cases:
    parse_case(c)
  sides = [Side("A", ROOT, args.calls),
           Side("B", os.path.abspath(args.ref_tree), args.calls)]
  result = {"A": sides[0].meta, "B": dict(sides[1].meta, ref=args.ref_name),
            "cases": {}, "rounds": args.rounds, "calls": args.calls,
            "slower": args.slower}
  print(f"A: {sides[0].meta['infcl_jax']}  B: {sides[1].meta['infcl_jax']} "
        f"({args.ref_name}); {sides[0].meta['device']}, jax "
        f"{sides[0].meta['jax']}", flush=True)
  rows, failed = [], False
  try:
    for case in cases:
      times = {"A": [], "B": []}
      error = None
      for _ in range(args.rounds):
        for side in sides:
          answer = side.ask(case)
          if "error" in answer:
            error = f"{side.name}: {answer['error']}"
            break
          times[side.name] += answer["s"]
        if error:
          break
      if error:
        rows.append((case, "-", "-", "-", f"ERROR {error}"))
        result["cases"][case] = {"error": error}
        failed = True
        continue
      a, b, delta, verdict = compare(times["A"], times["B"], args.slower)
      failed |= verdict != "ok"
      result["cases"][case] = dict(times, a_ms=a * 1e3, b_ms=b * 1e3,
                                   delta=delta, verdict=verdict)
      rows.append((case, f"{a * 1e3:.2f}", f"{b * 1e3:.2f}",
                   f"{delta * 100:+.1f}%", verdict))
      print(f"  {case}: A {a * 1e3:.2f} ms, B {b * 1e3:.2f} ms, "
            f"{delta * 100:+.1f}% {verdict}", flush=True)
  finally:
    for side in sides:
      side.close()
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_ab.json"), "w") as f:
      json.dump(result, f, indent=1)
  print(f"\nA/B, median of {args.rounds} x {args.calls} calls a side, "
        f"interleaved A B A B; > {args.slower:.0%} slower is marked")
  print(f"{'case':28s} {'A ms':>9s} {'B ms':>9s} {'A vs B':>8s}  verdict")
  for r in rows:
    print(f"{r[0]:28s} {r[1]:>9s} {r[2]:>9s} {r[3]:>8s}  {r[4]}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
