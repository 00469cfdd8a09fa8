"""Benchmark of the exact contrastive losses: time and memory vs batch size.

  python benchmarks/bench_loss.py --out OUT [--loss softmax,sigmoid] [--resume]

Per (loss, backend, dtype, B) case one fwd+bwd step (``harness.loss_step``)
at D = 768 in a fresh process, so the peak counter starts from zero: the
median time after compilation and a warm-up; the peak device memory beyond
the inputs (an upper bound: scratch left by GEMM autotuning counts); the
TFLOP/s at 8 * B^2 * D flops a step and its fraction of the bf16 matmul
ceiling measured in the same run. Writes bench_loss.csv / .jsonl (what
--resume reads back) and bench_loss_meta.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position

FIELDS = ["loss", "backend", "dtype", "B", "D", "status", "ms", "reps",
          "peak_extra_gb", "tflops", "frac_ceiling", "wall_s"]


def run_case(loss, backend, dtype_name, b, d, budget_s):
  """One case in this (fresh) process; returns its result fields."""
  x, y = harness.host_inputs(b, d, dtype_name)
  step, scalars = harness.loss_step(loss, backend)
  args = (x, y, *scalars)
  try:
    compiled = step.lower(*args).compile()
    base = (harness.device_bytes("bytes_in_use") or [0])[0]
    # Two warm-up calls: the first can still compile (jax-triton builds its
    # kernels at the first call), and the reps are sized from the second.
    t = harness.timeit(compiled, *args, reps=7, warmup=2, budget_s=budget_s)
  except Exception as e:  # pylint: disable=broad-except
    return dict(status=harness.failure(e))
  peak = (harness.device_bytes("peak_bytes_in_use") or [0])[0]
  return dict(status="ok", ms=t.median * 1e3, reps=t.reps,
              peak_extra_gb=(peak - base) / 1e9,
              tflops=8.0 * b * b * d / t.median / 1e12)


def run_ceiling():
  """bf16 matmul ceiling: a chain of 16384^3 products inside one jit."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  # 16384^3 (8.8 TFLOP) per product on a GPU; small elsewhere (CI smoke).
  n, chain = (16384, 8) if jax.default_backend() == "gpu" else (512, 2)
  k1, k2 = jax.random.split(jax.random.key(1))
  a = jax.random.normal(k1, (n, n), jnp.bfloat16)
  c = (jax.random.normal(k2, (n, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
  f = jax.jit(lambda a, c: jax.lax.fori_loop(
      0, chain, lambda i, a: jnp.dot(a, c), a))
  t = harness.timeit(f, a, c, reps=7, warmup=1, budget_s=10.0)
  return dict(harness.device_meta(), status="ok", reps=t.reps,
              tflops=2.0 * n**3 * chain / t.median / 1e12)


def _spawn(argv, timeout_s):
  return harness.run_child(
      [os.path.abspath(__file__), *argv], timeout_s=timeout_s,
      env=harness.child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"))


# The xla backend above this B takes minutes a step: not tried.
XLA_MAX_B = 262144


def _skip(backend, b):
  # The reference materialises (B, B) float32 logits, their exp and grads:
  # ~4 such buffers; a case that cannot fit 139 GiB is not tried.
  if backend == "reference" and 4 * 4 * b * b >= 130e9:
    return "skipped (B^2 logits do not fit)"
  if backend == "xla" and b > XLA_MAX_B:
    return f"skipped (B > {XLA_MAX_B} on xla)"
  return None


def main():
  ap = harness.parser(__doc__, out=None, resume=True, budget_s=6.0,
                      timeout_s=400)
  ap.add_argument("--loss", default="softmax",
                  help="comma list of: softmax, sigmoid")
  ap.add_argument("--backends", default="reference,xla,pallas")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--batches", default="16384,65536,262144,1048576")
  ap.add_argument("--d", type=int, default=768)
  args = ap.parse_args()
  if args.case == "ceiling":
    harness.print_result(run_ceiling())
    return
  if args.case:
    loss, backend, dt, b = args.case.split(",")
    harness.print_result(
        run_case(loss, backend, dt, int(b), args.d, args.budget_s))
    return

  # A resumed run keeps the earlier finished cases and retries the ones that
  # timed out, crashed or errored.
  rows = harness.Rows(
      args.out, "bench_loss", fields=FIELDS, resume=args.resume,
      key=lambda r: (r["loss"], r["backend"], r["dtype"], r["B"], r["D"]),
      keep=lambda s: not s.startswith(("timeout", "crash", "error")))
  meta_path = os.path.join(args.out, "bench_loss_meta.json")
  earlier = {}
  if args.resume and os.path.exists(meta_path):
    with open(meta_path) as fh:
      earlier = json.load(fh)
  ceiling = earlier.get("ceiling") or {}
  if ceiling.get("status") != "ok":
    ceiling = _spawn(["--case", "ceiling"], args.timeout_s)
  print(f"bf16 matmul ceiling: {ceiling}", flush=True)
  peak = ceiling.get("tflops") if ceiling.get("status") == "ok" else None
  meta = dict(date=harness.now(), command=" ".join(sys.argv), ceiling=ceiling)
  if earlier:
    meta["resumed_from"] = {k: earlier.get(k) for k in
                            ("date", "command", "resumed_from")}
  with open(meta_path, "w") as fh:
    json.dump(meta, fh, indent=1)

  for loss in args.loss.split(","):
    for dt in args.dtypes.split(","):
      for backend in args.backends.split(","):
        for b in (int(v) for v in args.batches.split(",")):
          base = dict(loss=loss, backend=backend, dtype=dt, B=b, D=args.d)
          if rows.earlier(base):
            continue
          skip = _skip(backend, b)
          if skip:
            rows.add(dict(base, status=skip))
            continue
          t0 = time.time()
          r = dict(base, **_spawn(
              ["--case", f"{loss},{backend},{dt},{b}", "--d", str(args.d),
               "--budget-s", str(args.budget_s)], args.timeout_s))
          r["wall_s"] = round(time.time() - t0, 1)
          if r.get("status") == "ok" and peak:
            r["frac_ceiling"] = r["tflops"] / peak
          rows.add(r)

  print(f"\n{meta['date']}  {ceiling.get('device_kind')}  jax "
        f"{ceiling.get('jax')}  bf16 matmul ceiling {peak and round(peak)} "
        f"TFLOP/s  D={args.d}")
  print(f"{'loss':8s} {'backend':9s} {'dtype':9s} {'B':>8s} {'ms':>10s} "
        f"{'GB extra':>9s} {'TFLOP/s':>8s} {'of peak':>8s}")
  for r in rows.rows + list(rows.done.values()):
    head = f"{r['loss']:8s} {r['backend']:9s} {r['dtype']:9s} {r['B']:8d} "
    if r.get("status") == "ok":
      print(head + f"{r['ms']:10.1f} {r['peak_extra_gb']:9.2f} "
            f"{r['tflops']:8.0f} {r.get('frac_ceiling', 0):8.0%}")
    else:
      print(head + f"  {r['status'][:60]}")


if __name__ == "__main__":
  main()
