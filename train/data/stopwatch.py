"""Seconds per stage of a thread's work (the decode threads' timing)."""
from __future__ import annotations

import collections
import contextlib
import threading
import time


class Stopwatch:
  """Seconds per stage of one thread's work, wall and that thread's CPU.

  Where a decode thread's time goes (bench_train's stream rows): a stage
  whose wall time is well above its CPU time waited (for the GIL, the
  device, a queue) rather than worked. Timed per call, not per image, so it
  costs nothing measurable. Read from another thread (``add_to``), a stage
  still running counts its wall time so far, so the difference of two
  readings is the wall time between them; its CPU time counts when it ends
  (another thread's CPU clock cannot be read). One Stopwatch may be shared
  by several threads (a decoder's pool): a stage then sums their times.
  """

  def __init__(self):
    self.wall, self.cpu = collections.Counter(), collections.Counter()
    self._running = {}  # (stage, thread id) -> its wall start
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def __call__(self, stage: str):
    w, c = time.perf_counter(), time.thread_time()
    key = (stage, threading.get_ident())
    with self._lock:
      self._running[key] = w
    try:
      yield
    finally:
      wall, cpu = time.perf_counter() - w, time.thread_time() - c
      with self._lock:  # readers see it running or counted, never neither
        self._running.pop(key, None)
        self.wall[stage] += wall
        self.cpu[stage] += cpu

  def add_to(self, totals: dict) -> dict:
    now = time.perf_counter()
    running = collections.Counter()
    with self._lock:
      wall, cpu = collections.Counter(self.wall), collections.Counter(self.cpu)
      for (stage, _), start in self._running.items():
        running[stage] += now - start
    for stage in set(wall) | set(running):
      t = totals.setdefault(stage, {"wall_s": 0.0, "cpu_s": 0.0})
      t["wall_s"] += wall[stage] + running[stage]
      t["cpu_s"] += cpu[stage]
    return totals
