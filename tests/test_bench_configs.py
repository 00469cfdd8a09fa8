"""CPU smoke test of benchmarks/bench_configs.py (Pallas in interpret mode)."""
import csv
import json
import os

from benchmarks import bench_configs


def test_bench_configs_runs_and_writes_csv(tmp_path, capsys):
  rows = bench_configs.main(["--out", str(tmp_path), "--b", "64", "--d", "8",
                             "--reps", "1", "--loss", "softmax,sigmoid",
                             "--configs", "smem227k,smem99k"])
  assert [(r["config"], r["loss"], r["status"]) for r in rows] == [
      ("smem227k", "softmax", "ok"), ("smem99k", "softmax", "ok"),
      ("smem227k", "sigmoid", "ok"), ("smem99k", "sigmoid", "ok")]
  # Every config computes the same loss.
  assert abs(rows[0]["loss_value"] - rows[1]["loss_value"]) < 1e-5
  assert abs(rows[2]["loss_value"] - rows[3]["loss_value"]) < 1e-5
  assert rows[0]["vs_default"] == 1.0
  with open(os.path.join(tmp_path, "bench_configs.csv")) as f:
    got = list(csv.DictReader(f))
  assert len(got) == 4 and got[1]["capabilities"] == "sm86 sm89 sm120 sm121"
  assert int(got[1]["smem_bwd_total"]) <= int(got[1]["smem_limit"])
  meta = json.load(open(os.path.join(tmp_path, "bench_configs_meta.json")))
  assert meta["B"] == 64
  out = capsys.readouterr().out
  assert "TFLOP/s" in out and "smem99k" in out
