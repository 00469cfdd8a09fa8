"""Multi-device benchmark of the ring loss: weak scaling, baselines, overlap.

  python benchmarks/bench_ring.py --out OUT          # every visible GPU

fwd+bwd steps (``ring_steps.py``), D = 768 bf16 by default, by section:
scaling (strategies ring, gather and plain over N = 1, 2, 4, ... devices at
b_local rows each; the 1-GPU ring step also on every other GPU, since a
synchronous step goes at the slowest GPU's pace), overlap (the ring against
its compute alone and its transfers alone), hlo (``ring_hlo.report`` of the
scheduled program, listed in ``ring_hlo.txt``) and maxbatch (b doubled until
out of memory; a step estimated over --max-step-s runs once if under
--max-once-s, else is compiled only and judged by XLA's plan).

On GPUs each case runs in a fresh process that sees only its N devices, so
its peak (``peak_bytes_in_use`` beyond the inputs) is its own; elsewhere the
memory figure is XLA's plan. Rows go to bench_ring.csv / .jsonl after every
case (--resume keeps finished ones), with bench_ring_meta.json.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position
from benchmarks import ring_hlo  # noqa: E402  pylint: disable=wrong-import-position

PHASE_TAG = "BENCH_RING_PHASE "
FIELDS = ["section", "strategy", "n_dev", "b_local", "B_global", "D", "dtype",
          "backend", "first_device", "status", "ms", "reps", "timing", "loss",
          "efficiency", "efficiency_slowest_gpu", "time_over_ring", "peak_gb",
          "xla_temp_gb", "xla_plan_gb", "xla_total_gb", "mem_source", "wall_s"]


# ------------------------------------------------------------- one case

def block_sizes_of(spec):
  from infcl_jax import BlockSizes  # pylint: disable=import-outside-toplevel
  if not (spec.get("block_q") and spec.get("block_k")):
    return None
  return BlockSizes(block_q=spec["block_q"], block_k=spec["block_k"])


def run_case(spec):
  """Runs one case in this process on the first spec["n"] devices.

  spec keys: kind ("step", "compute_only", "transfer_only" or "hlo"),
  strategy, n, b_local, d, dtype, backend, block_q, block_k, budget_s,
  run (False: compile only), fresh (this process holds nothing else, so
  the allocator's peak counter belongs to this case), hlo_path.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from benchmarks import ring_steps  # pylint: disable=import-outside-toplevel

  n, b, d = spec["n"], spec["b_local"], spec["d"]
  dtype = jnp.dtype(spec["dtype"])
  mesh = ring_steps.make_mesh(n)
  devices = list(mesh.devices.flat)
  bs = block_sizes_of(spec)
  kind = spec["kind"]
  if kind in ("step", "hlo"):
    fn = ring_steps.train_step(spec["strategy"], mesh, spec["backend"], bs)
  else:
    fn = ring_steps.overlap_steps(mesh, spec["backend"], bs)[kind]
  shard = NamedSharding(mesh, P(ring_steps.AXIS))
  emb = jax.ShapeDtypeStruct((n * b, d), dtype, sharding=shard)
  scalar = jax.ShapeDtypeStruct((), jnp.float32,
                                sharding=NamedSharding(mesh, P()))
  res = {}
  delay = spec.get("test_delay_s") or {}  # Tests of the phase timeouts.
  try:
    time.sleep(delay.get("compile", 0))
    compiled, compile_s = harness.aot(fn, emb, emb, scalar)
  except Exception as e:  # pylint: disable=broad-except
    return dict(status=harness.failure(e))
  res["compile_s"] = round(compile_s, 2)
  res.update(harness.mem_plan(compiled))
  limits = harness.device_bytes("bytes_limit", devices)
  if limits:
    res["bytes_limit_gb"] = min(limits) / 1e9
  if spec.get("report_phases"):  # The parent's compile deadline ends here.
    print(PHASE_TAG + json.dumps(dict(res, phase="compiled")), flush=True)
  time.sleep(delay.get("run", 0))
  if (limits and spec.get("run", True) and kind != "hlo"
      and res.get("xla_total_gb", 0) > res["bytes_limit_gb"]):
    # Running it would only end in RESOURCE_EXHAUSTED; the plan says so.
    return dict(res, status=f"oom (XLA plan {res['xla_total_gb']:.3g} GB "
                f"> limit {res['bytes_limit_gb']:.3g} GB; not run)")
  if kind == "hlo":  # The schedule is written even if the report fails.
    hlo, buf, counts = compiled.as_text(), io.StringIO(), None
    try:
      with contextlib.redirect_stdout(buf):
        counts = ring_hlo.report(hlo)
      head = f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n{buf.getvalue()}"
    except Exception as e:  # pylint: disable=broad-except
      head = f"ring_hlo.report failed: {e!r}"
    if spec.get("hlo_path"):
      with open(spec["hlo_path"], "w") as fh:
        fh.write(head + "\n\n==== optimized, scheduled HLO ====\n" + hlo)
    if counts is None:
      return dict(res, status=f"error: {head}"[:300])
    return dict(res, status="ok", **dict(zip(
        ("n_async", "n_overlapped", "n_sync"), counts)))
  if not spec.get("run", True):
    return dict(res, status="compiled")
  try:
    x, y = ring_steps.make_inputs(mesh, b, d, dtype)
    t = jax.device_put(jnp.float32(ring_steps.LOGIT_SCALE),
                       NamedSharding(mesh, P()))
    base = harness.device_bytes("bytes_in_use", devices)
    if spec.get("once"):  # One synchronized call, no warm-up (compiled AOT).
      t1 = time.perf_counter()
      out = jax.block_until_ready(compiled(x, y, t))
      sec, reps = time.perf_counter() - t1, 1
    else:
      tm = harness.timeit(compiled, x, y, t, reps=7, warmup=1,
                          budget_s=spec["budget_s"])
      sec, reps, out = tm.median, tm.reps, compiled(x, y, t)
  except Exception as e:  # pylint: disable=broad-except
    return dict(res, status=harness.failure(e))
  res.update(status="ok", ms=sec * 1e3, reps=reps)
  if spec.get("once"):
    res["timing"] = "one call, no warm-up"
  if kind == "step":
    res["loss"] = float(out[0])
  peak = harness.device_bytes("peak_bytes_in_use", devices)
  if base and peak and spec.get("fresh"):
    res["peak_gb"] = max(p - q for p, q in zip(peak, base)) / 1e9
  return res


def probe(backend):
  """What the backend sees (``harness.device_meta``) and the tile backend
  that ``backend`` resolves to."""
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  info = harness.device_meta()
  return dict(info, status="ok",
              backend=registry.resolve(backend, "softmax", info["platform"]))


# ----------------------------------------------------- case isolation

def _child_env(n, platform, first=0, strategy=None):
  """Environment of a child that sees exactly n devices, from ``first``.

  The plain baseline preallocates the allocator's arena
  (XLA_PYTHON_CLIENT_PREALLOCATE=true): its N = 2, b_local = 65,536 step
  plans 104-138 GB per GPU, and growing the allocator on demand that close
  to the limit did not finish a step in 120 s on 2 H200s, where the
  preallocated arena runs it in 379 ms (BENCHMARKS.md "Ring"). peak_bytes_in_use
  still counts the bytes in use, not the arena.
  """
  env = harness.child_env()
  if strategy == "plain" and platform == "gpu":
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
  if platform == "cpu":
    env.update(harness.xla_env(n, env))
  elif platform == "gpu":
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = (visible.split(",") if visible
           else [str(i) for i in range(first + n)])
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[first:first + n])
  return env


def spawn(spec, platform, timeout_s, compile_timeout_s=0):
  """Runs ``run_case(spec)`` in a fresh process (``harness.run_child``)
  with a compile deadline, so that a hang at run time (one device out of
  memory while the other waits in a collective) is told apart from a
  compile that does not end (rematerialization over XLA's limit)."""
  spec = dict(spec, report_phases=True)
  return harness.run_child(
      [os.path.abspath(__file__), "--case", json.dumps(spec)],
      phase_tag=PHASE_TAG, timeout_s=timeout_s,
      compile_timeout_s=compile_timeout_s,
      env=_child_env(spec.get("n", 0), platform, spec.get("first_device", 0),
                     spec.get("strategy")))


# ------------------------------------------------------------ the job

def set_flags():
  """XLA reads XLA_FLAGS when the backend starts: call before that."""
  harness.set_xla_flags()
  # Allocate on demand (so peak_bytes_in_use is what the case used) and let
  # the allocator use nearly the whole device (for the max-batch search).
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")


def backend_started():
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return xla_bridge.backends_are_initialized()
  except Exception:  # pylint: disable=broad-except
    return "jax" in sys.modules


def _powers_of_two_upto(n):
  out, k = [], 1
  while k <= n:
    out.append(k)
    k *= 2
  if out[-1] != n:
    out.append(n)
  return out


def parse_args(argv):
  ap = harness.parser(__doc__, out=None, resume=True, budget_s=4.0,
                      timeout_s=300)
  ap.add_argument("--b-local", default="65536,16384,8192",
                  help="comma list of local batches; the first is the "
                  "headline (overlap, max batch)")
  ap.add_argument("--devices", default="", help="comma list of device "
                  "counts (default 1, 2, 4, ... up to all visible)")
  ap.add_argument("--dims", type=int, default=768, help="embedding dim D")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--block-q", type=int, default=0)
  ap.add_argument("--block-k", type=int, default=0)
  ap.add_argument("--time-budget-s", type=float, default=540.0,
                  help="cases starting after this many seconds are skipped "
                  "(and say so); 0 = no limit")
  ap.add_argument("--strategies", default="ring,gather,plain")
  ap.add_argument("--sections", default="scaling,overlap,hlo,maxbatch")
  mb = ap.add_argument_group(
      "max batch", "b doubles from --max-b-start (default: the headline b) "
      "to --max-b-local (default 2^24 on GPUs, 4x the headline b elsewhere); "
      "a step estimated over --max-step-s runs once if under --max-once-s "
      "(one synchronized call, no warm-up), else is compiled only")
  mb.add_argument("--max-step-s", type=float, default=20.0)
  mb.add_argument("--max-once-s", type=float, default=0.0)
  mb.add_argument("--max-b-start", type=int, default=0)
  mb.add_argument("--max-b-local", type=int, default=0)
  ap.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                  help="a fresh process per case (auto: on GPUs)")
  return ap.parse_args(argv)


# Until a child has compiled: a compile that does not end (XLA
# rematerializing over its memory limit) is told apart from a hang at run
# time.
COMPILE_TIMEOUT_S = 150


class Job:
  """Runs cases in order, in or out of process, and keeps the rows (a
  resumed run keeps an earlier timeout: it is a result)."""

  def __init__(self, args, info, isolate):
    self.args, self.info, self.isolate = args, info, isolate
    self.fresh_runtime_peak = isolate and info["platform"] != "cpu"
    self.budget = harness.Budget(args.time_budget_s or None)
    self.table = harness.Rows(
        args.out, "bench_ring", fields=FIELDS, resume=args.resume,
        keep=lambda s: not s.startswith("skipped"),
        key=lambda r: (r["section"], r["strategy"], r["n_dev"], r["b_local"],
                       r["D"], r["dtype"], r["backend"],
                       r.get("first_device", 0)))
    self.rows, self.done = self.table.rows, self.table.done

  def spec(self, kind, strategy, n, b, **kw):
    a = self.args
    return dict(kind=kind, strategy=strategy, n=n, b_local=b, d=a.dims,
                dtype=a.dtype, backend="auto", block_q=a.block_q,
                block_k=a.block_k, budget_s=a.budget_s, fresh=self.isolate, **kw)

  def run(self, section, spec):
    row = dict(section=section, strategy=spec["strategy"]
               if spec["kind"] in ("step", "hlo") else spec["kind"],
               n_dev=spec["n"], b_local=spec["b_local"],
               B_global=spec["n"] * spec["b_local"], D=spec["d"],
               dtype=spec["dtype"], backend=self.info["backend"])
    if spec.get("first_device"):
      row["first_device"] = spec["first_device"]
    earlier = self.table.earlier(row)
    if earlier:
      return earlier
    skip = self.budget.skip()
    if skip:
      row["status"] = skip
    else:
      t = time.time()
      if self.isolate:  # Leave time to write the summary.
        r = spawn(spec, self.info["platform"],
                  int(self.budget.deadline(self.args.timeout_s, 45, 30)),
                  COMPILE_TIMEOUT_S)
      else:
        r = run_case(spec)
      row.update(r, wall_s=round(time.time() - t, 1))
    row["mem_source"] = ("peak_bytes_in_use (fresh process)"
                         if row.get("peak_gb") is not None
                         else "xla memory_analysis only")
    return self.table.add(row)

  def write_csv(self):
    self.table.write()


def _ok(rows, **match):
  return [r for r in rows if r.get("status") == "ok"
          and all(r.get(k) == v for k, v in match.items())]


def derive(rows):
  """Efficiency per (strategy, b) and each strategy's time over the ring's."""
  for r in _ok(rows, section="scaling"):
    one = _ok(rows, section="scaling", strategy=r["strategy"], n_dev=1,
              b_local=r["b_local"])
    if one:
      r["efficiency"] = one[0]["ms"] * r["n_dev"] / r["ms"]
      others = _ok(rows, section="single_gpu", strategy=r["strategy"],
                   b_local=r["b_local"])
      if others and r["n_dev"] > 1:
        slowest = max(x["ms"] for x in one[:1] + others)
        r["efficiency_slowest_gpu"] = slowest * r["n_dev"] / r["ms"]
    ring = _ok(rows, section="scaling", strategy="ring", n_dev=r["n_dev"],
               b_local=r["b_local"])
    if ring:
      r["time_over_ring"] = r["ms"] / ring[0]["ms"]


def mem_of(r):
  """Memory per device: runtime peak where measured, else XLA's plan."""
  return r["peak_gb"] if r.get("peak_gb") is not None else r.get("xla_plan_gb")


def print_table(rows, meta):
  print(f"\n{meta['date']}  {meta['n_devices']} x {meta['device_kind']} "
        f"({meta['platform']})  jax {meta['jax']}  backend {meta['backend']}"
        f"  D={meta['D']} {meta['dtype']}")
  print(f"XLA_FLAGS={meta['xla_flags']!r}  memory: {meta['mem_note']}")
  print(f"{'section':9s} {'strategy':13s} {'N':>3s} {'b_local':>8s} "
        f"{'ms':>10s} {'eff':>6s} {'/ring':>6s} {'mem GB':>8s} {'loss':>9s}")
  for r in rows:
    if r.get("section") == "hlo":
      continue
    sec = r["section"] + (f"@{r['first_device']}" if r.get("first_device")
                          else "")
    head = (f"{sec:9s} {r['strategy']:13s} {r['n_dev']:3d} "
            f"{r['b_local']:8d} ")
    mem = mem_of(r)
    if r.get("status") == "ok":
      print(head + f"{r['ms']:10.2f} " + "".join(
          " " * (w + 1) if v is None else f"{v:{w}{spec}} " for v, w, spec in (
              (r.get("efficiency"), 6, ".0%"),
              (r.get("time_over_ring"), 6, ".2f"), (mem, 8, ".3g")))
            + (f"{r['loss']:9.5f}" if "loss" in r else ""))
    else:
      print(head + f"  {r.get('status', '')[:70]}"
            + (f"  (XLA plan {mem:.3g} GB/dev)" if mem is not None else ""))
  ov = meta.get("overlap")
  if ov:
    print(f"overlap at N={ov['n']}, b={ov['b_local']}: {ov['text']}")
  if meta.get("hlo"):
    h = meta["hlo"]
    print(f"scheduled HLO (ring, N={h['n']}): {h.get('n_async')} async "
          f"collective-permute start/done pairs, {h.get('n_overlapped')} with "
          f"compute between, {h.get('n_sync')} synchronous")
  if meta.get("maxbatch"):
    print(f"max batch (ring, N={meta['maxbatch']['n']}): "
          f"{meta['maxbatch']['summary']}")
  if meta["platform"] == "cpu":
    print("(CPU devices: sanity numbers, not GPU performance)")


def overlap_numbers(ring_ms, compute_ms, transfer_ms):
  """The ring against its compute alone and its transfers alone: the
  overhead (t(ring) - t(compute)), the fraction of the transfer time hidden
  (1 - overhead / transfer, in [0, 1]) and the overhead beyond the whole
  transfer time (a cost that is not the transfer: merges, launches, NCCL
  kernels taking SMs from the tiles)."""
  r, c, x = ring_ms, compute_ms, transfer_ms
  overhead = r - c
  if x > 0:
    hidden = min(max(1.0 - overhead / x, 0.0), 1.0)
  else:
    hidden = 1.0 if overhead <= 0 else 0.0
  return dict(ring_ms=r, compute_ms=c, transfer_ms=x, overhead_ms=overhead,
              hidden=hidden, excess_ms=max(overhead - x, 0.0))


def overlap_text(ov):
  head = (f"ring {ov['ring_ms']:.2f} ms = compute-only {ov['compute_ms']:.2f}"
          f" ms {'+' if ov['overhead_ms'] >= 0 else '-'} overhead "
          f"{abs(ov['overhead_ms']):.2f} ms; transfer-only "
          f"{ov['transfer_ms']:.2f} ms; transfer hidden {ov['hidden']:.0%}")
  if ov["overhead_ms"] < 0:
    return head + "; the ring ran faster than its compute alone (noise)"
  if ov["excess_ms"] > 0:
    return head + (f"; the overhead exceeds the whole transfer time by "
                   f"{ov['excess_ms']:.2f} ms")
  return head


def overlap_summary(rows, n, b):
  get = lambda s: _ok(rows, section="overlap", strategy=s, n_dev=n, b_local=b)
  ring, comp, xfer = get("ring"), get("compute_only"), get("transfer_only")
  if not (ring and comp and xfer):
    return None
  ov = overlap_numbers(ring[0]["ms"], comp[0]["ms"], xfer[0]["ms"])
  return dict(ov, n=n, b_local=b, text=overlap_text(ov))


def max_batch(job, n, b0, cap, max_step_s, max_once_s=0.0):
  """Doubles b from b0 until OOM, a plan over the limit, or the cap.

  A step estimated (4x the last per doubling) above ``max_step_s`` runs
  once if the estimate is below ``max_once_s``, else is compiled only.
  """
  b, last_ms, ran, planned = b0, None, None, None
  # A first estimate from the largest measured ring step at this N (the
  # step time grows with b**2), so that a large --max-b-start can run once.
  known = _ok(job.rows + list(getattr(job, "done", {}).values()),
              section="scaling", strategy="ring", n_dev=n)
  if known:
    k = max(known, key=lambda r: r["b_local"])
    if k["b_local"] < b0:
      last_ms = k["ms"] * (b0 / k["b_local"]) ** 2 / 4
  while b <= cap:
    est_s = None if last_ms is None else last_ms * 4 / 1e3
    run = est_s is None or est_s <= max_step_s
    once = not run and est_s <= max_once_s
    run = run or once
    prev = _ok(job.rows, section="scaling", strategy="ring", n_dev=n,
               b_local=b)
    if prev and run:  # Measured already: the same step, listed again.
      row = dict(prev[0], section="maxbatch")
      job.rows.append(row)
    else:
      row = job.run("maxbatch", job.spec("step", "ring", n, b, run=run,
                                         once=once))
    if run and row.get("status") == "ok":
      ran, last_ms = b, row["ms"]
    elif row.get("status") == "compiled":
      limit = row.get("bytes_limit_gb")
      fits = (limit is not None and row.get("xla_total_gb") is not None
              and row["xla_total_gb"] <= limit)
      row["status"] = (f"compiled, not run (est. {est_s:.0f}s > "
                       f"--max-step-s); XLA plan "
                       f"{row.get('xla_total_gb', float('nan')):.3g} GB/dev with inputs "
                       + (f"{'<=' if fits else '>'} limit {limit:.3g} GB"
                          if limit else "(no device memory limit known)"))
      job.write_csv()
      if not fits:
        break
      planned = b
      last_ms = last_ms * 4
    else:
      break
    b *= 2
  parts = []
  if ran:
    parts.append(f"largest run b_local={ran} (global {ran * n})")
  if planned:
    parts.append(f"largest fitting by XLA plan b_local={planned} "
                 f"(global {planned * n}, not run)")
  stop = job.rows[-1]["status"] if job.rows else ""
  parts.append(f"stopped at b_local={b}: "
               + (f"cap {cap}" if b > cap else stop[:80]))
  return dict(n=n, run_b_local=ran, planned_b_local=planned,
              summary="; ".join(parts))


def main(argv=None):
  """The whole job; returns (rows, meta). See the module docstring."""
  args = parse_args(argv)
  if args.case:
    spec = json.loads(args.case)
    r = (probe(spec["backend"]) if spec.get("kind") == "probe"
         else run_case(spec))
    harness.print_result(r)
    return None
  started = backend_started()
  if not started:
    set_flags()
  os.makedirs(args.out, exist_ok=True)
  # Isolation decides where JAX runs: on GPUs the parent never starts a
  # backend (it would hold memory on every device the children use).
  if args.isolate == "auto":
    isolate = not (started or os.environ.get("JAX_PLATFORMS", "") == "cpu")
  else:
    isolate = args.isolate == "yes"
  if isolate:
    info = spawn({"kind": "probe", "backend": "auto"}, "", args.timeout_s)
    if info.get("status") != "ok":
      raise RuntimeError(f"device probe failed: {info}")
    if info["platform"] == "cpu" and args.isolate == "auto":
      isolate = False
  if not isolate:
    info = probe("auto")
  job = Job(args, info, isolate)

  n_all = info["n_devices"]
  ns = ([int(v) for v in args.devices.split(",")] if args.devices
        else _powers_of_two_upto(n_all))
  ns = [n for n in ns if n <= n_all]
  n_max = max(ns)
  b_locals = [int(v) for v in args.b_local.split(",")]
  b0 = b_locals[0]
  strategies = args.strategies.split(",")
  sections = args.sections.split(",")
  meta = dict(
      {k: info[k] for k in ("platform", "device_kind", "n_devices", "jax",
                            "jaxlib", "backend", "xla_flags")},
      date=harness.now(), command=" ".join(
          ["python", "benchmarks/bench_ring.py"]
          + list(argv if argv is not None else sys.argv[1:])),
      D=args.dims, dtype=args.dtype, isolate=isolate, devices=ns,
      b_local=b_locals, block_q=args.block_q, block_k=args.block_k)
  meta["mem_note"] = ("peak_bytes_in_use beyond inputs, fresh process per "
                      "case" if job.fresh_runtime_peak else
                      "XLA's plan per device beyond the inputs")

  if "scaling" in sections:
    for b in b_locals:
      for s in strategies:
        for n in ns:
          job.run("scaling", job.spec("step", s, n, b))
          if s == "ring" and n == 1 and info["platform"] == "gpu":
            # The same 1-GPU step on every other GPU: a synchronous
            # multi-GPU step runs at the pace of the slowest GPU.
            for first in range(1, n_all):
              job.run("single_gpu", job.spec("step", s, 1, b,
                                             first_device=first))
  derive(job.rows)
  if "overlap" in sections and n_max > 1:
    prev = _ok(job.rows, section="scaling", strategy="ring", n_dev=n_max,
               b_local=b0)
    if prev:  # The same measurement; repeated as an overlap row.
      job.rows.append(dict(prev[0], section="overlap"))
    else:
      job.run("overlap", job.spec("step", "ring", n_max, b0))
    for kind in ("compute_only", "transfer_only"):
      job.run("overlap", job.spec(kind, kind, n_max, b0))
    meta["overlap"] = overlap_summary(job.rows, n_max, b0)
  if "hlo" in sections:
    hlo_path = os.path.join(args.out, "ring_hlo.txt")
    row = job.run("hlo", job.spec("hlo", "ring", n_max, b0,
                                  hlo_path=os.path.abspath(hlo_path)))
    meta["hlo"] = dict(n=n_max, b_local=b0, status=row.get("status"),
                       n_async=row.get("n_async"),
                       n_overlapped=row.get("n_overlapped"),
                       n_sync=row.get("n_sync"), report="ring_hlo.txt")
  if "maxbatch" in sections:
    cap = args.max_b_local or (2**24 if info["platform"] == "gpu" else 4 * b0)
    meta["maxbatch"] = max_batch(job, n_max, args.max_b_start or b0, cap,
                                 args.max_step_s, args.max_once_s)
  derive(job.rows)
  job.write_csv()
  meta["elapsed_s"] = round(job.budget.elapsed(), 1)
  with open(os.path.join(args.out, "bench_ring_meta.json"), "w") as fh:
    json.dump(meta, fh, indent=1)
  print_table(job.rows, meta)
  return job.rows, meta


if __name__ == "__main__":
  main()
