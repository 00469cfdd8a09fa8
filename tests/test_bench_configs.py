"""CPU smoke test of benchmarks/bench_configs.py (Pallas in interpret mode)."""
import csv
import json
import os

import jax.numpy as jnp

from benchmarks import bench_configs
from infcl_jax.backends import triton_tiles as tc


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


def test_every_config_and_candidate_fits_its_tier():
  for dtype in (jnp.bfloat16, jnp.float32):
    for name, (tier, bs) in bench_configs.configs(dtype).items():
      limit = tc.CONFIGS[tier][0]
      for kernel in ("fwd", "bwd"):
        est = tc.smem(bs, dtype, kernel)
        assert est.peak <= limit, (name, kernel)
        if tier != "smem227k":
          assert est.total <= limit, (name, kernel)


def test_probe_log_parser():
  tag = bench_configs.CASE_MARK
  case = ('{"config": "smem99k", "tier": "smem99k", "dtype": "bfloat16", '
          '"family": "softmax", "kernel": "fwd"')
  text = "\n".join([
      "noise", tag + case + "}", "I0101 x.cc:1] Shared memory usage: 65536 B",
      "other", tag + case + ', "status": "ok", "end": true}',
      "Shared memory usage: 1 B"])  # Outside a case: ignored.
  (row,) = bench_configs.parse_probe_log(text)
  assert row["xla_reported"] == "65536" and row["status"] == "ok"
  assert row["est_peak"] == 65536 and row["limit"] == 99 * 1024
