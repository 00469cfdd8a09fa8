"""What every benchmark script shares, one home each: timing, the device
and run meta, inputs and the loss step, the shared options (``parser``),
rows on disk with resume (``Rows``), the run's time budget (``Budget``),
cases in child processes (``run_child``: the device's peak counter and the
allocator start from zero, a crash or a hang costs one case), the host
memory of a process tree, and probe items (``record`` / ``summary``).

Scripts import it as ``from benchmarks import harness``.
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Timing = collections.namedtuple("Timing", "median min max reps")


def timeit(fn, *args, reps=7, inner=1, warmup=2, budget_s=None):
  """Seconds per call of ``fn(*args)``, device-synchronized.

  ``warmup`` calls first (the first compiles, unless ``fn`` is compiled);
  then ``reps`` timed runs of ``inner`` back-to-back calls each, synced at
  the end of each run. With ``budget_s``, the runs are as many as fit in it
  at the last warm-up call's time (at least 1, at most ``reps``).

  Returns:
    ``Timing(median, min, max, reps)``, seconds per call.
  """
  import jax  # pylint: disable=import-outside-toplevel
  last = 0.0
  for _ in range(warmup):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    last = time.perf_counter() - t0
  if budget_s is not None:
    reps = int(max(1, min(reps, budget_s // max(last, 1e-6))))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / inner)
  return Timing(statistics.median(ts), min(ts), max(ts), reps)


def aot(fn, *args):
  """(``fn`` (jitted) compiled ahead of time for ``args``, the seconds the
  lowering and compilation took)."""
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def report(name, flops, t):
  """One line: median ms, [min-max], TFLOP/s of ``flops`` at the median."""
  print(f"{name:44s} {t.median * 1e3:8.3f} ms  [{t.min * 1e3:.3f}-"
        f"{t.max * 1e3:.3f}]  {flops / t.median / 1e12:7.1f} TFLOP/s",
        flush=True)


# ------------------------------------------------------ device and run

def now():
  """UTC, to the second (the date of a row)."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")


def device_meta():
  """What a row's figures ran on: date, device, platform, count, jax."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  devs = jax.devices()
  limit = (device_bytes("bytes_limit", devs[:1]) or [0])[0] / 1e9
  return dict(date=now(), device_kind=devs[0].device_kind,
              platform=devs[0].platform, n_devices=len(devs),
              jax=jax.__version__, jaxlib=jaxlib.__version__,
              bytes_limit_gb=limit or None,
              xla_flags=os.environ.get("XLA_FLAGS", ""))


def device_bytes(key, devices=None):
  """``memory_stats()[key]`` of each device (default: the local ones), or
  None where a device keeps no such figure (CPU devices keep none)."""
  import jax  # pylint: disable=import-outside-toplevel
  vals = [(d.memory_stats() or {}).get(key)
          for d in devices or jax.local_devices()]
  return None if any(v is None for v in vals) else vals


def print_device():
  """A probe log's first line: jax and the devices."""
  import jax  # pylint: disable=import-outside-toplevel
  print("jax", jax.__version__, jax.devices(), flush=True)


def set_xla_flags(cpu_devices=0):
  """Sets ``xla_env`` before JAX starts its backend (XLA reads it once)."""
  os.environ.update(xla_env(cpu_devices))


def xla_env(cpu_devices=0, env=None):
  """XLA_FLAGS for ``cpu_devices`` simulated CPU devices (and JAX_PLATFORMS),
  or else with the ring's recommended GPU flags (``infcl_jax.xla_flags``)
  added to those of ``env`` (default: this process's environment)."""
  flags = (env or os.environ).get("XLA_FLAGS", "").split()
  if cpu_devices:
    flags = [f for f in flags
             if "xla_force_host_platform_device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={cpu_devices}")
    return dict(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  from infcl_jax import xla_flags  # pylint: disable=import-outside-toplevel
  return dict(XLA_FLAGS=xla_flags.recommended(" ".join(flags)))


def mem_plan(compiled):
  """XLA's per-device memory plan of a compiled program, in GB: temporaries
  (``xla_temp_gb``), outputs + temporaries, i.e. beyond the inputs
  (``xla_plan_gb``, comparable with a runtime peak beyond the inputs), and
  with the inputs (``xla_total_gb``, what must fit). {} where XLA has none."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return {}
  if m is None:
    return {}
  total = (m.argument_size_in_bytes + m.output_size_in_bytes
           + m.temp_size_in_bytes - m.alias_size_in_bytes)
  return dict(xla_temp_gb=m.temp_size_in_bytes / 1e9,
              xla_plan_gb=(total - m.argument_size_in_bytes) / 1e9,
              xla_total_gb=total / 1e9)


# ------------------------------------------------------ inputs and steps

def host_inputs(b, d, dtype, seed=0):
  """Unit-norm (b, d) images and texts of ``dtype``, drawn on the host and
  put on the device: no device temporaries raise the peak counter."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)

  def make():
    v = rng.standard_normal((b, d), dtype=np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return jax.block_until_ready(jax.device_put(v.astype(dtype)))
  return make(), make()


def inputs(b, d, dtype, seed=0, m=None):
  """Unit-norm random (b, d) images and (m or b, d) texts of ``dtype``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (b, d), jnp.float32)
  y = jax.random.normal(k2, (m or b, d), jnp.float32)
  x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
  y = y / jnp.linalg.norm(y, axis=1, keepdims=True)
  return x.astype(dtype), y.astype(dtype)


# Logit scale and bias of a timed step: CLIP-like for softmax, SigLIP's
# initialisation for sigmoid.
LOSS_SCALE_BIAS = {"softmax": (20.0, 0.0), "sigmoid": (10.0, -10.0)}


def loss_step(loss, backend, **kw):
  """(jit of fwd+bwd, its scale and bias): the value and the gradients of
  both embeddings, the scale and the bias of ``contrastive_loss``
  ("softmax") or ``sigmoid_loss``; ``kw`` goes to the loss."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import infcl_jax  # pylint: disable=import-outside-toplevel
  if loss == "softmax":
    f = lambda x, y, t, b: infcl_jax.contrastive_loss(  # noqa: E731
        x, y, t, logit_bias=b, backend=backend, **kw)
  elif loss == "sigmoid":
    f = lambda x, y, t, b: infcl_jax.sigmoid_loss(  # noqa: E731
        x, y, t, b, backend=backend, **kw)
  else:
    raise ValueError(f"loss must be softmax or sigmoid, got {loss!r}")
  t, b = LOSS_SCALE_BIAS[loss]
  return (jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3))),
          (jnp.float32(t), jnp.float32(b)))


def lit_step(mesh, tower, text_tower, batch, microbatch, precomputed,
             loss_dtype=None):
  """(jitted train step, its state, the loss head) of the trainer's own LiT
  step (``train.step``) as bench_train and bench_towers time it: GradCache
  micro-batches over the text tower, the softmax head, AdamW with the
  locked image tower ``tower`` masked out (``lit_steps``)."""
  make_step, state, head = lit_steps(mesh, tower, text_tower, batch,
                                     precomputed, loss_dtype)
  return make_step(microbatch), state, head


def lit_steps(mesh, tower, text_tower, batch, precomputed, loss_dtype=None):
  """(``make_step(microbatch)`` -> jitted train step, the state they share,
  the loss head): ``lit_step`` for any micro-batch, e.g. to size it
  (train/memory.py) without a state per size. ``loss_dtype``: the
  trainer's config.loss.dtype (None: the embeddings' promoted dtype)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from infcl_jax.flax import ContrastiveLoss  # pylint: disable=import-outside-toplevel
  from train import optim  # pylint: disable=import-outside-toplevel
  from train import step as step_lib  # pylint: disable=import-outside-toplevel
  head = ContrastiveLoss(loss="softmax", backend="auto")
  k = jax.random.split(jax.random.key(0), 2)
  e = jnp.zeros((2, tower.embed_dim))
  tokens = jnp.ones((1, text_tower.max_len), jnp.int32)
  params = {"img": tower.params,
            "txt": jax.jit(text_tower.init)(k[0], tokens)["params"],
            "head": head.init(k[1], e, e)["params"]}
  schedule = optim.make_schedule(lr=1e-4, total_steps=100, warmup_steps=10)
  opt = optim.make_optimizer(name="adamw", schedule=schedule,
                             weight_decay=1e-4, grad_clip_norm=1.0,
                             params=params, image_locked=True)

  def make_step(microbatch):
    grad_fn = step_lib.make_grad_fn(
        mesh=mesh, image_tower=tower, text_tower=text_tower, head=head,
        microbatch_size=microbatch, global_batch=batch,
        precomputed=precomputed, image_locked=True, loss_dtype=loss_dtype)
    return step_lib.make_train_step(grad_fn=grad_fn, head=head,
                                    optimizer=opt, schedule=schedule)
  return make_step, step_lib.init_state(mesh, params, opt), head


def rel(a, b):
  """Relative norm error of ``a`` against ``b``, in float64."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------- options

# The options that mean the same in every script (the default is the
# script's): the folder of its rows, resuming there, the seconds of timed
# repetitions per case, a case's deadline.
SHARED = {
    "out": ("--out", dict(help="folder for the rows (required)")),
    "resume": ("--resume", dict(
        action="store_true", help="keep the finished cases of an earlier "
        "run in --out (the rows are written after every case), run the "
        "rest")),
    "budget_s": ("--budget-s", dict(
        type=float, help="seconds of timed repetitions per case")),
    "timeout_s": ("--timeout-s", dict(
        type=int, help="deadline of a case, in seconds")),
}


class _Parser(argparse.ArgumentParser):
  """--out is required, except in a child (``--case``: its parent writes)."""

  def parse_args(self, args=None, namespace=None):  # pylint: disable=arguments-differ
    a = super().parse_args(args, namespace)
    if "out" in vars(a) and not (a.out or a.case):
      self.error("--out is required (the folder for the rows)")
    return a


def parser(doc, **defaults):
  """An ArgumentParser described by ``doc``'s first paragraph, with the
  ``SHARED`` options named in ``defaults`` (the value: the default) and the
  hidden ``--case`` of a child process."""
  ap = _Parser(description=doc.split("\n\n")[0])
  for name, default in defaults.items():
    flag, kw = SHARED[name]
    if kw.get("action") != "store_true":
      kw = dict(kw, default=default)
    ap.add_argument(flag, **kw)
  ap.add_argument("--case", help=argparse.SUPPRESS)
  return ap


def ints(text):
  """Comma-separated ints ("" means none)."""
  return [int(x) for x in text.split(",") if x.strip()]


def parse_quick(ap, quick, args=None):
  """``ap.parse_args(args)`` with a ``--quick`` option added: a CPU smoke
  run, where ``quick`` (dest: value) replaces the defaults of the options
  not given on the command line (explicit ones still win)."""
  sizes = ", ".join(f"{k}={v!r}" for k, v in quick.items())
  ap.add_argument("--quick", action="store_true",
                  help="a CPU smoke run: " + sizes.replace("%", "%%"))
  if ap.parse_known_args(args)[0].quick:
    ap.set_defaults(**quick)
  return ap.parse_args(args)


# ------------------------------------------------------------- rows

def write_csv(path, rows, fields=None):
  """``rows`` (dicts) as a CSV: ``fields`` or every key, in first-seen
  order; floats to 7 significant digits."""
  fields = fields or list(dict.fromkeys(k for r in rows for k in r))
  with open(path, "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: (f"{v:.7g}" if isinstance(v, float) else v)
                  for k, v in r.items()})


def read_jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as fh:
    return [json.loads(line) for line in fh if line.strip()]


def append_jsonl(path, row):
  with open(path, "a") as fh:
    fh.write(json.dumps(row) + "\n")


class Rows:
  """A run's rows, on disk after every row: ``NAME.jsonl`` (the log, and
  what ``resume`` reads back) and, with ``fields``, ``NAME.csv`` (the table:
  this run's rows, then the earlier ones it did not reach).

  With ``resume``, the earlier run's rows whose status ``keep`` accepts are
  offered back by ``earlier(row)`` (by ``key``); the rest run again.
  """

  def __init__(self, out, name, *, key, resume=False, keep=None,
               fields=None):
    os.makedirs(out, exist_ok=True)
    self.jsonl = os.path.join(out, name + ".jsonl")
    self.csv = os.path.join(out, name + ".csv") if fields else None
    self.key, self.fields, self.rows, self.done = key, fields, [], {}
    if resume:
      for r in read_jsonl(self.jsonl):
        if keep is None or keep(r.get("status", "")):
          self.done[key(r)] = r
    with open(self.jsonl, "w") as fh:
      fh.writelines(json.dumps(r) + "\n" for r in self.done.values())

  def earlier(self, row):
    """The earlier run's row of ``row``'s case, taken as this run's; or
    None."""
    r = self.done.pop(self.key(row), None)
    if r is not None:
      self.rows.append(r)
      print(json.dumps(r), flush=True)
    return r

  def add(self, row):
    self.rows.append(row)
    print(json.dumps(row), flush=True)
    append_jsonl(self.jsonl, row)
    self.write()
    return row

  def write(self):
    if self.csv:
      write_csv(self.csv, self.rows + list(self.done.values()), self.fields)


class Budget:
  """The seconds a whole run may take (None: no limit), from now."""

  def __init__(self, seconds):
    self.seconds, self.t0 = seconds, time.time()

  def elapsed(self):
    return time.time() - self.t0

  def left(self):
    return float("inf") if self.seconds is None else (
        self.seconds - self.elapsed())

  def skip(self, need_s=0.0):
    """Why a case that needs ``need_s`` does not start, or None."""
    left = self.left()
    if self.seconds is None or (left > 0 and left >= need_s):
      return None
    return (f"skipped: {max(left, 0):.0f} s of the {self.seconds:.0f} s "
            f"budget left, needs ~{need_s:.0f} s")

  def deadline(self, cap_s, grace_s=0.0, floor_s=1.0):
    """A case's deadline: its own ``cap_s``, within what is left (plus
    ``grace_s``), at least ``floor_s``."""
    return max(floor_s, min(cap_s, self.left() + grace_s))


# ------------------------------------------------------------- children

def is_oom(e) -> bool:
  """Whether an exception (or a child's output text) is out of memory."""
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower()


def oom_status(e, phase: str = "run") -> str:
  """A row's status for an out-of-memory ``e`` (or a child's output) in
  ``phase``: "oom: " and ``train.memory.oom_line`` (which memory, how much
  was asked for, what the device held), never a bare "oom"."""
  from train import memory  # pylint: disable=import-outside-toplevel
  device = None
  if not isinstance(e, str) and "RESOURCE_EXHAUSTED" in str(e):  # JAX's
    try:
      import jax  # pylint: disable=import-outside-toplevel
      device = jax.local_devices()[0]
    except Exception:  # pylint: disable=broad-except
      device = None
  return "oom: " + memory.oom_line(e, phase, device)


def failure(e, phase: str = "run"):
  """The status of a case that raised ``e`` in ``phase``: "oom: ..."
  (``oom_status``) or "error: ..."."""
  if is_oom(e):
    return oom_status(e, phase)
  return f"error: {type(e).__name__}: {str(e)[:300]}"


def child_env(**extra):
  """The environment of a child: this one, unbuffered, with the repository
  root importable; ``extra`` entries set (a None value removes one)."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  for k, v in extra.items():
    if v is None:
      env.pop(k, None)
    else:
      env[k] = v
  return env


RESULT_TAG = "BENCH_RESULT "


def print_result(result):
  """A child's last word: its result, for ``run_child``."""
  print(RESULT_TAG + json.dumps(result), flush=True)


def run_child(argv, *, timeout_s, result_tag=RESULT_TAG, env=None,
              phase_tag=None, compile_timeout_s=0, echo_tag=None):
  """Runs ``python argv...`` in a fresh process; returns its result dict.

  The child prints ``result_tag`` + a JSON object (its result) and, when
  ``phase_tag`` is given, ``phase_tag`` + JSON once it has compiled (the
  compile deadline ``compile_timeout_s`` ends there; 0: none). A timed-out
  case says in which phase it stopped and, after compilation, carries the
  phase's fields (e.g. XLA's memory plan), so that a hang at run time is
  told apart from a compile that does not end. The child's lines that start
  with ``echo_tag`` (a string or a tuple of them: its progress) are printed
  here as they come, and a timeout's status ends with the last of them. A child that ends without
  a result is ``oom: ...`` if its output says so (``oom_status``), else
  ``crash``.
  """
  t0 = time.time()
  with tempfile.TemporaryFile("w+") as err:
    p = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=err,
        text=True, env=env or child_env(), start_new_session=True)
    lines = queue.Queue()

    def pump():
      for line in p.stdout:
        lines.put(line)
      lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    out = []
    try:
      result, timed = _follow(p, lines, out, t0, timeout_s, compile_timeout_s,
                              result_tag, phase_tag, echo_tag)
    except BaseException:  # E.g. Ctrl-C / `timeout -s INT`: no orphan.
      kill(p)
      raise
    if timed is not None:
      return timed
    p.wait()
    if result is not None:
      return result
    err.seek(0)
    tail = (err.read() or "".join(out))[-400:].replace("\n", " | ")
    if is_oom(tail):
      err.seek(0)
      text = (err.read() or "".join(out))[-4000:]
      return dict(status=oom_status(
          text, "step" if _compiled(out, phase_tag) else "compile"))
  return dict(status=f"crash rc={p.returncode}: {tail}")


def _compiled(out, phase_tag) -> bool:
  return phase_tag is not None and any(l.startswith(phase_tag) for l in out)


def _follow(p, lines, out, t0, timeout_s, compile_timeout_s, result_tag,
            phase_tag, echo_tag=None):
  """Reads the child's lines under the deadlines of ``run_child``; returns
  (result, timeout row or None)."""
  phase, result, echoed = None, None, ""
  while True:
    limit = timeout_s
    if phase is None and compile_timeout_s:
      limit = min(timeout_s, compile_timeout_s)
    left = t0 + limit - time.time()
    try:
      line = lines.get(timeout=max(left, 0.01)) if left > 0 else None
      timed_out = left <= 0
    except queue.Empty:
      line, timed_out = None, True
    if timed_out:
      kill(p)
      if phase_tag is None:
        return None, dict(status=f"timeout>{timeout_s}s")
      waited = time.time() - t0
      if phase is None:
        return None, dict(status=f"timeout in compile (>{limit:.0f}s"
                          f", {waited:.0f}s)")
      plan = (f"; XLA plan {phase['xla_total_gb']:.3g} GB/dev"
              if phase.get("xla_total_gb") is not None else "")
      lim = (f", limit {phase['bytes_limit_gb']:.3g} GB"
             if phase.get("bytes_limit_gb") else "")
      last = f"; last progress: {echoed}" if echoed else ""
      return None, dict(
          {k: v for k, v in phase.items() if k != "phase"},
          status=f"timeout>{timeout_s}s while running (compiled in "
          f"{phase.get('compile_s', float('nan')):.0f}s{plan}{lim}){last}")
    if line is None:
      return result, None
    out.append(line)
    if echo_tag is not None and line.startswith(echo_tag):
      print(line, end="" if line.endswith("\n") else "\n", flush=True)
      echoed = line.strip()
    if phase_tag is not None and line.startswith(phase_tag):
      phase = json.loads(line[len(phase_tag):])
    elif line.startswith(result_tag):
      result = json.loads(line[len(result_tag):])


def kill(p):
  """Ends a child started here (in its own session) and waits for it."""
  try:
    os.killpg(p.pid, 9)
  except OSError:
    p.kill()
  p.wait()


def _tree_pids(root: int) -> list:
  """``root`` and its descendants (from /proc; Linux)."""
  children = collections.defaultdict(list)
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/stat") as f:
        # "pid (comm) state ppid ...": comm may hold spaces; split after it.
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
      continue
    children[ppid].append(int(name))
  out, todo = [], [root]
  while todo:
    pid = todo.pop()
    out.append(pid)
    todo.extend(children.get(pid, ()))
  return out


def _memory_of(pid: int) -> int:
  """Bytes of ``pid``: its PSS (shared pages split among their users, so a
  sum over processes counts them once), else its RSS; 0 if it is gone."""
  try:
    with open(f"/proc/{pid}/smaps_rollup") as f:
      for line in f:
        if line.startswith("Pss:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    with open(f"/proc/{pid}/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return 0


class _Sampling:
  """A context manager that calls ``sample`` every ``interval_s`` on a
  daemon thread while it is entered."""

  def __init__(self, interval_s: float):
    self.interval_s = interval_s
    self._stop = threading.Event()
    self._thread = None

  def sample(self):
    raise NotImplementedError

  def _run(self):
    while not self._stop.wait(self.interval_s):
      self.sample()

  def __enter__(self):
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


class HostMemory(_Sampling):
  """Peak host memory of this process plus its descendants, sampled every
  ``interval_s`` on a thread (a context manager; ``peak_gib``).

  The sum of PSS (RSS where /proc has no smaps_rollup), so forked workers'
  shared pages count once. ``ru_maxrss`` would miss the workers (children
  count only once reaped, and then one at a time, not summed).
  """

  def __init__(self, interval_s: float = 0.5):
    super().__init__(interval_s)
    self.peak_bytes = 0

  def sample(self) -> int:
    now = sum(_memory_of(p) for p in _tree_pids(os.getpid()))
    self.peak_bytes = max(self.peak_bytes, now)
    return now

  def __enter__(self):
    self.sample()
    return super().__enter__()

  def __exit__(self, *exc):
    super().__exit__(*exc)
    self.sample()

  @property
  def peak_gib(self) -> float:
    return self.peak_bytes / 2**30


class ReadyAt:
  """When ``x`` (jax arrays) is ready, in seconds after ``t0``
  (``time.perf_counter``), watched from a thread so that the caller goes on
  dispatching (a device phase's end inside a pipelined step)."""

  def __init__(self, x, t0: float):
    import jax  # pylint: disable=import-outside-toplevel
    self._at, self._error = None, None

    def wait():
      try:
        jax.block_until_ready(x)
        self._at = time.perf_counter() - t0
      except Exception as e:  # pylint: disable=broad-except
        self._error = e
    self._thread = threading.Thread(target=wait, daemon=True)
    self._thread.start()

  def seconds(self) -> float:
    self._thread.join()
    if self._error is not None:
      raise self._error
    return self._at


class StackSampler(_Sampling):
  """Where this process's named threads spend their wall time: every
  ``interval_s`` each thread's innermost frame and its innermost frame in
  this repository, counted (a context manager; ``top``).

  A thread in C code that released the GIL shows the Python line that called
  it; one waiting for the GIL shows where it will resume. So the counts split
  wall time, not CPU time, which is what an input-bound step needs to know.
  """

  def __init__(self, threads: tuple, interval_s: float = 0.002):
    super().__init__(interval_s)
    self.threads = threads
    self.counts = collections.Counter()
    self.samples = 0

  @staticmethod
  def _where(frame) -> str:
    inner = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
    f = frame
    while f is not None and not f.f_code.co_filename.startswith(ROOT):
      f = f.f_back
    ours = (f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}"
            f":{f.f_lineno}" if f is not None else "-")
    return ours if ours.startswith(inner) else f"{ours} > {inner}"

  def sample(self):
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    self.samples += 1
    for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
      name = names.get(ident, "")
      if ident != me and name.startswith(self.threads):
        self.counts[f"{name}: {self._where(frame)}"] += 1

  def top(self, n: int = 20) -> list:
    """[(where, share of the samples)], the most frequent first."""
    return [(k, round(v / max(1, self.samples), 4))
            for k, v in self.counts.most_common(n)]


# ------------------------------------------------------- probe items
# A probe (bench_groups, bench_f32) is a list of ``record(name, fn)``
# items: each runs on its own, a failure prints its error and the run goes
# on (one device call should not be lost to one broken variant), and
# ``summary()`` prints every result last.

RESULTS = []


def bench(f, *args, reps=5, warmup=2):
  """Median wall time of ``f(*args)`` in ms, after warm-up (compilation)."""
  return timeit(f, *args, reps=reps, warmup=warmup).median * 1e3


def record(name, fn):
  """Runs one probe item; its result or its error goes to RESULTS."""
  import traceback  # pylint: disable=import-outside-toplevel
  try:
    out = fn()
  except Exception as e:  # pylint: disable=broad-except
    out = f"FAILED {type(e).__name__}: {str(e)[:800]}"
    traceback.print_exc(limit=3)
  RESULTS.append((name, out))
  print(f"{name}: {out}", flush=True)


def summary(width=45):
  import jax  # pylint: disable=import-outside-toplevel
  print("peak_bytes_in_use", device_bytes("peak_bytes_in_use"))
  print("\n==== SUMMARY ====")
  for name, out in RESULTS:
    print(f"{name:{width}s} {out}")

