"""CPU smoke tests of benchmarks/bench_eval.py and benchmarks/memory_demo.py
at tiny sizes: each runs and prints what its table needs."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args):
  p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                     capture_output=True, text=True, timeout=120, check=False,
                     env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-2000:]
  return p.stdout


def test_bench_eval_compares_float32_and_bfloat16_metrics():
  out = _run("bench_eval.py", "--images", "200", "--zs_images", "500",
             "--classes", "20", "--dim", "32")
  rows = dict(re.findall(r"^(\w+)\s+[\d.]+\s+[\d.]+\s+(-?[\d.]+)$", out, re.M))
  for metric in ("i2t_r1", "t2i_r10", "zeroshot_top1", "zeroshot_top5"):
    # The same embeddings rounded to bfloat16: recalls move by points, not tens.
    assert abs(float(rows[metric])) < 5, (metric, out)
  assert "MiB in float32" in out and "MiB in bfloat16" in out


def test_memory_demo_losses_agree():
  out = _run("memory_demo.py", "--sizes", "256", "--dim", "32")
  losses = {m[0]: float(m[1]) for m in
            re.findall(r"^\s*256\s+(reference|xla)\s+([\d.]+)", out, re.M)}
  assert set(losses) == {"reference", "xla"}, out
  assert abs(losses["reference"] - losses["xla"]) < 1e-5, losses
