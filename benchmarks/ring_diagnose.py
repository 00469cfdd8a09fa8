"""Where does the ring's extra time go? One process, a few minutes of GPU.

For each local batch b (``--b-local``) and N in ``--devices`` (sub-meshes of
the first N devices), times fwd+bwd of the ring and of gather, and the
ring's compute alone and its transfers alone (``ring_steps.overlap_steps``;
compute-only at N = 1 too). Then it explains the ring's time:

* the HLO report of every ring step it compiled (``ring_hlo.report``: which
  collective-permutes are asynchronous and what runs between start and done);
* a ``jax.profiler`` trace of a few steps of the ring and of compute-only
  (``--profile``), summarised per device into time per step by kind of
  kernel -- tiles (custom calls: the Pallas / Triton / Mosaic kernels),
  fusions (the per-step merges, casts, accumulations), copies, collectives
  (NCCL) -- with the busy time of the device (union of its kernels), the
  time collectives run at the same time as compute, and the idle time
  (step time minus busy): the ring's extra time is then read off
  ring - compute-only per kind (XLA may run without CUDA graphs while
  profiling, so a traced step can have more launch gaps than a timed one);
* optionally (``--plain-compile-timeout-s``), the plain all-gather baseline
  at the largest N and b compiled (not run) in a child process under that
  limit: its compile time and XLA's memory plan, or that it did not compile
  in time.

Everything runs in this process (no isolation, so no per-case memory peak;
XLA's plan is recorded). Cases run most informative first and none starts
after ``--time-budget-s``; the results are written after every case.

Writes into --out: ``ring_diagnose.json`` (everything), ``ring_diagnose.csv``
(one row per timed case), ``profile_kernels.csv`` (per profiled program,
device and kernel: ms per step), ``ring_hlo_N{n}_b{b}.txt`` (report + HLO),
``summary.txt`` (what is printed at the end).

  # GPUs (2 H200s, < 270 s):
  timeout -s INT -k 10 275 python3 benchmarks/ring_diagnose.py --out "$OUT" \
      --backend pallas --plain-compile-timeout-s 60
  # smoke test on host CPU devices:
  python benchmarks/ring_diagnose.py --cpu-devices 2 --b-local 64 --dims 16 \\
      --dtype float32 --block-q 16 --block-k 32 --out /tmp/diag
"""
from __future__ import annotations

import argparse
import collections
import csv
import glob
import json
import os
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from benchmarks import bench_ring  # pylint: disable=wrong-import-position
from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import ring_hlo  # pylint: disable=wrong-import-position

CSV_FIELDS = ["kind", "n_dev", "b_local", "D", "dtype", "backend", "status",
              "ms", "reps", "compile_s", "xla_temp_gb", "xla_total_gb",
              "loss", "profile", "wall_s"]
KERNEL_FIELDS = ["program", "device", "category", "op", "kernel", "count",
                 "ms_per_step"]
CATEGORIES = ("tiles", "fusions", "copies", "collectives", "other")


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True)
  bench_ring.add_case_args(
      ap, b_local="65536,8192", b_local_help="comma list of local batches",
      devices="2,1", devices_help="device counts, most informative first",
      backend="pallas", budget_s=0.6, time_budget_s=190.0,
      time_budget_help="no case starts after this many seconds; 0 = no "
      "limit")
  ap.add_argument("--profile", default="ring,compute_only",
                  help="programs to trace ('' = none), at every N and b")
  ap.add_argument("--profile-n", default="max",
                  help="device counts to trace at: 'max' (the largest N), "
                  "'all', or a comma list")
  ap.add_argument("--profile-steps", type=int, default=3)
  ap.add_argument("--deadline-s", type=float, default=265.0,
                  help="the plain compile-only child ends by this many seconds "
                  "after the start (0 = no deadline)")
  ap.add_argument("--plain-compile-timeout-s", type=int, default=0,
                  help="compile the plain baseline at the largest N and b in "
                  "a child process with this limit (0 = skip)")
  return ap.parse_args(argv)


# --------------------------------------------------------------- profile

def _stats(event):
  try:
    return dict(event.stats)
  except Exception:  # pylint: disable=broad-except
    return {}


def _base(name):
  """'loop_add_fusion.12' -> 'loop_add_fusion'; 'fusion_3' -> 'fusion'."""
  name = str(name or "?")
  while name and (name[-1].isdigit() or name[-1] in "._"):
    stripped = name.rstrip("0123456789")
    if stripped.endswith((".", "_")) and len(stripped) > 1:
      name = stripped[:-1]
    else:
      break
  return name


# Lines that profilers derive from the kernels (counted already).
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Ops",
                  "TensorFlow Ops", "Source code", "Launch Stats",
                  "Framework Name Scope", "XLA TraceMe")
# Kernel names of the library's tiles (pallas_call name=...) and of Triton /
# Mosaic kernels.
_TILE_NAMES = ("infcl_", "pallas", "triton", "mosaic")


def _hlo_op(stats):
  """The HLO op a kernel event belongs to: its ``hlo_op`` stat, or the
  ``#hlo_op=...#`` of an annotation string."""
  if stats.get("hlo_op") is not None:
    return str(stats["hlo_op"])
  for v in stats.values():
    if isinstance(v, str) and "hlo_op=" in v:
      return v.split("hlo_op=", 1)[1].split(",")[0].split("#")[0]
  return None


def categorize(op, kernel, opcodes):
  """Kind of a kernel from its HLO op's opcode (or its names)."""
  opcode = opcodes.get(op, "")
  text = f"{op} {kernel}".lower()
  if any(t in str(kernel).lower() for t in _TILE_NAMES) and "nccl" not in text:
    return "tiles"
  if ("nccl" in text or opcode.startswith(ring_hlo.COLLECTIVE_PREFIXES)
      or any(p in text for p in ("collective-permute", "all-gather",
                                 "reduce-scatter", "all-reduce", "ppermute"))):
    return "collectives"
  if opcode == "custom-call" or "custom-call" in text or "triton" in text:
    return "tiles"
  if opcode in ("copy", "copy-start", "copy-done") or "memcpy" in text or (
      "memset" in text) or _base(op) == "copy":
    return "copies"
  if opcode == "fusion" or "fusion" in text:
    return "fusions"
  return "other"


def _union(intervals):
  total, end = 0, None
  start = None
  for s, e in sorted(intervals):
    if end is None or s > end:
      if end is not None:
        total += end - start
      start, end = s, e
    else:
      end = max(end, e)
  if end is not None:
    total += end - start
  return total


def summarize_trace(trace_dir, steps, opcodes):
  """Per device: ms per step by category and by op, busy (union) and
  collective/compute overlap, from the XPlane files under trace_dir."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  devices = collections.defaultdict(lambda: dict(
      events=[], by_cat=collections.Counter(), by_op=collections.Counter(),
      count=collections.Counter()))
  for path in paths:
    data = ProfileData.from_file(path)
    for plane in data.planes:
      pname = plane.name
      on_device = pname.startswith("/device:") and "CPU" not in pname
      for line in plane.lines:
        if on_device and str(line.name).startswith(_DERIVED_LINES):
          continue
        for ev in line.events:
          st = _stats(ev)
          op = _hlo_op(st)
          if not on_device and op is None:
            continue  # Host-side bookkeeping.
          name = ev.name
          if not on_device and str(name).startswith("end: "):
            continue
          dev = (pname if on_device
                 else f"cpu:{st.get('device_ordinal', '?')}")
          op = str(op) if op is not None else str(name)
          cat = categorize(op, name, opcodes)
          d = devices[dev]
          start, dur = float(ev.start_ns), float(ev.duration_ns)
          d["events"].append((start, start + dur, cat))
          d["by_cat"][cat] += dur
          key = (cat, _base(op), _base(name))
          d["by_op"][key] += dur
          d["count"][key] += 1
  if any(dev.startswith("/device:") for dev in devices):
    # Accelerators: keep their kernels, not the host's bookkeeping.
    devices = {k: v for k, v in devices.items() if k.startswith("/device:")}
  out = {}
  for dev, d in sorted(devices.items()):
    ev = d["events"]
    per = lambda ns: ns / 1e6 / steps
    busy = _union([(s, e) for s, e, _ in ev])
    coll = _union([(s, e) for s, e, c in ev if c == "collectives"])
    comp = _union([(s, e) for s, e, c in ev if c != "collectives"])
    out[dev] = dict(
        ms_per_step={c: per(d["by_cat"].get(c, 0)) for c in CATEGORIES},
        busy_ms=per(busy), compute_busy_ms=per(comp),
        collective_busy_ms=per(coll),
        overlap_ms=per(coll + comp - busy),
        n_kernels=len(ev) / steps,
        ops=[dict(category=c, op=o, kernel=k, count=d["count"][(c, o, k)]
                  / steps, ms_per_step=per(ns))
             for (c, o, k), ns in d["by_op"].most_common()])
  return out


def profile(fn, args, steps, name, keep_dir=None):
  """Traces ``steps`` calls of fn(*args); returns the trace directory."""
  import jax  # pylint: disable=import-outside-toplevel
  trace_dir = keep_dir or tempfile.mkdtemp(prefix=f"trace_{name}_")
  jax.block_until_ready(fn(*args))
  with jax.profiler.trace(trace_dir):
    out = None
    for _ in range(steps):
      out = fn(*args)
    jax.block_until_ready(out)
  return trace_dir


# ------------------------------------------------------------------ run

class Diagnose:
  """Runs and records the cases; see the module docstring."""

  def __init__(self, args):
    self.args = args
    self.t0 = time.time()
    self.rows, self.hlo, self.profiles = [], {}, {}
    self.notes = []

  def over_budget(self):
    b = self.args.time_budget_s
    return b and time.time() - self.t0 > b

  def save(self):
    a = self.args
    with open(os.path.join(a.out, "ring_diagnose.csv"), "w", newline="") as fh:
      w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
      w.writeheader()
      for r in self.rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v)
                    for k, v in r.items()})
    with open(os.path.join(a.out, "profile_kernels.csv"), "w",
              newline="") as fh:
      w = csv.DictWriter(fh, fieldnames=KERNEL_FIELDS)
      w.writeheader()
      for prog, devs in self.profiles.items():
        for dev, s in devs.items():
          for o in s["ops"]:
            w.writerow(dict(program=prog, device=dev, category=o["category"],
                            op=o["op"], kernel=o["kernel"],
                            count=f"{o['count']:.3g}",
                            ms_per_step=f"{o['ms_per_step']:.4g}"))
    meta = dict(vars(a), elapsed_s=round(time.time() - self.t0, 1),
                rows=self.rows, hlo=self.hlo,
                profiles={p: {d: {k: v for k, v in s.items() if k != "ops"}
                              for d, s in devs.items()}
                          for p, devs in self.profiles.items()},
                notes=self.notes, env=self.env)
    with open(os.path.join(a.out, "ring_diagnose.json"), "w") as fh:
      json.dump(meta, fh, indent=1, default=str)

  def case(self, kind, n, b):
    """Compiles and times one program; profiles and reads its HLO when
    asked. kind: ring, gather, compute_only, transfer_only."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
    from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
    from benchmarks import bench_loss  # pylint: disable=import-outside-toplevel
    from benchmarks import ring_steps  # pylint: disable=import-outside-toplevel
    a = self.args
    row = dict(kind=kind, n_dev=n, b_local=b, D=a.dims, dtype=a.dtype,
               backend=self.env["backend"])
    if self.over_budget():
      row["status"] = f"skipped (time budget {a.time_budget_s:.0f}s spent)"
      self.rows.append(row)
      return row
    name = f"{kind}_N{n}_b{b}"
    try:
      mesh = ring_steps.make_mesh(n)
      bs = bench_ring.block_sizes_of(vars(a))
      if kind in ("ring", "gather"):
        fn = ring_steps.train_step(kind, mesh, a.backend, bs)
      else:
        fn = ring_steps.overlap_steps(mesh, a.backend, bs)[kind]
      dtype = jnp.dtype(a.dtype)
      emb = jax.ShapeDtypeStruct((n * b, a.dims), dtype,
                                 sharding=NamedSharding(mesh, P(ring_steps.AXIS)))
      scalar = jax.ShapeDtypeStruct((), jnp.float32,
                                    sharding=NamedSharding(mesh, P()))
      t = time.time()
      compiled = fn.lower(emb, emb, scalar).compile()
      row["compile_s"] = round(time.time() - t, 2)
      row.update(bench_ring.mem_plan(compiled))
      hlo = compiled.as_text()
      opcodes = {i.name: i.op for instrs in ring_hlo.computations(hlo).values()
                 for i in instrs}
      if kind == "ring" and n > 1:
        lines = []
        n_async, n_over, n_sync = ring_hlo.report(hlo, out=lines.append)
        self.hlo[name] = dict(n_async=n_async, n_overlapped=n_over,
                              n_sync=n_sync, summary=lines[-1].strip())
        with open(os.path.join(a.out, f"ring_hlo_N{n}_b{b}.txt"), "w") as fh:
          fh.write("\n".join(lines) + "\n\n==== optimized, scheduled HLO "
                   "====\n" + hlo)
      x, y = ring_steps.make_inputs(mesh, b, a.dims, dtype)
      tt = jax.device_put(jnp.float32(ring_steps.LOGIT_SCALE),
                          NamedSharding(mesh, P()))
      t = harness.timeit(compiled, x, y, tt, warmup=1, budget_s=a.budget_s)
      sec, reps = t.median, t.reps
      row.update(status="ok", ms=sec * 1e3, reps=reps)
      if kind in ("ring", "gather"):
        row["loss"] = float(compiled(x, y, tt)[0])
      if (kind in self.profile_kinds and n in self.profile_ns
          and a.profile_steps > 0):
        # Kept apart: a profiler failure must not lose the timing.
        tdir = None
        try:
          tdir = profile(compiled, (x, y, tt), a.profile_steps, name)
          self.profiles[name] = summarize_trace(tdir, a.profile_steps,
                                                opcodes)
          row["profile"] = "ok" if self.profiles[name] else "no kernel events"
        except Exception as e:  # pylint: disable=broad-except
          row["profile"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        finally:
          if tdir:
            shutil.rmtree(tdir, ignore_errors=True)
      del x, y
    except Exception as e:  # pylint: disable=broad-except
      row["status"] = harness.failure(e)
    row["wall_s"] = round(time.time() - self.t0, 1)
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    self.save()
    return row

  def plain_compile(self, n, b):
    """The plain baseline, compiled (not run) in a child under a limit."""
    a = self.args
    left = (a.deadline_s - 5 - (time.time() - self.t0) if a.deadline_s
            else a.plain_compile_timeout_s)
    limit = int(min(a.plain_compile_timeout_s, left))
    if limit < 10:
      self.notes.append(f"plain N={n} b={b}: not compiled (time budget)")
      return
    spec = dict(kind="step", strategy="plain", n=n, b_local=b, d=a.dims,
                dtype=a.dtype, backend=a.backend, block_q=a.block_q,
                block_k=a.block_k, budget_s=0, run=False, fresh=True)
    t = time.time()
    r = bench_ring.spawn(spec, self.env["platform"], limit, limit)
    r["wall_s"] = round(time.time() - t, 1)
    r["limit_s"] = limit
    need = bench_ring.plain_min_bytes(n, b, a.dims, a.dtype) / 1e9
    r["lower_bound_gb"] = need
    self.env["plain_compile"] = dict(n=n, b_local=b, **r)
    self.notes.append(
        f"plain N={n} b={b} compile-only: {r.get('status')}"
        + (f", compile {r['compile_s']:.1f}s" if "compile_s" in r else "")
        + (f", XLA plan {r['xla_total_gb']:.3g} GB/dev with inputs"
           if r.get("xla_total_gb") is not None else "")
        + f" (lower bound {need:.3g} GB/dev)")
    self.save()


def _get(rows, kind, n, b):
  for r in rows:
    if (r["kind"], r["n_dev"], r["b_local"]) == (kind, n, b) and (
        r.get("status") == "ok"):
      return r
  return None


def _fmt_profile(prog, devs):
  lines = []
  for dev, s in devs.items():
    m = s["ms_per_step"]
    lines.append(
        f"  {prog} {dev}: busy {s['busy_ms']:.2f} ms/step ("
        + ", ".join(f"{c} {m[c]:.2f}" for c in CATEGORIES)
        + f"); collectives overlapping compute {s['overlap_ms']:.2f}, "
        f"kernels/step {s['n_kernels']:.0f}")
  return lines


def summary(diag):
  """The text summary: timings, efficiency, overlap, HLO, profile deltas."""
  a, rows = diag.args, diag.rows
  out = [f"{diag.env['date']}  {diag.env['n_devices']} x "
         f"{diag.env['device_kind']} ({diag.env['platform']}), jax "
         f"{diag.env['jax']}, backend {diag.env['backend']}, D={a.dims} "
         f"{a.dtype}, XLA_FLAGS={diag.env['xla_flags']!r}"]
  if diag.env["platform"] == "cpu":
    out.append("(CPU devices: a smoke test of the code paths, not GPU "
               "performance)")
  ns = sorted({r["n_dev"] for r in rows})
  for b in sorted({r["b_local"] for r in rows}, reverse=True):
    out.append(f"\nb_local = {b}:")
    for kind in ("ring", "gather", "compute_only", "transfer_only"):
      cells = []
      for n in ns:
        r = _get(rows, kind, n, b)
        if r:
          one = _get(rows, kind, 1, b)
          eff = (f", eff {one['ms'] * n / r['ms']:.0%}"
                 if one and n > 1 and kind in ("ring", "gather") else "")
          cells.append(f"N={n} {r['ms']:.2f} ms{eff}")
        else:
          st = [q.get("status") for q in rows
                if (q["kind"], q["n_dev"], q["b_local"]) == (kind, n, b)]
          if st:
            cells.append(f"N={n} {st[0]}")
      if cells:
        out.append(f"  {kind:13s} " + "; ".join(cells))
    n = max(ns)
    ring, comp, xfer = (_get(rows, k, n, b) for k in
                        ("ring", "compute_only", "transfer_only"))
    if ring and comp and xfer and n > 1:
      ov = bench_ring.overlap_numbers(ring["ms"], comp["ms"], xfer["ms"])
      out.append(f"  overlap N={n}: " + bench_ring.overlap_text(ov))
    one = _get(rows, "ring", 1, b)
    if comp and one and n > 1:
      out.append(f"  compute-only N={n} / (N x ring N=1) = "
                 f"{comp['ms'] / (n * one['ms']):.3f} (the tiles' own "
                 f"scaling, without transfers)")
    gat = _get(rows, "gather", n, b)
    if ring and gat:
      out.append(f"  gather / ring at N={n}: {gat['ms'] / ring['ms']:.3f}")
    h = diag.hlo.get(f"ring_N{n}_b{b}")
    if h:
      out.append(f"  HLO (ring N={n}): {h['summary']}")
    progs = [p for p in diag.profiles if p.endswith(f"_b{b}")]
    if progs:
      out.append("  profile, ms per step per device:")
      for p in progs:
        out += _fmt_profile(p, diag.profiles[p])
      rp, cp = (diag.profiles.get(f"{k}_N{n}_b{b}")
                for k in ("ring", "compute_only"))
      if rp and cp and ring and comp:
        out.append(f"  ring - compute-only at N={n}, by kind (first device):")
        rd, cd = next(iter(rp.values())), next(iter(cp.values()))
        deltas = {c: rd["ms_per_step"][c] - cd["ms_per_step"][c]
                  for c in CATEGORIES}
        idle_r = ring["ms"] - rd["busy_ms"]
        idle_c = comp["ms"] - cd["busy_ms"]
        out.append("    " + ", ".join(f"{c} {v:+.2f} ms"
                                      for c, v in deltas.items())
                   + f"; idle (step - busy) {idle_r - idle_c:+.2f} ms "
                   f"(ring {idle_r:.2f}, compute-only {idle_c:.2f}); step "
                   f"{ring['ms'] - comp['ms']:+.2f} ms")
        top = _top_deltas(rd["ops"], cd["ops"])
        if top:
          out.append("    largest per-op differences: " + "; ".join(
              f"{c}/{o} ({k}) {d:+.3f} ms" for (c, o, k), d in top))
  if diag.notes:
    out.append("\nnotes:")
    out += [f"  {x}" for x in diag.notes]
  return "\n".join(out)


def _top_deltas(ring_ops, comp_ops, k=8):
  agg = collections.Counter()
  for o in ring_ops:
    agg[(o["category"], o["op"], o["kernel"])] += o["ms_per_step"]
  for o in comp_ops:
    agg[(o["category"], o["op"], o["kernel"])] -= o["ms_per_step"]
  return sorted(agg.items(), key=lambda kv: -abs(kv[1]))[:k]


def main(argv=None):
  args = parse_args(argv)
  if not bench_ring.backend_started():
    bench_ring.set_flags(args.cpu_devices)
  elif args.cpu_devices:
    raise ValueError("--cpu-devices needs a process whose JAX backend has "
                     "not started yet")
  os.makedirs(args.out, exist_ok=True)
  import datetime  # pylint: disable=import-outside-toplevel
  info = bench_ring.probe(args.backend)
  diag = Diagnose(args)
  diag.env = dict(info, date=datetime.datetime.now(
      datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(["python", "benchmarks/ring_diagnose.py"]
                                   + list(argv if argv is not None
                                          else sys.argv[1:])))
  diag.profile_kinds = set(filter(None, args.profile.split(",")))
  ns = [int(v) for v in args.devices.split(",")
        if int(v) <= info["n_devices"]]
  diag.profile_ns = ({max(ns)} if args.profile_n == "max" and ns else
                     set(ns) if args.profile_n == "all" else
                     {int(v) for v in args.profile_n.split(",") if v})
  bs = [int(v) for v in args.b_local.split(",")]
  # Most informative first: the largest N (overlap, HLO, profile), then
  # N = 1 for the scaling, at each b in order.
  try:
    for b in bs:
      for n in ns:
        kinds = (["ring", "compute_only", "transfer_only", "gather"] if n > 1
                 else ["ring", "compute_only", "gather"])
        for kind in kinds:
          diag.case(kind, n, b)
    if args.plain_compile_timeout_s and ns:
      diag.plain_compile(max(ns), max(bs))
  except KeyboardInterrupt:  # E.g. `timeout -s INT`: keep what was measured.
    diag.notes.append(f"interrupted after {time.time() - diag.t0:.0f}s")
  text = summary(diag)
  with open(os.path.join(args.out, "summary.txt"), "w") as fh:
    fh.write(text + "\n")
  diag.save()
  print("\n" + text)
  return diag


if __name__ == "__main__":
  main()
