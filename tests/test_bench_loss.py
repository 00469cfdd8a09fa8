"""CPU smoke test of benchmarks/bench_loss.py: the pipeline, not the numbers."""
import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_loss_smoke_and_resume(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_loss.py"),
         "--out", str(tmp_path), "--backends", "reference,pallas",
         "--dtypes", "float32", "--d", "24", "--budget-s", "0.2"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  p = subprocess.run(cmd + ["--batches", "40"], capture_output=True, text=True, env=env,
                     timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "bench_loss.csv") as fh:
    rows = list(csv.DictReader(fh))
  assert [(r["backend"], r["status"]) for r in rows] == [
      ("reference", "ok"), ("pallas", "ok")], rows
  assert all(float(r["ms"]) > 0 for r in rows)
  assert "pallas" in p.stdout.splitlines()[-1]
  # --resume keeps both finished cases and runs only the new batch size.
  p = subprocess.run(cmd + ["--batches", "40,48", "--resume"],
                     capture_output=True, text=True, env=env, timeout=300,
                     check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "bench_loss.csv") as fh:
    rows2 = list(csv.DictReader(fh))
  assert sorted((r["backend"], r["B"]) for r in rows2) == [
      ("pallas", "40"), ("pallas", "48"), ("reference", "40"),
      ("reference", "48")]
  old = {(r["backend"], r["B"]): r["ms"] for r in rows}
  assert all(r["ms"] == old[(r["backend"], r["B"])]
             for r in rows2 if r["B"] == "40")
