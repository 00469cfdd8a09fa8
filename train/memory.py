"""The train step's device memory: the GradCache micro-batch sized from
XLA's plan, and out-of-memory errors in one line.

Before any data is decoded, the trainer compiles its step for the
micro-batch (``config.microbatch_size``) and reads XLA's memory plan of it
(``compiled.memory_analysis()``: arguments, outputs and temporaries, per
device). A streamed step (the locked image tower on the fly,
train/streamed_tower.py) also holds the tower's embedding call and the
micro-batches of images in flight beside the step, so their bytes are added
(``Plan``). The sum is
compared with the device's memory: ``memory_stats()["bytes_limit"]`` of the
first local device, the host's memory for a CPU device, or
``config.device_memory_gb`` when set (a share of a GPU, or a test's limit).

- ``microbatch_size = "auto"``: the largest micro-batch up to ``AUTO_MAX``
  that divides the batch, splits over the devices and plans at most
  ``MARGIN`` of the memory (the rest for what XLA's plan does not see:
  fragmentation when JAX grows its memory on demand, cuDNN's workspaces, a
  GPU decoder's own buffers). Found from the largest down (steps that
  double, then bisection), one compile each (on a GPU without autotuning:
  ``SIZING_OPTIONS``). The sum is exact where JAX grows its memory on
  demand (the image stream's temporaries stay held beside the step's),
  and cautious with preallocation (one arena that both reuse).
- a set micro-batch whose plan exceeds the memory stops the run there, in
  one line that names the memory needed, the memory there and the
  micro-batch that fits.

An out-of-memory error that still happens (``XlaRuntimeError:
RESOURCE_EXHAUSTED``) is raised again as ``OutOfMemory``, one line saying
which memory ran out, in which phase, and how much was asked for
(``phase``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Callable

# The share of the device's memory that "auto" plans for.
MARGIN = 0.9
# The largest micro-batch "auto" tries: the micro-batch of the project's
# large-batch configs (configs/lit_b16_large_batch.py). A larger one holds
# more images on the host and the device; whether it is faster is not
# measured (benchmarks/bench_train.py --microbatch).
AUTO_MAX = 8192

GB = 1e9


class OutOfMemory(MemoryError):
  """A device or host allocation that failed, described in one line."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """The bytes one device holds for a step at ``microbatch`` (global)."""
  microbatch: int
  step_bytes: int  # XLA's plan of the compiled step (``compiled_bytes``).
  # The image stream's beside it (train/streamed_tower.py).
  stream_bytes: int = 0

  @property
  def total(self) -> int:
    return self.step_bytes + self.stream_bytes

  def describe(self) -> str:
    """E.g. "1.2 GB per device (the step 1 GB + the image stream 200 MB)"."""
    if not self.stream_bytes:
      return f"{fmt_bytes(self.total)} per device (XLA's plan of the step)"
    return (f"{fmt_bytes(self.total)} per device (the step "
            f"{fmt_bytes(self.step_bytes)} + the image stream "
            f"{fmt_bytes(self.stream_bytes)})")


def fmt_bytes(n) -> str:
  """Bytes in GB, MB or KB (decimal), 3 significant digits."""
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g} {unit}"
  return f"{int(n)} B"


def compiled_bytes(compiled) -> int:
  """XLA's per-device plan of a compiled program: arguments + outputs +
  temporaries, less what outputs reuse of donated arguments; 0 where XLA
  gives none."""
  try:
    m = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return 0
  if m is None:
    return 0
  return int(m.argument_size_in_bytes + m.output_size_in_bytes
             + m.temp_size_in_bytes - m.alias_size_in_bytes)


# XLA options of the compiles that only size (GPU): no autotuning of the
# matmuls and fusions, which takes most of a GPU compile and barely moves
# the plan. The size chosen is then compiled as usual, for the step.
SIZING_OPTIONS = {"xla_gpu_autotune_level": 0}


def plan_bytes(lowered, platform: str, search: bool = True) -> int:
  """``compiled_bytes`` of a ``jit(...).lower(...)``: while searching on a
  GPU compiled with ``SIZING_OPTIONS`` (as usual where XLA refuses them),
  else as usual (the step's own call then reuses the compile)."""
  if search and platform == "gpu":
    try:
      return compiled_bytes(lowered.compile(compiler_options=SIZING_OPTIONS))
    except Exception:  # pylint: disable=broad-except
      pass  # An XLA without the option: compiled as usual below.
  return compiled_bytes(lowered.compile())


def device_limit(config_gb: float, device) -> tuple[int | None, str]:
  """(bytes a step may plan on ``device``, where the figure comes from).

  ``config_gb`` > 0 (config.device_memory_gb) is taken as given; else the
  device's ``memory_stats()["bytes_limit"]`` (what JAX's allocator may
  hold: with preallocation, XLA_PYTHON_CLIENT_MEM_FRACTION of the card);
  a CPU device's memory is the host's. (None, why) when unknown.
  """
  if config_gb and config_gb > 0:
    return int(config_gb * GB), "config.device_memory_gb"
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), f"bytes_limit of {device}"
  if getattr(device, "platform", "") == "cpu":
    try:
      return (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "the host's memory")
    except (OSError, ValueError):
      pass
  return None, f"{device} reports no memory limit"


def candidates(batch: int, multiple: int, largest: int) -> list[int]:
  """The micro-batches, ascending, that divide ``batch``, are multiples of
  ``multiple`` (the devices) and are at most ``largest``."""
  return [m for m in range(multiple, min(batch, largest) + 1, multiple)
          if batch % m == 0]


def _largest_fitting(sizes: list, fits: Callable[[int], bool]):
  """The largest of ``sizes`` (ascending) that ``fits``, assuming that
  what fits at m fits below it; None if none fits. The answer is usually
  near the top (a halved micro-batch fits): the largest first, then steps
  down that double (the 2nd, 4th, 8th, ... largest), then bisection
  between the last that failed and the first that fits."""
  if not sizes:
    return None
  hi, step = len(sizes) - 1, 1  # sizes[hi] is not known to fit yet.
  if fits(sizes[hi]):
    return sizes[hi]
  while True:  # sizes[hi] does not fit.
    lo = hi - step
    if lo < 0:
      lo = -1
      break
    if fits(sizes[lo]):
      break
    hi, step = lo, step * 2
  while hi - lo > 1:  # sizes[lo] fits (or lo = -1), sizes[hi] does not.
    mid = (lo + hi) // 2
    if fits(sizes[mid]):
      lo = mid
    else:
      hi = mid
  return sizes[lo] if lo >= 0 else None


@dataclasses.dataclass
class Sizing:
  """The micro-batch a run takes and why (``size_microbatch``)."""
  microbatch: int  # Global; the batch itself for an un-chunked step.
  plan: Plan | None
  limit: int | None
  line: str  # What the trainer logs.


def size_microbatch(*, requested, batch: int, multiple: int,
                    plan_fn: Callable[[int], Plan], limit: int | None,
                    source: str, margin: float = MARGIN,
                    largest: int = AUTO_MAX) -> Sizing:
  """The run's micro-batch, checked against the device's memory.

  Args:
    requested: config.microbatch_size: "auto", or an int (0, or at least
      ``batch``: the un-chunked step).
    batch: the global batch.
    multiple: the device count (a micro-batch splits over the devices).
    plan_fn: micro-batch -> ``Plan`` (compiles the step; called at most
      once per size).
    limit: the device's bytes (``device_limit``), None if unknown.
    source: where ``limit`` comes from, for the messages.
    margin: the share of ``limit`` that "auto" plans for.
    largest: the largest micro-batch "auto" tries.

  Raises:
    ValueError: one line, for a set micro-batch whose plan exceeds
      ``limit``, or "auto" when no micro-batch fits.
  """
  plans = {}

  def plan(m):
    if m not in plans:
      plans[m] = plan_fn(m)
    return plans[m]

  def fits_auto(m):
    return plan(m).total <= margin * limit

  where = (f"{fmt_bytes(limit)} there ({source})" if limit else source)
  if requested == "auto":
    sizes = candidates(batch, multiple, largest)
    if limit is None:
      m = sizes[-1] if sizes else batch
      return Sizing(m, None, None, f"[lit] micro-batch auto: {m} ({source}: "
                    f"the largest up to {largest} that divides the batch)")
    m = _largest_fitting(sizes, fits_auto)
    if m is None:
      smallest = sizes[0] if sizes else batch
      raise ValueError(
          f"config.microbatch_size=\"auto\": no micro-batch fits the "
          f"device's memory ({margin:.0%} of {where}); the smallest, "
          f"{smallest}, plans {plan(smallest).describe()}: set "
          "config.model.text.remat=\"block\", or use a smaller "
          "config.batch_size or more devices")
    p = plan(m)
    return Sizing(m, p, limit, f"[lit] micro-batch auto: {m} of the batch "
                  f"{batch}, planning {p.describe()}, of {where}; up to "
                  f"{margin:.0%} planned")
  m = requested if 0 < requested < batch else batch
  if limit is None:
    return Sizing(m, None, None, "")
  p = plan(m)
  if p.total <= limit:
    return Sizing(m, p, limit, f"[lit] micro-batch {m}: planning "
                  f"{p.describe()}, of {where}")
  fit = _largest_fitting(candidates(batch, multiple, m - 1), fits_auto)
  advice = (f"micro-batch {fit} fits ({fmt_bytes(plan(fit).total)}): set "
            f"config.microbatch_size={fit} or \"auto\"" if fit else
            "no smaller micro-batch fits either: set "
            "config.model.text.remat=\"block\", or use a smaller "
            "config.batch_size or more devices")
  raise ValueError(
      f"config.microbatch_size={requested} does not fit the device's "
      f"memory: it needs {p.describe()}, {where}; {advice}")


# ------------------------------------------------------ out of memory


def is_oom(error) -> bool:
  """Whether ``error`` (or a text) is an allocation that failed."""
  text = str(error)
  return ("RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
          or isinstance(error, OutOfMemory))


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|bytes|B)\b")
_UNITS = {"B": 1, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def asked_bytes(text: str) -> int | None:
  """The size an out-of-memory message says was asked for (the first size
  after "allocat"/"request", else the first), in bytes; None if none."""
  m = (re.search(r"(?:allocat\w*|request\w*)\D{0,40}?" + _SIZE.pattern,
                 text) or _SIZE.search(text))
  return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def _message(text: str) -> str:
  """The line of an XLA error that says what failed."""
  lines = text.splitlines()
  for match in (lambda l: "RESOURCE_EXHAUSTED" in l,
                lambda l: "out of memory" in l.lower(),
                lambda l: "memory" in l.lower()):
    for line in lines:
      if match(line):
        return line.strip()
  return text.strip().splitlines()[0] if text.strip() else ""


def oom_line(error, phase: str, device=None, hint: str = "") -> str:
  """One line for an out-of-memory ``error`` in ``phase`` (compile, step,
  precompute, eval, ...): which memory ran out, how much was asked for,
  and what the device held (its ``memory_stats`` where it keeps them)."""
  text = str(error)
  msg = _message(text)
  low = msg.lower()
  if "host" in low and "device" not in low:
    memory = "host memory"
  else:
    memory = "device memory" + (f" of {device}" if device is not None
                                else "")
  asked = asked_bytes(msg) or asked_bytes(text)
  out = f"out of {memory} in the {phase}"
  out += (f": {fmt_bytes(asked)} asked for" if asked
          else f": {msg[:200]}")
  stats = {}
  if device is not None:
    try:
      stats = device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
      stats = {}
  if stats.get("bytes_limit"):
    out += (f", {fmt_bytes(stats.get('bytes_in_use', 0))} of "
            f"{fmt_bytes(stats['bytes_limit'])} in use (peak "
            f"{fmt_bytes(stats.get('peak_bytes_in_use', 0))})")
  return out + (f"; {hint}" if hint else "")


STEP_HINT = ("lower config.microbatch_size or set it to \"auto\", or set "
             "config.model.text.remat=\"block\"")
EVAL_HINT = "lower config.eval.batch_size"


@contextlib.contextmanager
def phase(name: str, device=None, hint: str = ""):
  """Raises an out-of-memory error inside as ``OutOfMemory`` (``oom_line``;
  the original is its cause). Other errors pass through."""
  try:
    yield
  except OutOfMemory:
    raise
  except Exception as e:  # pylint: disable=broad-except
    if not is_oom(e):
      raise
    raise OutOfMemory(oom_line(e, name, device, hint)) from e
