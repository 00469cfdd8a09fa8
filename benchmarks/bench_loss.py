"""Benchmark of the exact contrastive losses: time and memory vs batch size.

One command, one GPU run:

  python benchmarks/bench_loss.py --out benchmarks/results

For every (loss, backend, dtype, B) case it measures one fwd+bwd step (loss
value and the gradients of both embeddings, the scale and the bias) at
D=768, each case in a fresh subprocess so that the device's peak-memory
counter starts from zero:

* median wall time of the device-synchronized step after compilation and a
  warm-up run (fewer repetitions for steps longer than a few seconds; the
  CSV says how many);
* peak device memory beyond the inputs (``peak_bytes_in_use`` minus the
  bytes in use once the inputs exist; gradients and workspaces count, and so
  would any scratch that compilation's GEMM autotuning left as the peak, so
  it is an upper bound);
* effective TFLOP/s, counting 8 * B^2 * D flops per step (forward logits,
  backward recompute, dx and dy), and that rate as a fraction of the bf16
  matmul ceiling measured in the same run.

A case that runs out of memory is recorded as "oom". It writes
``bench_loss.csv`` and ``bench_loss_meta.json`` into --out and prints a
short table last. ``--loss softmax,sigmoid`` adds
the SigLIP loss (``infcl_jax.sigmoid_loss``) where it exists.

The CSV is rewritten after every case and ``--resume`` keeps the finished
cases of an earlier run in --out, so a sweep longer than one command's time
limit (the full softmax sweep took ~7.5 min on an H200; softmax + sigmoid
about twice that) can be split:

  python benchmarks/bench_loss.py --out R --loss softmax
  python benchmarks/bench_loss.py --out R --loss softmax,sigmoid --resume
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position

D_DEFAULT = 768
RESULT_TAG = "BENCH_RESULT "


# ----------------------------------------------------------------- children

def _median_time(fn, args, budget_s):
  """(median seconds, repetitions) of fn(*args) after one warm-up call."""
  t = harness.timeit(fn, *args, reps=7, warmup=1, budget_s=budget_s)
  return t.median, t.reps


def run_case(loss, backend, dtype_name, b, d, budget_s):
  """One case in this (fresh) process; returns a result dict."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import infcl_jax  # pylint: disable=import-outside-toplevel

  dtype = jnp.dtype(dtype_name)
  res = dict(loss=loss, backend=backend, dtype=dtype_name, B=b, D=d)
  dev = jax.devices()[0]
  rng = np.random.default_rng(0)

  def make():
    # Built on the host, so that no device temporaries raise the peak.
    v = rng.standard_normal((b, d), dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return jax.block_until_ready(jax.device_put(v.astype(dtype)))

  x, y = make(), make()
  if loss == "softmax":
    t, bias = jnp.float32(20.0), jnp.float32(0.0)
    def f(x, y, t, bias):
      return infcl_jax.contrastive_loss(x, y, t, logit_bias=bias,
                                        backend=backend)
  else:
    if not hasattr(infcl_jax, "sigmoid_loss"):
      return dict(res, status="unavailable")
    t, bias = jnp.float32(10.0), jnp.float32(-10.0)
    def f(x, y, t, bias):
      return infcl_jax.sigmoid_loss(x, y, t, bias, backend=backend)
  step = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))
  args = (x, y, t, bias)
  try:
    compiled = step.lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except
    return dict(res, status=harness.failure(e))
  stats = dev.memory_stats() or {}
  base = stats.get("bytes_in_use", 0)
  try:
    sec, reps = _median_time(compiled, args, budget_s)
  except Exception as e:  # pylint: disable=broad-except
    return dict(res, status=harness.failure(e))
  stats = dev.memory_stats() or {}
  peak = stats.get("peak_bytes_in_use", 0)
  res.update(status="ok", ms=sec * 1e3, reps=reps,
             peak_extra_gb=(peak - base) / 1e9,
             tflops=8.0 * b * b * d / sec / 1e12)
  return res


def run_ceiling():
  """bf16 matmul ceiling: a chain of 16384^3 products inside one jit."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  # 16384^3 (8.8 TFLOP) per product on a GPU; small elsewhere (CI smoke).
  n, chain = (16384, 8) if jax.default_backend() == "gpu" else (512, 2)
  k1, k2 = jax.random.split(jax.random.key(1))
  a = jax.random.normal(k1, (n, n), jnp.bfloat16)
  c = (jax.random.normal(k2, (n, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)

  @jax.jit
  def f(a, c):
    return lax.fori_loop(0, chain, lambda i, a: jnp.dot(a, c), a)

  sec, reps = _median_time(f, (a, c), 10.0)
  return dict(status="ok", tflops=2.0 * n**3 * chain / sec / 1e12, reps=reps,
              device=jax.devices()[0].device_kind, jax=jax.__version__)


# ------------------------------------------------------------------- parent

def _spawn(argv, timeout_s):
  return harness.run_child(
      [os.path.abspath(__file__), *argv], result_tag=RESULT_TAG,
      timeout_s=timeout_s,
      env=harness.child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"))


FIELDS = ["loss", "backend", "dtype", "B", "D", "status", "ms", "reps",
          "peak_extra_gb", "tflops", "frac_ceiling", "wall_s"]


def _key(r):
  return (r["loss"], r["backend"], r["dtype"], int(r["B"]), int(r["D"]))


def _write_csv(path, rows):
  with open(path, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v)
                  for k, v in r.items()})


def _read_csv(path):
  rows = []
  with open(path, newline="") as fh:
    for r in csv.DictReader(fh):
      out = {}
      for k, v in r.items():
        if v in ("", None):
          continue
        out[k] = int(v) if k in ("B", "D", "reps") else (
            float(v) if k in ("ms", "peak_extra_gb", "tflops", "frac_ceiling",
                              "wall_s") else v)
      rows.append(out)
  return rows


def _fits_reference(b, dtype):
  # The reference materialises (B, B) float32 logits, their exp and grads:
  # ~4 such buffers. Skip cases that cannot fit 139 GiB instead of
  # spending minutes to find out; the CSV records them as "skipped".
  return 4 * 4 * b * b < 130e9


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="benchmarks/results")
  ap.add_argument("--loss", default="softmax",
                  help="comma list of: softmax, sigmoid")
  ap.add_argument("--backends", default="reference,xla,pallas")
  ap.add_argument("--dtypes", default="bfloat16,float32")
  ap.add_argument("--batches", default="16384,65536,262144,1048576")
  ap.add_argument("--d", type=int, default=D_DEFAULT)
  ap.add_argument("--xla-max-b", type=int, default=262144,
                  help="largest B for the xla backend (1M takes minutes)")
  ap.add_argument("--budget-s", type=float, default=6.0,
                  help="time to spend on repetitions per case")
  ap.add_argument("--timeout-s", type=int, default=400)
  ap.add_argument("--quick", action="store_true",
                  help="B in {16k, 64k}, bf16 only")
  ap.add_argument("--resume", action="store_true",
                  help="keep the finished cases of --out/bench_loss.csv "
                  "(the CSV is rewritten after every case), run the rest")
  ap.add_argument("--case", help=argparse.SUPPRESS)
  ap.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()

  if args.ceiling:
    print(RESULT_TAG + json.dumps(run_ceiling()), flush=True)
    return
  if args.case:
    loss, backend, dt, b = args.case.split(",")
    print(RESULT_TAG + json.dumps(
        run_case(loss, backend, dt, int(b), args.d, args.budget_s)), flush=True)
    return

  if args.quick:
    args.batches, args.dtypes = "16384,65536", "bfloat16"
  losses = args.loss.split(",")
  backends = args.backends.split(",")
  dtypes = args.dtypes.split(",")
  batches = [int(v) for v in args.batches.split(",")]
  os.makedirs(args.out, exist_ok=True)

  csv_path = os.path.join(args.out, "bench_loss.csv")
  meta_path = os.path.join(args.out, "bench_loss_meta.json")
  done, ceiling, earlier = {}, None, None
  if args.resume and os.path.exists(csv_path):
    # Keep finished cases of an earlier (e.g. time-limited) run; retry the
    # ones that timed out, crashed or errored.
    for r in _read_csv(csv_path):
      if not r["status"].startswith(("timeout", "crash", "error")):
        done[_key(r)] = r
    if os.path.exists(meta_path):
      with open(meta_path) as fh:
        earlier = json.load(fh)
      ceiling = earlier.get("ceiling")
  if not ceiling or ceiling.get("status") != "ok":
    ceiling = _spawn(["--ceiling"], args.timeout_s)
  print(f"bf16 matmul ceiling: {ceiling}", flush=True)
  peak = ceiling.get("tflops") if ceiling.get("status") == "ok" else None
  meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), command=" ".join(sys.argv), ceiling=ceiling)
  if args.resume and earlier:
    meta["resumed_from"] = {k: earlier.get(k) for k in
                            ("date", "command", "resumed_from")}
  with open(meta_path, "w") as fh:
    json.dump(meta, fh, indent=1)

  rows = []
  for loss in losses:
    for dt in dtypes:
      for backend in backends:
        for b in batches:
          base = dict(loss=loss, backend=backend, dtype=dt, B=b, D=args.d)
          if _key(base) in done:
            r = done.pop(_key(base))
          elif backend == "reference" and not _fits_reference(b, dt):
            r = dict(base, status="skipped (B^2 logits do not fit)")
          elif backend == "xla" and b > args.xla_max_b:
            r = dict(base, status=f"skipped (B > --xla-max-b {args.xla_max_b})")
          else:
            t0 = time.time()
            r = dict(base, **_spawn(
                ["--case", f"{loss},{backend},{dt},{b}", "--d", str(args.d),
                 "--budget-s", str(args.budget_s)], args.timeout_s))
            r["wall_s"] = round(time.time() - t0, 1)
            if r.get("status") == "ok" and peak:
              r["frac_ceiling"] = r["tflops"] / peak
          rows.append(r)
          print(json.dumps(r), flush=True)
          # Written after every case: a run cut short keeps what it measured.
          _write_csv(csv_path, rows + list(done.values()))
  rows += list(done.values())  # Earlier cases outside this selection.


  print(f"\n{meta['date']}  {ceiling.get('device')}  jax {ceiling.get('jax')}"
        f"  bf16 matmul ceiling {peak and round(peak)} TFLOP/s  D={args.d}")
  print(f"{'loss':8s} {'backend':9s} {'dtype':9s} {'B':>8s} {'ms':>10s} "
        f"{'GB extra':>9s} {'TFLOP/s':>8s} {'of peak':>8s}")
  for r in rows:
    if r.get("status") == "ok":
      print(f"{r['loss']:8s} {r['backend']:9s} {r['dtype']:9s} {r['B']:8d} "
            f"{r['ms']:10.1f} {r['peak_extra_gb']:9.2f} {r['tflops']:8.0f} "
            f"{r.get('frac_ceiling', 0):8.0%}")
    else:
      print(f"{r['loss']:8s} {r['backend']:9s} {r['dtype']:9s} {r['B']:8d} "
            f"  {r['status'][:60]}")


if __name__ == "__main__":
  main()
