"""The ring over 2 processes x 4 CPU devices, joined by jax.distributed.

The same code path as a multi-host GPU cluster: each process sees only its
own devices, collectives cross the process boundary (gloo on CPU, NCCL on
GPU). The workers check value and grads against the float64 reference on
the gathered batch; this test fails if either worker fails or hangs.
"""
import os
import sys

import pytest

from tests.helpers import free_port
from tests.helpers import run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "multiprocess_worker.py")
TIMEOUT_S = 240


@pytest.mark.slow
def test_ring_two_processes_four_devices_each():
  num_processes = 2
  port = free_port()
  env = dict(os.environ)
  # Each process has 4 devices; conftest's 8 are for the single-process tests.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
  env["JAX_PLATFORMS"] = "cpu"
  codes, outputs, timed_out = run_processes(
      [[sys.executable, WORKER, str(i), str(num_processes), str(port)]
       for i in range(num_processes)], env=env, timeout_s=TIMEOUT_S)
  report = "\n---\n".join(f"worker {i} (exit {c}):\n{out[-3000:]}"
                           for i, (c, out) in enumerate(zip(codes, outputs)))
  assert not timed_out, f"workers hung past {TIMEOUT_S}s:\n{report}"
  for i, (c, out) in enumerate(zip(codes, outputs)):
    assert c == 0, report
    assert out.count(f"ok p{i} ") == 3, report
