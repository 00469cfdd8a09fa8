"""Does the ring's transfer overlap its compute? Read the scheduled HLO.

Compiles fwd+bwd of ``sharded_contrastive_loss`` (ring strategy) over all
visible devices and walks the optimized, scheduled HLO: for every
collective-permute it reports whether XLA made it asynchronous
(collective-permute-start / -done) and which compute ops (fusions, dots,
custom calls such as Pallas kernels, nested loops) the schedule places
between the start and its done -- the work that hides the transfer.

  # 8 host CPU devices (the CPU runtime keeps collectives synchronous):
  python benchmarks/ring_hlo.py --cpu-devices 8
  # GPUs (the latency hiding scheduler flag is added unless already set):
  python benchmarks/ring_hlo.py --batch-per-device 8192 --dim 768 --dtype bfloat16

Prints one line per collective-permute and a summary; --dump FILE writes
the whole HLO text.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

COMPUTE_OPS = ("fusion", "dot", "convolution", "custom-call", "while", "call",
               "conditional")


def parse_args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="force this many host CPU devices (sets XLA_FLAGS)")
  p.add_argument("--batch-per-device", type=int, default=256)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--direction", default="both")
  p.add_argument("--backend", default="auto")
  p.add_argument("--block-q", type=int, default=0)
  p.add_argument("--block-k", type=int, default=0)
  p.add_argument("--dump", default="", help="write the optimized HLO here")
  return p.parse_args()


def set_flags(args):
  """XLA reads XLA_FLAGS once, when the backend starts: before importing jax."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  if args.cpu_devices:
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={args.cpu_devices}")
  elif not any("xla_gpu_enable_latency_hiding_scheduler" in f for f in flags):
    flags.append("--xla_gpu_enable_latency_hiding_scheduler=true")
  os.environ["XLA_FLAGS"] = " ".join(flags)


_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")


def _opcode(rhs):
  """Opcode of an instruction's right-hand side ``TYPE opcode(...)...``."""
  rhs = rhs.strip()
  if rhs.startswith("("):  # A tuple type: skip to its closing parenthesis.
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        rhs = rhs[i + 1:]
        break
  else:
    rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
  m = re.match(r"\s*([a-z][a-z0-9\-]*)\(", rhs)
  return m.group(1) if m else "?"


def computations(hlo):
  """{name: [(instr_name, opcode, line)]} in schedule order."""
  comps, name = collections.OrderedDict(), None
  for line in hlo.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m and "=" not in line.split("(")[0]:
        name = m.group(2)
        comps[name] = []
      continue
    if line.startswith("}"):
      name = None
      continue
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*)$", line)
    if m:
      comps[name].append((m.group(1), _opcode(m.group(2)), line))
  return comps


def report(hlo):
  comps = computations(hlo)
  loop_bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
  n_async = n_sync = n_overlapped = 0
  for cname, instrs in comps.items():
    where = "while body" if cname in loop_bodies else "computation"
    for i, (iname, op, line) in enumerate(instrs):
      size = re.search(r"= \(?([a-z0-9]+\[[^\]]*\])", line).group(1)
      if op == "collective-permute":
        n_sync += 1
        print(f"[sync ] {where} {cname}: {iname} {size}")
      elif op == "collective-permute-start":
        n_async += 1
        done = next((j for j in range(i + 1, len(instrs))
                     if instrs[j][1] == "collective-permute-done"
                     and f"%{iname})" in instrs[j][2]), None)
        between = [o for _, o, _ in instrs[i + 1:done]] if done else []
        compute = collections.Counter(o for o in between if o in COMPUTE_OPS)
        n_overlapped += bool(compute)
        print(f"[async] {where} {cname}: {iname} {size} -> "
              f"{instrs[done][0] if done else 'done not found'}; between: "
              f"{dict(compute) or 'no compute'}")
  print(f"\nsummary: {n_async} async collective-permute start/done pairs "
        f"({n_overlapped} with compute scheduled between start and done), "
        f"{n_sync} synchronous collective-permutes")
  return n_async, n_overlapped, n_sync


def main():
  args = parse_args()
  set_flags(args)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from infcl_jax import BlockSizes, sharded_contrastive_loss  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  n = len(devices)
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  bs = (BlockSizes(block_q=args.block_q, block_k=args.block_k)
        if args.block_q and args.block_k else None)
  grad = jax.jit(jax.grad(
      lambda x, y, t: sharded_contrastive_loss(
          x, y, t, mesh=mesh, direction=args.direction, backend=args.backend,
          block_sizes=bs), argnums=(0, 1, 2)))
  emb = jax.ShapeDtypeStruct((n * args.batch_per_device, args.dim),
                             jnp.dtype(args.dtype))
  compiled = grad.lower(emb, emb, jax.ShapeDtypeStruct((), jnp.float32)).compile()
  hlo = compiled.as_text()
  print(f"jax {jax.__version__}, {n} x {devices[0].platform} "
        f"({devices[0].device_kind}), b={args.batch_per_device}, "
        f"D={args.dim}, {args.dtype}, XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}\n")
  if args.dump:
    with open(args.dump, "w") as f:
      f.write(hlo)
  report(hlo)


if __name__ == "__main__":
  main()
