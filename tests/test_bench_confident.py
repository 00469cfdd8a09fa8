"""benchmarks/bench_confident.py: its rows on the CPU (xla), from this
checkout and from another one named by --library."""
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *extra):
  out = tmp_path / "rows.jsonl"
  subprocess.run(
      [sys.executable, os.path.join(REPO, "benchmarks", "bench_confident.py"),
       "--out", str(out), "--backends", "xla", "--dtypes", "float32",
       "--losses", "1.0,1e-20", "--b", "40", "--d", "8", *extra],
      check=True, cwd=tmp_path, capture_output=True, timeout=300)
  return [json.loads(l) for l in out.read_text().splitlines()]


def test_rows_within_1e3_on_this_checkout(tmp_path):
  rows = _run(tmp_path)
  assert [r["status"] for r in rows] == ["ok", "ok"]
  assert rows[1]["true_loss"] < 1e-15
  for r in rows:
    assert r["loss_err"] < 1e-3 and r["grad_err"] < 1e-3, r
    assert r["library"].endswith("infcl_jax") and r["jax"]


def test_library_flag_imports_that_checkout(tmp_path):
  """--library measures another checkout's infcl_jax (a copy here)."""
  other = tmp_path / "other"
  shutil.copytree(os.path.join(REPO, "infcl_jax"), other / "infcl_jax")
  rows = _run(tmp_path, "--library", str(other))
  assert {r["library"] for r in rows} == {os.path.join("other", "infcl_jax")}
