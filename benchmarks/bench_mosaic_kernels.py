"""Times the Mosaic GPU kernels (and, where importable, the Triton ones).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mosaic_kernels.py --b 65536 --d 768

Variants (keyword arguments of the kernels, see
``docs/mosaic_notes.md``), one process, ~2-3 minutes:

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mosaic_kernels.py \
        --variants all --out "$OUT"

For each variant: a correctness check at B = --check_b (4096), D = --d
against float64 (forward: row and column LSE rel. error < 1e-5; panel: G
rel. error < 1e-2 and its scalar sums), PASS / FAIL; then the time of the
stage at B = --b beside the default's, timed in the same run (the default
is timed first and again last, to show drift). A variant that fails to
compile, raises, or fails the check is reported and skipped. Results go to
``--out``/mosaic_variants.json (rewritten after every variant) and
``--out``/mosaic_variants.log (this output).
A watchdog ends the run (results kept) if one variant takes longer than
--variant_timeout seconds (a hung kernel); variants stop being started once
--budget_s is spent.

Each kernel is compiled, run twice as warm-up, then timed as the median of
``--reps`` runs, each a sync'd wall-clock measurement of ``--inner``
back-to-back calls (inputs are far larger than L2). TFLOP/s counts the
logit matmul only: 2 * rows * cols * D.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback

T0 = time.monotonic()   # the time budget counts from the process start

import jax
import jax.numpy as jnp
import numpy as np

from infcl_jax._math import LOG2E
from infcl_jax.kernels.mosaic import g_panel as mg
from infcl_jax.kernels.mosaic import lse_fwd as mf


def timeit(fn, *args, reps=7, inner=5):
  out = fn(*args)
  jax.block_until_ready(out)
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / inner)
  return statistics.median(ts), min(ts), max(ts)


def report(name, flops, t):
  med, lo, hi = t
  print(f"{name:44s} {med * 1e3:8.3f} ms  [{lo * 1e3:.3f}-{hi * 1e3:.3f}]  "
        f"{flops / med / 1e12:7.1f} TFLOP/s", flush=True)


# name -> (stage, kwargs), run in this order (the budget may cut the tail):
# the defaults, the combinations expected to win, then single changes.
# private_scratch (consumer loop emitted twice) and rings="split" (producer
# warps) change the thread structure: a hang there is caught by the
# watchdog, which saves the results and ends the run.
FWD_BASE = dict(num_stages=4)
PANEL_BASE = dict(num_stages=3)
INTERPRET = {}   # --interpret 1: {"interpret": True} (a CPU dry run)
_ALL = dict(check="rerun", col_merge="rmw2", private_scratch=True,
            reduction_scratch_bytes=16384)
_RINGS = dict(rings="split", num_stages=3)
_PRINGS = dict(rings="split", num_stages=3, epilogue_split=2,
               reduction_scratch_bytes=0, pingpong=True)
VARIANTS = {
    "fwd_default": ("fwd", dict()),
    "panel_default": ("panel", dict()),
    # The combinations expected to win, first.
    "fwd_rerun_rmw2_rsb16k": ("fwd", dict(check="rerun", col_merge="rmw2",
                                          reduction_scratch_bytes=16384)),
    "panel_fused_split2_st4": ("panel", dict(single_exp=True,
                                             epilogue_split=2, num_stages=4,
                                             reduction_scratch_bytes=0)),
    "fwd_all": ("fwd", dict(_ALL, pingpong=False)),
    "panel_rings_pp_fused": ("panel", dict(_PRINGS, single_exp=True)),
    "fwd_split_all": ("fwd", dict(_RINGS, **_ALL, pingpong=True)),
    "fwd_split_all_nopp": ("fwd", dict(_RINGS, **_ALL, pingpong=False)),
    "fwd_all_pp": ("fwd", dict(_ALL, pingpong=True)),
    # Single changes, to attribute the gains.
    "panel_fused": ("panel", dict(single_exp=True)),
    "panel_split2_st4": ("panel", dict(epilogue_split=2, num_stages=4,
                                       reduction_scratch_bytes=0)),
    "fwd_split": ("fwd", dict(_RINGS)),
    "fwd_split_rerun_rmw2_rsb16k": ("fwd", dict(
        _RINGS, check="rerun", col_merge="rmw2",
        reduction_scratch_bytes=16384)),
    "fwd_rsb16k": ("fwd", dict(reduction_scratch_bytes=16384)),
    "fwd_rmw2": ("fwd", dict(col_merge="rmw2")),
    "fwd_rerun": ("fwd", dict(check="rerun")),
    "fwd_deferred": ("fwd", dict(col_merge="deferred")),
    "fwd_all_deferred": ("fwd", dict(_ALL, col_merge="deferred",
                                     pingpong=False)),
    "fwd_private_nopp": ("fwd", dict(private_scratch=True, pingpong=False)),
    "fwd_private_nopp_rsb16k": ("fwd", dict(private_scratch=True,
                                            pingpong=False,
                                            reduction_scratch_bytes=16384)),
    "panel_split2": ("panel", dict(epilogue_split=2)),
    "panel_rings_pp": ("panel", dict(_PRINGS)),
    "panel_rings_st2_pp_fused": ("panel", dict(rings="split", num_stages=2,
                                               pingpong=True,
                                               single_exp=True)),
}


def _lse64(a, axis):
  mx = a.max(axis=axis, keepdims=True)
  return (mx + np.log(np.exp(a - mx).sum(axis=axis, keepdims=True))
          ).squeeze(axis)


def _rel(out, ref):
  out = np.asarray(out, np.float64)
  if not np.all(np.isfinite(out)):
    return float("inf")
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


class _Tee:
  """stdout that also appends to a log file (flushed per write)."""

  def __init__(self, stream, path):
    self.stream, self.file = stream, open(path, "a", encoding="utf-8")

  def write(self, text):
    self.stream.write(text)
    self.file.write(text)
    self.file.flush()

  def flush(self):
    self.stream.flush()
    self.file.flush()


class _Watchdog:
  """Ends the process (after saving) if one variant runs too long."""

  def __init__(self, timeout, on_fire):
    self.timeout, self.on_fire = timeout, on_fire
    self.deadline, self.name = None, None
    t = threading.Thread(target=self._run, daemon=True)
    t.start()

  def arm(self, name):
    self.name, self.deadline = name, time.monotonic() + self.timeout

  def disarm(self):
    self.deadline = None

  def _run(self):
    while True:
      time.sleep(1.0)
      d = self.deadline
      if d is not None and time.monotonic() > d:
        self.on_fire(self.name)
        os._exit(3)


def run_variants(args):
  t_start = T0
  names = []
  for v in args.variants.split(","):
    v = v.strip()
    if v in ("all", "fwd", "panel"):
      names += [k for k, (st, _) in VARIANTS.items()
                if v == "all" or st == v]
    elif v in VARIANTS:
      names.append(v)
    elif v.split(":")[0] in ("fwd", "panel") and ":" in v:
      # Ad hoc: fwd:key=value+key=value (values as Python literals).
      stage, spec = v.split(":", 1)
      kw = {}
      for item in filter(None, spec.split("+")):
        k, _, val = item.partition("=")
        try:
          kw[k] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
          kw[k] = val
      VARIANTS[v] = (stage, kw)
      names.append(v)
    elif v:
      print(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}",
            flush=True)
  # The defaults first (the reference times), each name once.
  for d in ("panel_default", "fwd_default"):
    if any(VARIANTS[k][0] == VARIANTS[d][0] for k in names):
      names = [d] + [k for k in names if k != d]
  names = list(dict.fromkeys(names))
  os.makedirs(args.out, exist_ok=True)
  json_path = os.path.join(args.out, "mosaic_variants.json")
  sys.stdout = _Tee(sys.stdout, os.path.join(args.out, "mosaic_variants.log"))
  results = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
             "b": args.b, "d": args.d, "check_b": args.check_b,
             "panel_rows": args.panel, "dtype": args.dtype, "variants": {}}

  def save():
    results["elapsed_s"] = round(time.monotonic() - t_start, 1)
    tmp = json_path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(results, f, indent=1)
    os.replace(tmp, json_path)

  def fire(name):
    print(f"WATCHDOG: {name} ran past {args.variant_timeout} s (hung?); "
          "stopping, results so far in " + json_path, flush=True)
    results["variants"].setdefault(name, {})["status"] = "TIMEOUT"
    results["aborted_at"] = name
    save()

  dog = _Watchdog(args.variant_timeout, fire)
  dtype = jnp.dtype(args.dtype)
  b, d, cb, r_rows = args.b, args.d, args.check_b, args.panel
  scale, bias = 20.0, -3.0
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; variants: "
        f"{', '.join(names)}", flush=True)

  # Correctness inputs (B = cb) and their float64 reference.
  kx, ky = jax.random.split(jax.random.key(1))
  xc = (jax.random.normal(kx, (cb, d), jnp.float32) / math.sqrt(d)
        ).astype(dtype)
  yc = (jax.random.normal(ky, (cb, d), jnp.float32) / math.sqrt(d)
        ).astype(dtype)
  s64 = scale * (np.asarray(xc, np.float64) @ np.asarray(yc, np.float64).T
                 ) + bias
  r64, c64 = _lse64(s64, 1), _lse64(s64, 0)
  g64 = 0.5 * np.exp(s64 - r64[:, None]) + 0.5 * np.exp(s64 - c64[None, :])
  g64_dsc = float(np.sum(g64 * (s64 - bias) / scale))
  g64_dbi = float(np.sum(g64))
  r2c = jnp.asarray(r64 * LOG2E, jnp.float32)
  c2c = jnp.asarray(c64 * LOG2E, jnp.float32)
  params = jnp.asarray([scale * LOG2E, bias * LOG2E, 0.5, 0.5], jnp.float32)
  print(f"float64 reference at B={cb}: {time.monotonic() - t_start:.1f} s",
        flush=True)

  # Timing inputs (B = b).
  kx, ky = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  y = (jax.random.normal(ky, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  xp = x[:r_rows]
  fwd_flops = 2.0 * b * b * d
  panel_flops = 2.0 * r_rows * b * d
  stats = {}   # realistic panel statistics from the default forward

  fns = {}   # compiled once per (stage, kwargs, size)

  def fwd_fn(kw, n):
    kw = {**FWD_BASE, **INTERPRET, **kw}
    key = ("fwd", tuple(sorted(kw.items())), n)
    if key not in fns:
      fns[key] = jax.jit(lambda p, q: mf.lse_fwd(
          p, q, scale, bias, n=n, m=n, rows=True, cols=True, **kw))
    return fns[key]

  def panel_fn(kw):
    kw = {**PANEL_BASE, **INTERPRET, **kw}
    key = ("panel", tuple(sorted(kw.items())))
    if key not in fns:
      fns[key] = jax.jit(lambda p, q, rr, cc: mg.g_panel(
          p, q, rr, cc, params, rows=True, cols=True, mask=False, **kw))
    return fns[key]

  def check(stage, kw):
    if stage == "fwd":
      r, c = fwd_fn(kw, cb)(xc, yc)
      er, ec = _rel(r, r64), _rel(c, c64)
      ok = er < 1e-5 and ec < 1e-5
      return ok, {"row_rel_err": er, "col_rel_err": ec}
    g, dsc, dbi = panel_fn(kw)(xc, yc, r2c, c2c)
    eg = _rel(g, g64)
    edsc = abs(float(dsc) - g64_dsc) / max(abs(g64_dsc), 1e-30)
    edbi = abs(float(dbi) - g64_dbi) / g64_dbi
    ok = eg < 1e-2 and edsc < 1e-2 and edbi < 1e-2
    return ok, {"g_rel_err": eg, "dsc_rel_err": edsc, "dbi_rel_err": edbi}

  def timed(stage, kw):
    if stage == "fwd":
      fn = fwd_fn(kw, b)
      t = timeit(fn, x, y, reps=args.reps, inner=args.inner)
      out = fn(x, y)
      return t, fwd_flops, out
    rr, cc = stats["r2"], stats["c2"]
    fn = panel_fn(kw)
    t = timeit(fn, xp, y, rr, cc, reps=args.reps, inner=args.inner)
    return t, panel_flops, None

  base_ms = {}
  order = list(names)
  # The default again at the end of its stage's variants: drift check.
  for dname in ("fwd_default", "panel_default"):
    if dname in order and any(VARIANTS[k][0] == VARIANTS[dname][0]
                              for k in order if k != dname):
      order.append(dname + "#again")
  for name in order:
    key = name
    vname = name.split("#")[0]
    stage, kw = VARIANTS[vname]
    if time.monotonic() - t_start > args.budget_s:
      print(f"{key:28s} SKIPPED (time budget {args.budget_s} s spent)",
            flush=True)
      results["variants"][key] = {"status": "SKIPPED_BUDGET"}
      save()
      continue
    rec = {"stage": stage, "kwargs": {k: v for k, v in kw.items()}}
    results["variants"][key] = rec
    dog.arm(key)
    t0 = time.monotonic()
    try:
      if stage == "panel" and "r2" not in stats:
        # Realistic statistics: the default forward's (base 2).
        try:
          rl, cl = stats.get("fwd_out") or fwd_fn({}, b)(x, y)
          stats["r2"] = (rl[:r_rows] * LOG2E).astype(jnp.float32)
          stats["c2"] = (cl * LOG2E).astype(jnp.float32)
        except Exception as e:  # pylint: disable=broad-except
          print(f"default forward failed ({type(e).__name__}); panels use "
                "constant statistics", flush=True)
          stats["r2"] = jnp.full((r_rows,), 5.0, jnp.float32)
          stats["c2"] = jnp.full((b,), 5.0, jnp.float32)
      if name.endswith("#again"):
        ok, errs = True, {}
      else:
        ok, errs = check(stage, kw)
      rec.update(errs)
      rec["check"] = "PASS" if ok else "FAIL"
      if not ok:
        rec["status"] = "FAIL"
        print(f"{key:28s} FAIL  {errs}", flush=True)
      else:
        (med, lo, hi), flops, out = timed(stage, kw)
        rec.update(status="OK", ms=med * 1e3, ms_min=lo * 1e3,
                   ms_max=hi * 1e3, tflops=flops / med / 1e12)
        if stage == "fwd" and vname == "fwd_default":
          stats.setdefault("fwd_out", out)
        elif stage == "fwd" and "fwd_out" in stats:
          # Agreement with the default at full size (not a float64 check).
          ref = stats["fwd_out"]
          rec["vs_default_max_abs"] = float(max(
              jnp.max(jnp.abs(out[0] - ref[0])),
              jnp.max(jnp.abs(out[1] - ref[1]))))
        if vname == f"{stage}_default":
          base_ms.setdefault(stage, med * 1e3)
        base = base_ms.get(stage, float("nan"))   # nan: default failed
        rec["speedup_vs_default"] = base / (med * 1e3)
        extra = ""
        if "vs_default_max_abs" in rec:
          extra = f"  |d|max vs default {rec['vs_default_max_abs']:.2e}"
        print(f"{key:28s} PASS  {med * 1e3:8.3f} ms [{lo * 1e3:.3f}-"
              f"{hi * 1e3:.3f}] {flops / med / 1e12:6.1f} TFLOP/s  "
              f"x{base / (med * 1e3):.3f} vs {stage}_default "
              f"({base:.3f} ms)  {errs}{extra}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      msg = f"{type(e).__name__}: {str(e)[:600]}"
      rec.update(status="ERROR", error=msg,
                 traceback=traceback.format_exc()[-3000:])
      print(f"{key:28s} ERROR {msg}", flush=True)
    dog.disarm()
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    save()
  print("\nsummary (median ms, TFLOP/s, vs default):", flush=True)
  for key, rec in results["variants"].items():
    if rec.get("status") == "OK":
      print(f"  {key:28s} {rec['ms']:8.3f} ms {rec['tflops']:6.1f} "
            f"x{rec['speedup_vs_default']:.3f}", flush=True)
    else:
      print(f"  {key:28s} {rec.get('status')}", flush=True)
  print(f"total {time.monotonic() - t_start:.1f} s; results in {json_path}",
        flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--panel", type=int, default=4096)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--fwd_stages", default="4")
  ap.add_argument("--bwd_stages", default="3")
  ap.add_argument("--triton", type=int, default=1)
  ap.add_argument("--ceiling", type=int, default=1)
  ap.add_argument("--variants", default="",
                  help="comma-separated variant names, or all / fwd / panel "
                  "(see VARIANTS); runs only the variant comparison")
  ap.add_argument("--out", default="benchmarks/results/mosaic_variants")
  ap.add_argument("--check_b", type=int, default=4096)
  ap.add_argument("--inner", type=int, default=5)
  ap.add_argument("--budget_s", type=float, default=150.0,
                  help="no variant is started after this many seconds "
                  "since the process started")
  ap.add_argument("--variant_timeout", type=float, default=45.0)
  ap.add_argument("--interpret", type=int, default=0,
                  help="run the variants in the Mosaic GPU interpreter "
                  "(a CPU dry run of this script; use tiny --b)")
  args = ap.parse_args()
  if args.interpret:
    INTERPRET["interpret"] = True
  if args.variants:
    run_variants(args)
    return
  b, d, r = args.b, args.d, args.panel
  dtype = jnp.dtype(args.dtype)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, B={b} "
        f"D={d} {dtype.name}", flush=True)
  kx, ky = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(kx, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  y = (jax.random.normal(ky, (b, d), jnp.float32) / math.sqrt(d)).astype(dtype)
  scale, bias = jnp.float32(20.0), jnp.float32(-3.0)
  fwd_flops = 2.0 * b * b * d
  if args.ceiling:
    a = jax.random.normal(kx, (8192, 8192), jnp.float32).astype(dtype)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32
                                      ).astype(dtype))
    report("XLA GEMM 8192^3 (ceiling)", 2.0 * 8192**3,
           timeit(mm, a, a, reps=args.reps))
  for st in [int(v) for v in args.fwd_stages.split(",")]:
    for rows, cols, pp, se, rsb in ((1, 1, 1, 1, 0), (1, 1, 1, 1, 16384),
                                    (1, 1, 1, 0, 16384), (1, 0, 0, 0, 0)):
      fn = jax.jit(lambda p, q, st=st, rows=rows, cols=cols, pp=pp, se=se,
                   rsb=rsb: mf.lse_fwd(
                       p, q, scale, bias, n=b, m=b, rows=bool(rows),
                       cols=bool(cols), num_stages=st, pingpong=bool(pp),
                       single_exp=bool(se), reduction_scratch_bytes=rsb))
      try:
        report(f"mosaic fwd r={rows} c={cols} pp={pp} 1exp={se} rsb={rsb} "
               f"st={st}", fwd_flops,
               timeit(fn, x, y, reps=args.reps))
      except Exception as e:  # pylint: disable=broad-except
        print(f"mosaic fwd stages={st} failed: {type(e).__name__}: "
              f"{str(e)[:400]}", flush=True)
  xp = x[:r]
  r2 = jnp.full((r,), 5.0, jnp.float32)
  c2 = jnp.full((b,), 5.0, jnp.float32)
  params = jnp.asarray([20.0 * LOG2E, -3.0 * LOG2E, 0.5, 0.5], jnp.float32)
  panel_flops = 2.0 * r * b * d
  for st, pp in [(int(v), pp) for v in args.bwd_stages.split(",")
                 for pp in (False,)]:
    fn = jax.jit(lambda p, q, rr, cc, st=st, pp=pp: mg.g_panel(
        p, q, rr, cc, params, rows=True, cols=True, mask=False,
        num_stages=st, pingpong=pp))
    try:
      report(f"mosaic g_panel R={r} pp={pp:d} stages={st}", panel_flops,
             timeit(fn, xp, y, r2, c2, reps=args.reps))
    except Exception as e:  # pylint: disable=broad-except
      print(f"mosaic g_panel stages={st} failed: {type(e).__name__}: "
            f"{str(e)[:400]}", flush=True)
  if args.triton:
    try:
      from infcl_jax.kernels import lse_bwd as tb  # pylint: disable=g-import-not-at-top
      from infcl_jax.kernels import lse_fwd as tf  # pylint: disable=g-import-not-at-top
    except Exception as e:  # pylint: disable=broad-except
      print(f"triton kernels not importable: {e}", flush=True)
      return
    fn = jax.jit(lambda p, q: tf.lse_fwd(
        p, q, scale, bias, n=b, m=b, rows=True, cols=True, block_q=128,
        block_k=256, block_d=64, num_programs=132, num_warps=8, num_stages=3,
        precision=jax.lax.Precision.DEFAULT, interpret=False))
    report("triton fwd rows+cols", fwd_flops, timeit(fn, x, y, reps=args.reps))
    fn = jax.jit(lambda p, q, rr, cc: tb.g_panel(
        p, q, rr, cc, params, rows=True, cols=True, mask=False, g_dtype=dtype,
        block_q=128, block_k=256, block_d=64, num_warps=8, num_stages=3,
        precision=jax.lax.Precision.DEFAULT, interpret=False))
    report(f"triton g_panel R={r}", panel_flops,
           timeit(fn, xp, y, r2, c2, reps=args.reps))




if __name__ == "__main__":
  main()
