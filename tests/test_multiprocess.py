"""The ring over 2 processes x 4 CPU devices, joined by jax.distributed.

The same code path as a multi-host GPU cluster: each process sees only its
own devices, collectives cross the process boundary (gloo on CPU, NCCL on
GPU). The workers check value and grads against the float64 reference on
the gathered batch; this test fails if either worker fails or hangs.
"""
import os
import socket
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "multiprocess_worker.py")
TIMEOUT_S = 240


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_ring_two_processes_four_devices_each():
  num_processes = 2
  port = _free_port()
  env = dict(os.environ)
  # Each process has 4 devices; conftest's 8 are for the single-process tests.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
  env["JAX_PLATFORMS"] = "cpu"
  procs = [subprocess.Popen(
      [sys.executable, WORKER, str(i), str(num_processes), str(port)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  try:
    # A worker that dies leaves its peer blocked in a collective: stop
    # everything as soon as one fails, or at the deadline.
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs):
        break
      if time.monotonic() > deadline:
        break
      time.sleep(0.2)
  finally:
    timed_out = any(p.poll() is None for p in procs)
    for p in procs:
      if p.poll() is None:
        p.kill()
    outputs = [p.communicate()[0] for p in procs]
  report = "\n---\n".join(f"worker {i} (exit {p.returncode}):\n{out[-3000:]}"
                           for i, (p, out) in enumerate(zip(procs, outputs)))
  assert not timed_out or any(p.returncode not in (0, None) for p in procs), \
      f"workers hung past {TIMEOUT_S}s:\n{report}"
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, report
    assert out.count(f"ok p{i} ") == 3, report
