"""benchmarks/bench_data.py at tiny sizes on the CPU: --out required, the
decoders' rows (Pillow against itself; the GPU decoder a status row where
the extra is missing), and the reading + pipeline rows, a child past its
deadline a status row."""
import json
import time

import pytest

from benchmarks import bench_data
from benchmarks import harness


def test_out_is_required(capsys):
  with pytest.raises(SystemExit):
    bench_data.main(["--quick"])
  assert "--out is required" in capsys.readouterr().err


def test_decoders_rows_carry_the_device_and_match_the_summary(tmp_path):
  bench_data.main(["--decoders", "--quick", "--num", "16", "--gpu_batches",
                   "8", "--out", str(tmp_path)])
  rows = harness.read_jsonl(str(tmp_path / "bench_data.jsonl"))
  with open(tmp_path / "bench_data_decoders.json") as f:
    res = json.load(f)
  assert rows == res["host"] + res["gpu"] + res["gpu_beside_load"]
  pillow = rows[0]
  assert pillow["library"] == "pillow" and pillow["status"] == "ok"
  assert pillow["max_abs_diff_vs_pillow"] == 0
  assert pillow["decode_only_img_s_per_core"] > 0
  for r in rows:
    assert r["date"] and r["jax"] and r["device_kind"], r
  gpu = [r for r in rows if r["kind"] == "gpu_decoder"]
  assert gpu and all(r["status"] == "ok" or r["status"].startswith(
      ("unavailable: ", "error: ")) for r in gpu), gpu


@pytest.mark.slow
def test_reading_and_pipeline_rows_and_a_case_past_its_deadline(
    tmp_path, capsys):
  argv = ["--quick", "--num", "64", "--threads", "1", "--workers", "",
          "--microbatch", "16", "--measure_s", "0.1", "--out"]
  bench_data.main(argv + [str(tmp_path / "ok")])
  reading, case = harness.read_jsonl(str(tmp_path / "ok" / "bench_data.jsonl"))
  assert reading["kind"] == "reading_and_per_core" and reading["num"] == 64
  assert min(reading["read_tarfile_img_s"], reading["decode_only_img_s_per_core"],
             reading["read_indexed_random_img_s"]) > 0
  assert case["kind"] == "pipeline" and case["status"] == "ok", case
  assert case["images"] >= 32 and case["img_s"] > 0 and "pattern" not in case
  assert case["date"] == reading["date"] and case["jax"]
  assert case["image_shape"] == [16, 256, 256, 3]  # decode_size 256
  # --bytes_only: the same case with nothing decoded (decoder="gpu"'s host
  # side), its rows told apart.
  bench_data.main(argv + [str(tmp_path / "bytes"), "--bytes_only"])
  _, raw = harness.read_jsonl(str(tmp_path / "bytes" / "bench_data.jsonl"))
  assert raw["status"] == "ok" and raw["bytes_only"] is True, raw
  assert raw["image_shape"] == [16, 256, 256, 3] and raw["img_s"] > 0
  assert "bytes_only" not in case
  # A child cannot start in a second: its case is a status row.
  bench_data.main(argv[:-1] + ["--timeout_s", "1", "--out",
                               str(tmp_path / "late")])
  _, late = harness.read_jsonl(str(tmp_path / "late" / "bench_data.jsonl"))
  assert late["status"] == "timeout>1s", late
  assert "timeout>" in capsys.readouterr().out


def test_matmul_load_reports_its_rate_and_what_ran_beside_it():
  load = bench_data._MatmulLoad(n=64, chain=2)  # pylint: disable=protected-access
  assert load.flops == 2 * 64**3 * 2
  alone, none = load.rate(0.2)
  assert alone > 0 and none is None
  beside, out = load.rate(0, beside=lambda: (time.sleep(0.2), "done")[1])
  assert beside > 0 and out == "done"
