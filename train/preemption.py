"""Preemption and time-based checkpoints: when to save, agreed by every process.

A scheduler ends a job with a signal and a grace period: SLURM sends SIGTERM
(or, with ``#SBATCH --signal=USR1@120``, SIGUSR1 two minutes before the
end), Kubernetes and spot VMs SIGTERM. ``catch(names)`` installs handlers for
the signals of ``config.preemption_signals`` that only record the signal:
the step in progress finishes, the trainer saves a checkpoint of it (train
state and data iterator state), prints ``[lit] preempted at step N;
checkpoint saved; rerun to resume`` and ``train.main`` exits with
``EXIT_PREEMPTED`` (75, EX_TEMPFAIL of sysexits.h: "try again later"), a code
no crash and no signal death gives, so a script or a scheduler can requeue
on it. Later signals are recorded too and change nothing: the save in
progress is never cut short (only SIGKILL can, and orbax's atomic
finalize then leaves the previous checkpoints as they were).

Several processes (``jax.distributed``): a signal may reach only some of
them, at different steps, and all must save the same step. ``SaveTriggers``
agrees through a tiny all-reduce (max) of two flags per process, "a
signal was seen" and "process 0's clock says a time-based checkpoint is
due", dispatched after each step's train step and read one step later: the
devices run it between two steps without waiting for the host, and the
host reads a value whose step is already done (no stall of the dispatch
pipeline). Every process therefore sees the same flags at the same step and
saves the step after the one where the first signal was seen. (JAX's
``multihost_utils.reached_preemption_sync_point`` listens to SIGTERM only,
through a C++ handler that a Python handler replaces; this agreement works
for any signal and for the clock alike.)

Before the first step (JAX start-up, indexing, restore, the precompute
pass, compilation) a signal is not lost either: the trainer checks for one
at safe points (``agree``: after each chunk of shards indexed, after each
round of precomputed shards, before the loop), all processes at the same
point, and stops there with what can be resumed kept (the precompute
progress). A signal during the first step's compilation is acted on after
that step, as during training. While the main thread waits for the next
step's data (a slow or unreachable store), a signal interrupts the wait
(``interrupting_waits``): the step reached is saved instead of waiting out
the outage.

No JAX at import: ``train.main`` catches the signals before JAX starts.
"""
from __future__ import annotations

import signal
import time
from typing import Callable, Sequence

import numpy as np

# EX_TEMPFAIL (sysexits.h): a temporary failure, the caller may retry.
EXIT_PREEMPTED = 75
# Signals a process cannot catch, or that mean something else here (Ctrl-C
# interrupts the run: train.main, exit 130).
_UNCATCHABLE = ("SIGKILL", "SIGSTOP", "SIGINT")


class Preempted(Exception):
  """Raised by the trainer once what can be resumed is saved after a
  preemption signal (or a storage outage, ``train.data.sources.remote.Outage``):
  the checkpoint of ``step``, or before the first step (``step`` None)
  nothing, or the precompute progress. ``train.main`` exits with
  EXIT_PREEMPTED."""

  def __init__(self, step: int | None, signal_name: str):
    where = "before the first step" if step is None else f"at step {step}"
    super().__init__(f"preempted {where} ({signal_name}); rerun to resume")
    self.step = step
    self.signal_name = signal_name


class WaitInterrupted(BaseException):
  """Raised by the signal handler in the main thread while it waits for
  data (``interrupting_waits``): the trainer saves the step reached. A
  BaseException, like KeyboardInterrupt, so that no ``except Exception`` on
  the way turns it into something else."""


def check_signal_names(names) -> None:
  """One-line ValueError unless ``names`` are signals a process can catch."""
  if isinstance(names, str) or not isinstance(names, (tuple, list)):
    raise ValueError(f"config.preemption_signals={names!r} must be a tuple "
                     "of signal names, e.g. ('SIGTERM', 'SIGUSR1')")
  for name in names:
    valid = isinstance(name, str) and name in signal.Signals.__members__
    if not valid or name in _UNCATCHABLE:
      why = ("cannot be caught" if name in ("SIGKILL", "SIGSTOP") else
             "is Ctrl-C (it interrupts the run)" if name == "SIGINT" else
             "is not a signal name of this system")
      raise ValueError(f"config.preemption_signals: {name!r} {why}; use "
                       "names such as 'SIGTERM', 'SIGUSR1', 'SIGUSR2'")


# The signals seen since catch(): (name, time.monotonic()) in order. A plain
# list appended to by the handler (which runs in the main thread between two
# bytecodes, never in the middle of a save's bookkeeping).
_received: list[tuple[str, float]] = []
_previous: dict[int, object] = {}
# Where the signals of the current run start in _received: set when catch()
# installs the handlers (not when it is called again while they are).
_mark = 0
# While set (interrupting_waits), a signal raises WaitInterrupted.
_interrupt = [False]


def _handler(signum, frame):  # pylint: disable=unused-argument
  _received.append((signal.Signals(signum).name, time.monotonic()))
  if _interrupt[0]:
    _interrupt[0] = False  # Once: the trainer's saving is not interrupted.
    raise WaitInterrupted(signal.Signals(signum).name)


def catch(names: Sequence[str]) -> None:
  """Records the signals ``names`` from now on instead of their default
  action (ending the process). Idempotent: a signal caught since the first
  call (while the handlers stay installed) belongs to the run, however
  early it came; call again after anything that installs its own handlers.
  After ``release`` a new ``catch`` starts a new run's record."""
  global _mark
  if not _previous:
    _mark = len(_received)
  for name in names:
    sig = signal.Signals[name]
    old = signal.signal(sig, _handler)
    if old is not _handler:
      _previous.setdefault(sig, old)


def release() -> None:
  """Restores the handlers ``catch`` replaced (signals from now on take
  their former action); the signals seen so far stay recorded."""
  _interrupt[0] = False
  while _previous:
    sig, old = _previous.popitem()
    signal.signal(sig, old if old is not None else signal.SIG_DFL)


def catching() -> bool:
  """Whether the handlers are installed (``catch`` without ``release``)."""
  return bool(_previous)


def first_signal() -> str | None:
  """The first signal of the current run (since ``catch``), or None."""
  mine = _received[_mark:]
  return mine[0][0] if mine else None


class interrupting_waits:  # pylint: disable=invalid-name
  """``with interrupting_waits(on):`` a caught signal raises
  WaitInterrupted in the main thread (at once, or on entry when one came
  before), so that a wait for data does not outlast the grace period; off
  (``on`` False), signals are only recorded."""

  def __init__(self, on: bool = True):
    self.on = on

  def __enter__(self):
    if self.on and _previous:
      name = first_signal()
      if name is not None:
        raise WaitInterrupted(name)
      _interrupt[0] = True
    return self

  def __exit__(self, *exc):
    _interrupt[0] = False
    return False


def agree(flags: Sequence[int], process_count: int | None = None
          ) -> list[int]:
  """The max of each flag over all processes (a blocking all-gather; every
  process must call it at the same point). One process: ``flags``."""
  # Lazy: no JAX at import (the module doc).
  import jax  # pylint: disable=g-import-not-at-top
  n = jax.process_count() if process_count is None else process_count
  flags = [int(bool(f)) for f in flags]
  if n == 1:
    return flags
  # Lazy: no JAX at import (the module doc).
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  seen = np.asarray(multihost_utils.process_allgather(
      np.asarray(flags, np.int32)))
  return [int(v) for v in seen.reshape(n, len(flags)).max(axis=0)]


class SaveTriggers:
  """Per step: must the run save now for a preemption, or for the clock?

  ``poll(step)`` after each step's train step returns ``(preempt,
  timed)``, the same in every process. One process: the signals recorded
  so far and its own clock, at once. Several: those of the step before
  (see the module docstring), max over processes, the clock being process
  0's. ``saved()`` after every checkpoint save restarts the clock.

  Args:
    every_minutes: time-based checkpoint interval (0: none).
    clock: seconds, monotonic (tests inject one).
    process_count, process_index: of the run (defaults: JAX's).
  """

  def __init__(self, *, every_minutes: float = 0.0,
               clock: Callable[[], float] = time.monotonic,
               process_count: int | None = None,
               process_index: int | None = None, enabled: bool = True):
    # Lazy: no JAX at import (the module doc).
    import jax  # pylint: disable=g-import-not-at-top
    self.every_s = 60.0 * every_minutes
    self.clock = clock
    self.process_count = (jax.process_count() if process_count is None
                          else process_count)
    self.process_index = (jax.process_index() if process_index is None
                          else process_index)
    self.enabled = enabled or self.every_s > 0
    self._last_save = clock()
    # Every signal since the run's catch(), however early (JAX start-up,
    # indexing, restore, precompute, compilation).
    self._seen = _mark if _previous else len(_received)
    self._pending = None
    self._reduce = None

  def signal_name(self) -> str | None:
    """The first signal this process has seen since the run started."""
    mine = _received[self._seen:]
    return mine[0][0] if mine else None

  def agreed_signal(self) -> str:
    """What preempted the run, for its message: this process's first
    signal, else another process's."""
    return self.signal_name() or "a signal to another process"

  def final_agreement(self) -> str | None:
    """After the last step: a signal any process has seen since the run
    started (a blocking all-gather; the loop's agreement lags a step)."""
    if not self.enabled:
      return None
    if self.process_count == 1:
      return self.signal_name()
    # Lazy: no JAX at import (the module doc).
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    seen = np.asarray(multihost_utils.process_allgather(
        np.array([int(self.signal_name() is not None)], np.int32)))
    return self.agreed_signal() if seen.any() else None

  def saved(self) -> None:
    self._last_save = self.clock()

  def _local_flags(self):
    due = (self.every_s > 0 and self.process_index == 0
           and self.clock() - self._last_save >= self.every_s)
    return [int(self.signal_name() is not None), int(due)]

  def poll(self, step: int) -> tuple[bool, bool]:  # pylint: disable=unused-argument
    if not self.enabled:
      return False, False
    if self.process_count == 1:
      flags = self._local_flags()
      return bool(flags[0]), bool(flags[1])
    # The flags launched after the step before (its all-reduce ran on the
    # devices before this step's train step). A save decided here restarts
    # the clock (saved()) before launch() takes this step's flags.
    agreed = (np.zeros(2, np.int32) if self._pending is None
              else np.asarray(self._pending))
    return bool(agreed[0]), bool(agreed[1])

  def launch(self) -> None:
    """Several processes: dispatches this step's all-reduce of the flags
    (after poll and any save it asked for), read by the next poll."""
    if not self.enabled or self.process_count == 1:
      return
    # Lazy: no JAX at import (the module doc).
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,g-multiple-import
    flags = self._local_flags()
    if self._reduce is None:
      mesh = Mesh(np.array(jax.devices()), ("p",))
      self._sharding = NamedSharding(mesh, P("p"))
      self._reduce = jax.jit(lambda a: jnp.max(a, axis=0),
                             out_shardings=NamedSharding(mesh, P()))
    n_local = len(jax.local_devices())
    local = np.tile(np.asarray(flags, np.int32), (n_local, 1))
    arr = jax.make_array_from_process_local_data(self._sharding, local)
    self._pending = self._reduce(arr)
