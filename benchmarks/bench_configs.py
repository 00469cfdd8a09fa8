"""The per-capability Pallas-Triton configs, timed on the GPU at hand.

  python benchmarks/bench_configs.py --smem_probe --out OUT

``backend="auto"`` picks ``BlockSizes`` by the GPU's shared memory per block
(``triton_tiles.CONFIGS``). A config that fits a smaller GPU runs
on a larger one too, so one H200 measures what each config (and each of
``CANDIDATES``) costs: one fwd+bwd step at B = 65,536, D = 768, bf16, both
losses, beside the formula's shared-memory estimate. ``--smem_probe`` also
compiles each kernel in a child with XLA's verbose log on and records the
shared memory XLA reports, to check the formula against the compiler.
Writes bench_configs.csv, bench_configs_meta.json and smem_probe.csv.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import harness  # noqa: E402
from infcl_jax.backends import capability  # noqa: E402
from infcl_jax.backends import triton_tiles as bsm  # noqa: E402
from infcl_jax.block_sizes import BlockSizes  # noqa: E402

# Alternatives with the same shared-memory budget as a CONFIGS entry
# (bf16 / f16 inputs): name -> (the entry whose limit it must fit, config).
CANDIDATES = {
    # sm80 budget, K-step 32: 128 x 256 forward with 4 stages (104 KB total)
    # and backward with 3 (144 KB total). 1.05x slower than smem163k on the
    # H200 (BENCHMARKS.md "Pallas configs for smaller GPUs").
    "smem163k_bd32": ("smem163k", BlockSizes(
        block_q=128, block_k=256, block_d=32, num_stages=4, bwd_block_q=128,
        bwd_block_k=256, bwd_num_stages=3, panel_rows=4096)),
    # sm86 budget with 8 warps per program: 1.00-1.03x slower than smem99k
    # (4 warps) on the H200.
    "smem99k_w8": ("smem99k", dataclasses.replace(
        bsm.CONFIGS["smem99k"][1], num_warps=8, bwd_num_warps=8)),
}

CASE_MARK = "SMEM_CASE "
_SMEM_LINE = re.compile(r"Shared memory usage: (\d+) B")
_SMEM_ERROR = re.compile(r"Shared memory size limit exceeded[^\n]*")


def capabilities_of(tier: str) -> str:
  """The compute capabilities whose default config is ``tier``."""
  caps = [cc for cc in sorted(capability.SMEM_PER_BLOCK)
          if cc >= (8, 0) and bsm.config_name(cc) == tier]
  return " ".join(f"sm{a}{b}" for a, b in caps)


def configs(dtype) -> dict[str, tuple[str, BlockSizes]]:
  """name -> (tier, BlockSizes) of every config and candidate for dtype."""
  wide = np.dtype(dtype).itemsize >= 4
  out = {name: (name, wide_bs if wide else narrow)
         for name, (_, narrow, wide_bs) in bsm.CONFIGS.items()}
  if not wide:
    out.update(CANDIDATES)
  return out


def describe(bs: BlockSizes) -> str:
  return (f"fwd {bs.block_q}x{bs.block_k}x{bs.block_d} s{bs.num_stages} "
          f"w{bs.num_warps}; bwd {bs.bwd_block_q}x{bs.bwd_block_k}"
          f"x{bs.block_d} s{bs.bwd_num_stages} w{bs.bwd_num_warps}")


def smem_columns(bs: BlockSizes, dtype, tier: str) -> dict:
  f = bsm.smem(bs, dtype, "fwd")
  b = bsm.smem(bs, dtype, "bwd")
  return dict(smem_limit=bsm.CONFIGS[tier][0],
              smem_fwd_peak=f.peak, smem_fwd_total=f.total,
              smem_bwd_peak=b.peak, smem_bwd_total=b.total)


# ------------------------------------------------------------------ timing

def time_case(loss, bs, b, d, dtype, reps, backend="pallas"):
  """(ms per fwd+bwd step, compile seconds, loss) with block sizes ``bs``."""
  x, y = harness.host_inputs(b, d, dtype)
  step, scalars = harness.loss_step(loss, backend, block_sizes=bs)
  args = (x, y, *scalars)
  compiled, compile_s = harness.aot(step, *args)
  val = float(compiled(*args)[0])
  t = harness.timeit(compiled, *args, reps=reps, warmup=1)
  return t.median * 1e3, compile_s, val


# ------------------------------------------------------------- smem probe

def probe_child(dtype_names, b, d):
  """Compiles each kernel alone; markers on stderr delimit XLA's log lines."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  for dname in dtype_names:
    dtype = jnp.dtype(dname)
    x = jax.ShapeDtypeStruct((b, d), dtype)
    r = jax.ShapeDtypeStruct((b,), jnp.float32)
    for name, (tier, bs) in configs(dtype).items():
      for family in ("softmax", "sigmoid"):
        be = registry.get("pallas", family)
        fns = ({"fwd": (lambda x, bs=bs: be.lse(
                    x, x, 1.0, 0.0, rows=True, cols=True, block_sizes=bs), (x,)),
                "bwd": (lambda x, r, bs=bs: be.lse_grad(
                    x, x, 1.0, 0.0, r, r, 0.5, 0.5, block_sizes=bs), (x, r))}
               if family == "softmax" else
               {"fwd": (lambda x, bs=bs: be.sigmoid_sum(
                   x, x, 1.0, 0.0, has_diagonal=True, block_sizes=bs), (x,)),
                "bwd": (lambda x, bs=bs: be.sigmoid_grad(
                    x, x, 1.0, 0.0, 1.0, has_diagonal=True, block_sizes=bs),
                        (x,))})
        for kernel, (fn, args) in fns.items():
          case = dict(config=name, tier=tier, dtype=dname, family=family,
                      kernel=kernel)
          print(CASE_MARK + json.dumps(case), file=sys.stderr, flush=True)
          try:
            jax.jit(fn).lower(*args).compile()
            status = "ok"
          except Exception as e:  # pylint: disable=broad-except
            status = harness.failure(e)
          print(CASE_MARK + json.dumps(dict(case, status=status, end=True)),
                file=sys.stderr, flush=True)


def parse_probe_log(text):
  """Rows of (case, status, what XLA reported) from a probe child's stderr."""
  rows, cur, seen = [], None, []
  for line in text.splitlines():
    if line.startswith(CASE_MARK):
      info = json.loads(line[len(CASE_MARK):])
      if info.get("end"):
        if cur is not None:
          bs = configs(info["dtype"])[info["config"]][1]
          est = bsm.smem(bs, info["dtype"], info["kernel"])
          rows.append(dict(
              {k: info[k] for k in ("config", "tier", "dtype", "family",
                                    "kernel", "status")},
              xla_reported=" ".join(seen),
              est_peak=est.peak, est_total=est.total,
              limit=bsm.CONFIGS[info["tier"]][0]))
        cur, seen = None, []
      else:
        cur, seen = info, []
    elif cur is not None:
      m = _SMEM_LINE.search(line)
      if m:
        seen.append(m.group(1))
      m = _SMEM_ERROR.search(line)
      if m:
        seen.append("LIMIT:" + m.group(0))
  return rows


def run_probe(out_dir, dtype_names, timeout_s):
  """Runs ``probe_child`` with XLA's VLOG level 2; returns rows."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_MAX_VLOG_LEVEL="2")
  cmd = [sys.executable, "-W", "ignore::DeprecationWarning", __file__,
         "--case", ",".join(dtype_names)]
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    text = proc.stderr
  except subprocess.TimeoutExpired as e:
    text = e.stderr or ""
    if isinstance(text, bytes):
      text = text.decode(errors="replace")
  rows = parse_probe_log(text)
  if rows:
    harness.write_csv(os.path.join(out_dir, "smem_probe.csv"), rows)
  print(f"smem probe: {len(rows)} kernels compiled, "
        f"{len(text.splitlines())} log lines read")
  return rows


# ------------------------------------------------------------------- main

def print_table(rows):
  print(f"{'config':15} {'for':28} {'loss':8} {'smem fwd/bwd KB (peak|total)':31}"
        f" {'ms':>8} {'TFLOP/s':>8} {'vs default':>10}")
  for r in rows:
    sm = (f"{r['smem_fwd_peak'] / 1024:.0f}|{r['smem_fwd_total'] / 1024:.0f} / "
          f"{r['smem_bwd_peak'] / 1024:.0f}|{r['smem_bwd_total'] / 1024:.0f}")
    print(f"{r['config']:15} {r['capabilities']:28} {r['loss']:8} {sm:31} "
          + (f"{r['ms']:8.2f} {r['tflops']:8.1f} {r['vs_default']:10.3f}"
             if r["status"] == "ok" else r["status"][:60]))


def main(argv=None):
  ap = harness.parser(__doc__, out=None)
  ap.add_argument("--b", type=int, default=65536)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--loss", default="softmax,sigmoid")
  ap.add_argument("--configs", default="",
                  help="comma-separated subset of the config names")
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--smem_probe", action="store_true")
  args = ap.parse_args(argv)
  if args.case:  # The shared-memory probe's child: its dtypes.
    probe_child(args.case.split(","), 512, 256)
    return []

  os.makedirs(args.out, exist_ok=True)
  info = capability.device_info()
  meta = dict(harness.device_meta(),
              capability=None if info is None else info.capability,
              B=args.b, D=args.d, dtype=args.dtype, reps=args.reps,
              flops_per_step="8 * B^2 * D")
  with open(os.path.join(args.out, "bench_configs_meta.json"), "w") as f:
    json.dump(meta, f, indent=1)
  print(json.dumps(meta))

  todo = configs(args.dtype)
  if args.configs:
    todo = {k: v for k, v in todo.items() if k in args.configs.split(",")}
  rows = []
  flops = 8.0 * args.b * args.b * args.d
  default = {}
  for loss in args.loss.split(","):
    for name, (tier, bs) in todo.items():
      row = dict(config=name, capabilities=capabilities_of(tier), loss=loss,
                 dtype=args.dtype, B=args.b, D=args.d, blocks=describe(bs),
                 **smem_columns(bs, args.dtype, tier))
      try:
        ms, compile_s, val = time_case(loss, bs, args.b, args.d, args.dtype,
                                       args.reps)
        if name == "smem227k":
          default[loss] = ms
        ref = default.get(loss)
        row.update(status="ok", ms=round(ms, 3),
                   tflops=round(flops / (ms * 1e-3) / 1e12, 1),
                   vs_default=round(ms / ref, 3) if ref else float("nan"),
                   compile_s=round(compile_s, 1), loss_value=val)
      except Exception as e:  # pylint: disable=broad-except
        row.update(status=harness.failure(e))
      rows.append(row)
      print(json.dumps(row), flush=True)
      harness.write_csv(os.path.join(args.out, "bench_configs.csv"), rows)
  print_table(rows)
  if args.smem_probe:
    run_probe(args.out, ("bfloat16", "float32"), timeout_s=120)
  return rows


if __name__ == "__main__":
  main()
