"""CPU smoke test of benchmarks/bench_f32.py (--quick: xla, one tiny case):
every fidelity item runs against float64 and lands in the summary."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_checks_against_float64_and_times():
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_f32.py"),
                      "--quick", "--b", "64"], capture_output=True, text=True,
                     cwd=ROOT, timeout=240, check=False,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-3000:]
  summary = p.stdout.split("==== SUMMARY ====")[1]
  assert "FAILED" not in summary, summary
  fid = dict(re.findall(r"^fid B8192_D768_t14 xla (\w+)\s+loss rel (\S+)", summary, re.M))
  assert set(fid) == {"tf32", "highest", "bf16x3"}, summary
  # Full float32 on the CPU is float64's loss to float32 rounding.
  assert float(fid["highest"]) < 1e-5, fid
  ms = re.search(r"^time B=64 xla bf16 ms\s+(\S+)", summary, re.M)
  assert ms and float(ms[1]) > 0, summary
