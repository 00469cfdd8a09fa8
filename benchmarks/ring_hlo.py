"""Does the ring's transfer overlap its compute? Read the scheduled HLO.

Compiles fwd+bwd of the ring loss over the visible devices and walks the
optimized, scheduled HLO: for every collective-permute (``-start``/``-done``,
or a generic ``async-start``/``async-done`` around one) whether XLA made it
asynchronous, and which kernels the schedule puts between start and done
(inside loops and calls there too, recursively): the work that can hide the
transfer. ``"is_sync":true`` is flagged (XLA then runs it on the compute
stream). The parser never raises on unfamiliar text; what it cannot read is
"?".

  python benchmarks/ring_hlo.py --cpu-devices 8   # synchronous on CPUs
  python benchmarks/ring_hlo.py --batch-per-device 8192 --dim 768 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position

# Ops that launch work on the device (after fusion, nearly every kernel is a
# fusion or a custom call).
COMPUTE_OPS = ("fusion", "dot", "convolution", "custom-call", "reduce",
               "scatter", "gather", "sort", "reduce-window",
               "select-and-scatter", "fft", "triangular-solve", "cholesky")
# Ops whose called computations run where the op is scheduled.
CONTAINER_OPS = ("while", "call", "conditional", "async-start")
COLLECTIVE_PREFIXES = ("all-reduce", "all-gather", "reduce-scatter",
                       "all-to-all", "collective-permute", "collective-broadcast",
                       "ragged-all-to-all", "send", "recv")

_DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5,
                "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16, "token": 0}
# ``name = rhs``: XLA prints spaces round the '=' (attributes have none).
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+(.*)$")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|"
                     r"false_computation)=%?([\w.\-]+)")
_CALLED_LIST = re.compile(r"\b(calls|branch_computations|called_computations)"
                          r"=\{([^}]*)\}")
_COMMENT = re.compile(r"/\*.*?\*/")


class Instr(collections.namedtuple(
    "Instr", "name op type operands called line")):
  """One HLO instruction: name, opcode ("?" if unreadable), result type
  text, operand names, called computation names, the raw text."""


def _balanced(text, start, open_ch="(", close_ch=")"):
  """Index just past the bracket group opening at text[start], or -1."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == open_ch
    depth -= text[i] == close_ch
    if depth == 0:
      return i + 1
  return -1


def _split_top(text):
  """Splits at commas outside (), {} and []."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return parts


def parse_instr(rhs):
  """(type, opcode, operands, called, rest) of ``TYPE opcode(ops), attrs``.

  Never raises: unreadable parts come back as "?" / empty.
  """
  rhs = _COMMENT.sub("", rhs).strip()
  typ, rest = "?", rhs
  if rhs.startswith("("):  # Tuple type, possibly nested.
    end = _balanced(rhs, 0)
    if end > 0:
      typ, rest = rhs[:end], rhs[end:]
  else:
    m = re.match(r"(\S+)\s+(.*)$", rhs)
    if m:
      typ, rest = m.group(1), m.group(2)
  m = re.match(r"\s*([a-z][a-z0-9\-_]*)\(", rest)
  if not m:  # Unfamiliar type syntax: take the first `opcode(` after a space.
    m = re.search(r"(?:^|\s)([a-z][a-z0-9\-_]*)\(", rhs)
    if not m:
      return typ, "?", [], [], rest
    rest = rhs[m.start():].lstrip()
    m = re.match(r"([a-z][a-z0-9\-_]*)\(", rest)
  op = m.group(1)
  open_at = rest.index("(", m.start(1))
  end = _balanced(rest, open_at)
  if end < 0:
    return typ, op, [], [], rest
  operands = []
  for part in _split_top(rest[open_at + 1:end - 1]):
    names = re.findall(r"%([\w.\-]+)", part)
    if names:
      operands.append(names[-1])
    elif part.strip():
      operands.append(part.split()[-1])
  attrs = rest[end:]
  called = [m2.group(2) for m2 in _CALLED.finditer(attrs)]
  for m2 in _CALLED_LIST.finditer(attrs):
    called += [c.strip().lstrip("%") for c in m2.group(2).split(",")
               if c.strip()]
  return typ, op, operands, called, attrs


def computations(hlo):
  """{name: [Instr]} in schedule order (the printed order of a scheduled
  module). Continuation lines (an instruction printed over several lines)
  are joined to their instruction."""
  comps, name, pending = collections.OrderedDict(), None, None

  def flush():
    if pending is not None:
      iname, rhs = pending
      typ, op, operands, called, _ = parse_instr(rhs)
      comps[name].append(Instr(iname, op, typ, operands, called,
                               f"{iname} = {rhs}"))

  for line in hlo.splitlines():
    if name is None:
      m = _HEADER.match(line)
      if m and not _INSTR.match(line) and not line.lstrip().startswith(
          "HloModule"):
        name = m.group(1)
        comps[name] = []
        pending = None
      continue
    if line.lstrip().startswith("}"):
      flush()
      name, pending = None, None
      continue
    m = _INSTR.match(line)
    if m:
      flush()
      pending = (m.group(1), m.group(2))
    elif pending is not None and line.strip():
      pending = (pending[0], pending[1] + " " + line.strip())
  if name is not None:
    flush()
  return comps


def _arrays(typ):
  """[(dtype, dims)] of the arrays in a type text; None if unreadable."""
  out = []
  for dt, dims in re.findall(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z]*)?)"
                             r"\[([^\]]*)\]", typ or ""):
    try:
      shape = [int(d) for d in dims.split(",") if d.strip()]
    except ValueError:
      return None
    out.append((dt, shape))
  return out or None


def describe_size(typ):
  """'bf16[8192,768] (12.6 MB)' for the arrays of a type; '?' if unknown."""
  arrays = _arrays(typ)
  if not arrays:
    return "?"
  total, parts = 0.0, []
  for dt, shape in arrays:
    if dt == "token":
      continue
    n = 1
    for d in shape:
      n *= d
    per = _DTYPE_BYTES.get(dt)
    if per is None and re.match(r"f8|f4|f6", dt):
      per = 1
    total = None if (per is None or total is None) else total + n * per
    parts.append(f"{dt}[{','.join(map(str, shape))}]")
  if not parts:
    return "?"
  size = "?" if total is None else (f"{total / 1e6:.3g} MB" if total >= 1e5
                                    else f"{total / 1e3:.3g} kB")
  return f"{' + '.join(parts)} ({size})"


def _is_collective(op):
  return op.startswith(COLLECTIVE_PREFIXES)


def _kernels(comps, instrs, seen=None):
  """(direct kernel counts, nested kernel counts, collectives) of a list of
  instructions; nested = inside the computations called by containers."""
  seen = set() if seen is None else seen
  direct, nested, colls = (collections.Counter(), collections.Counter(),
                           collections.Counter())
  for ins in instrs:
    if ins.op in COMPUTE_OPS:
      direct[ins.op] += 1
    if _is_collective(ins.op):
      colls[ins.op] += 1
    if ins.op in CONTAINER_OPS:
      for c in ins.called:
        if c in comps and c not in seen:
          seen.add(c)
          d, n, k = _kernels(comps, comps[c], seen)
          nested.update(d)
          nested.update(n)
          colls.update(k)
  return direct, nested, colls


def _async_wraps_permute(comps, ins):
  return ins.op == "async-start" and any(
      i.op in ("collective-permute", "collective-permute-start")
      for c in ins.called for i in comps.get(c, []))


def _find_done(instrs, i, done_ops, chain_ops=()):
  """Index of the done of instrs[i], following async-update chains."""
  current = instrs[i].name
  for j in range(i + 1, len(instrs)):
    ins = instrs[j]
    if current in ins.operands:
      if ins.op in done_ops:
        return j
      if ins.op in chain_ops:
        current = ins.name
  return None


def analyze(hlo):
  """Every collective-permute of the module, as a list of dicts:

  kind ("async" or "sync"), computation, in_loop (a while body), name,
  done (name or None), size, is_sync (XLA's async op run synchronously),
  spelling, between_direct / between_nested (kernel Counters), colls_between,
  overlapped (any kernel between).
  """
  comps = computations(hlo)
  loop_bodies, wrapped = set(), set()
  for instrs in comps.values():
    for ins in instrs:
      if ins.op == "while":
        m = re.search(r"\bbody=%?([\w.\-]+)", ins.line)
        if m:
          loop_bodies.add(m.group(1))
      if ins.op == "async-start":
        wrapped.update(ins.called)
  found = []
  for cname, instrs in comps.items():
    for i, ins in enumerate(instrs):
      rec = dict(computation=cname, in_loop=cname in loop_bodies,
                 name=ins.name, done=None, is_sync=False)
      if ins.op == "collective-permute":
        if cname in wrapped:  # The body of an async-start: counted there.
          continue
        found.append(dict(rec, kind="sync", spelling="collective-permute",
                          size=describe_size(ins.type)))
        continue
      if ins.op == "collective-permute-start":
        j = _find_done(instrs, i, ("collective-permute-done",))
        spelling = "collective-permute-start/done"
      elif _async_wraps_permute(comps, ins):
        j = _find_done(instrs, i, ("async-done",), ("async-update",))
        spelling = "async-start/done(collective-permute)"
      else:
        continue
      done_type = instrs[j].type if j is not None else ""
      direct, nested, colls = _kernels(
          comps, instrs[i + 1:j] if j is not None else [])
      found.append(dict(
          rec, kind="async", spelling=spelling,
          done=instrs[j].name if j is not None else None,
          size=describe_size(done_type) if j is not None else "?",
          is_sync=bool(re.search(r'"is_sync"\s*:\s*true', ins.line)),
          between_direct=direct, between_nested=nested, colls_between=colls,
          overlapped=bool(direct or nested)))
  return found


def _fmt(counter):
  return ", ".join(f"{k}: {v}" for k, v in sorted(counter.items())) or "none"


def report(hlo, out=print):
  """Prints one line per collective-permute and a summary; returns
  (n_async, n_overlapped, n_sync)."""
  found = analyze(hlo)
  n_async = n_sync = n_overlapped = 0
  for r in found:
    where = (f"{'while body' if r['in_loop'] else 'computation'} "
             f"{r['computation']}")
    if r["kind"] == "sync":
      n_sync += 1
      out(f"[sync ] {where}: {r['name']} {r['size']}")
      continue
    n_async += 1
    n_overlapped += r["overlapped"]
    flags = " [is_sync: XLA runs it on the compute stream]" if r["is_sync"] else ""
    if r["done"] is None:
      out(f"[async] {where}: {r['name']} ({r['spelling']}) -> done not found "
          f"in this computation (pipelined across a loop boundary?){flags}")
      continue
    n_k = sum(r["between_direct"].values()) + sum(r["between_nested"].values())
    extra = (f"; collectives between: {_fmt(r['colls_between'])}"
             if r["colls_between"] else "")
    out(f"[async] {where}: {r['name']} {r['size']} -> {r['done']}; between: "
        + (f"{n_k} kernels (direct: {_fmt(r['between_direct'])}; in called "
           f"loops/calls: {_fmt(r['between_nested'])})" if n_k
           else "no compute") + extra + flags)
  n_is_sync = sum(r.get("is_sync", False) for r in found)
  out(f"\nsummary: {n_async} async collective-permute start/done pairs "
      f"({n_overlapped} with compute scheduled between start and done"
      + (f", {n_is_sync} marked is_sync" if n_is_sync else "")
      + f"), {n_sync} synchronous collective-permutes")
  return n_async, n_overlapped, n_sync


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="force this many host CPU devices (sets XLA_FLAGS)")
  p.add_argument("--batch-per-device", type=int, default=256)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--dtype", default="float32")
  args = p.parse_args()
  harness.set_xla_flags(args.cpu_devices)
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks import ring_steps  # pylint: disable=import-outside-toplevel
  n = len(jax.devices())
  step = ring_steps.train_step("ring", ring_steps.make_mesh(n), "auto", None)
  emb = jax.ShapeDtypeStruct((n * args.batch_per_device, args.dim), args.dtype)
  hlo = step.lower(emb, emb, jax.ShapeDtypeStruct((), "float32")).compile(
      ).as_text()
  print(f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind}, "
        f"b={args.batch_per_device}, D={args.dim}, {args.dtype}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}\n")
  report(hlo)

if __name__ == "__main__":
  main()
