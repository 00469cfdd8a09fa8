"""Runs an interpreter case (``tests/interpreter_case.py``) in a child
process under a time limit: a kernel that never returns fails its test
instead of hanging the suite (a hung interpreter cannot be interrupted from
Python: its threads wait inside XLA's host callbacks)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A case takes ~5-40 s on 2 busy cores; a hang is recognised well before
# the suite's own time matters.
LIMIT_S = float(os.environ.get("INFCL_WATCHDOG_S", "300"))


def run_case(backend, loss, dtype, *, env=None, limit_s=LIMIT_S):
  """The case's JSON result; fails the test on a timeout or an error."""
  cmd = [sys.executable, "-m", "tests.interpreter_case", backend, loss, dtype]
  child_env = dict(os.environ if env is None else env)
  child_env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in [child_env.get("PYTHONPATH")] if p])
  try:
    done = subprocess.run(cmd, cwd=ROOT, env=child_env, capture_output=True,
                          text=True, timeout=limit_s, check=False)
  except subprocess.TimeoutExpired:
    pytest.fail(f"watchdog: backend={backend} {loss} {dtype} in the "
                f"interpreter did not return within {limit_s:.0f} s (a hang)")
  if done.returncode != 0:
    pytest.fail(f"backend={backend} {loss} {dtype}: exit {done.returncode}: "
                f"{done.stderr.strip().splitlines()[-1:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])
