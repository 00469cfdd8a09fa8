"""benchmarks/bench_train.py's parent without a device: the options (--out
required, --quick's sizes), the plan, rows and --resume, the ladder's stop,
the run's budget; and a child's failure as a status row. The children
themselves run in tests/test_train.py's quick smoke runs (slow)."""
import json

import pytest

from benchmarks import bench_train
from benchmarks import harness


def _fake_children(monkeypatch, results):
  """harness.run_child answers from ``results`` ((kind, batch) -> result);
  returns the list of the cases it was asked to run."""
  ran = []

  def run_child(argv, *, timeout_s, env=None, phase_tag=None, echo_tag=None):
    assert argv[1] == "--case" and timeout_s > 0 and phase_tag and echo_tag
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    spec = json.loads(argv[2])
    ran.append((spec["kind"], spec["batch"]))
    r = results[(spec["kind"], spec["batch"])]
    return dict(bench_train._row(spec), **r) if r["status"] == "ok" else r
  monkeypatch.setattr(harness, "run_child", run_child)
  return ran


def _rows(out):
  with open(out / "bench_train.json") as f:
    return {(r["kind"], r["batch"]): r for r in json.load(f)["results"]}


def test_out_is_required_and_quick_sizes_yield_to_given_ones(capsys):
  with pytest.raises(SystemExit):
    bench_train.main(["--quick"])
  assert "--out is required" in capsys.readouterr().err
  ap = harness.parser("Doc.", out=None)
  ap.add_argument("--microbatch", type=int, default=8192)
  ap.add_argument("--ladder", default="262144")
  a = harness.parse_quick(ap, dict(microbatch=64, ladder="512"),
                          ["--out", "x"])
  assert (a.quick, a.microbatch, a.ladder) == (False, 8192, "262144")
  ap = harness.parser("Doc.", out=None)
  ap.add_argument("--microbatch", type=int, default=8192)
  ap.add_argument("--ladder", default="262144")
  a = harness.parse_quick(ap, dict(microbatch=64, ladder="512"),
                          ["--out", "x", "--quick", "--ladder", ""])
  assert (a.quick, a.microbatch, a.ladder) == (True, 64, "")


def test_ladder_stops_at_the_first_batch_that_does_not_fit_and_resumes(
    tmp_path, monkeypatch, capsys):
  results = {("step", 256): {"status": "timeout>5s while running"},
             ("stream", 512): {"status": "ok", "step_s": 2.0,
                               "pipeline_img_s": 256.0,
                               "device_embed_img_s": 300.0,
                               "host_wait_s": 1.0, "host_put_s": 0.1,
                               "device_wait_s": 0.2, "input_bound": True,
                               "embed_img_s": 270.0, "embed_share": 0.9,
                               "device_floor_s": 1.9,
                               "peak_gib": 0.0, "host_peak_gib": 0.5},
             ("max_batch", 512): {"status": "ok", "step_s": 1.0},
             ("max_batch", 1024): {"status": "oom"},
             ("max_batch", 2048): {"status": "ok"}}
  ran = _fake_children(monkeypatch, results)
  argv = ["--quick", "--modes", "precomputed", "--stream_batches", "512",
          "--ladder", "512,1024,2048", "--out", str(tmp_path)]
  bench_train.main(argv)
  assert ran == [("step", 256), ("stream", 512), ("max_batch", 512),
                 ("max_batch", 1024)]
  rows = _rows(tmp_path)
  assert rows[("step", 256)]["status"].startswith("timeout")
  assert rows[("step", 256)]["total_s"] >= 0
  assert rows[("stream", 512)]["decode_size"] == 48  # --quick's
  assert rows[("stream", 512)]["decoder"] == "host"
  assert rows[("max_batch", 1024)]["status"] == "oom"
  assert "model" not in rows[("max_batch", 512)]
  out = capsys.readouterr().out
  assert "(input-bound)" in out
  assert "micro-batch 64): 512" in out  # The largest that fits.
  with open(tmp_path / "bench_train.json") as f:
    assert json.load(f)["model"] == bench_train.QUICK
  # Again with --resume: only the timed-out case runs; the ok and oom rows
  # come back, and the ladder still stops at 1024.
  ran.clear()
  results[("step", 256)] = {"status": "ok", "step_s": 0.5}
  bench_train.main(argv + ["--resume"])
  assert ran == [("step", 256)]
  assert _rows(tmp_path)[("step", 256)]["step_s"] == 0.5
  with open(tmp_path / "bench_train.csv") as f:
    lines = f.read().splitlines()
  assert lines[0].startswith("kind,mode,batch,microbatch,decoder,gpu_decoder,status")
  assert len(lines) == 1 + 4


def test_a_spent_budget_skips_every_case_as_a_row(tmp_path, monkeypatch):
  ran = _fake_children(monkeypatch, {})
  bench_train.main(["--quick", "--modes", "precomputed", "--ladder",
                    "512,1024", "--budget_s", "30", "--out", str(tmp_path)])
  assert not ran
  rows = _rows(tmp_path)
  assert sorted(rows) == [("max_batch", 512), ("max_batch", 1024),
                          ("step", 256)]
  for r in rows.values():  # 30 s left is less than a case needs.
    # (29 s where starting the plan took half a second: it imports jax.)
    assert r["status"].startswith("skipped: ") and (
        " s of the 30 s budget left, needs ~60 s" in r["status"]), r


def test_a_child_that_raises_returns_one_status_row(capsys):
  r = bench_train.case_result(dict(kind="step", mode="precomputed",
                                   batch=8, model={}))
  assert r["status"].startswith("error: KeyError"), r
  assert r["batch"] == 8 and "model" not in r
  assert "Traceback" in capsys.readouterr().err


def test_a_stream_case_checks_its_input_settings_before_building(capsys):
  spec = dict(kind="stream", mode="stream", batch=8, microbatch=8, steps=1,
              workers=1, decode_size=0, decoder="nope", jpeg_size=32,
              embed_reps=1, model=bench_train.QUICK)
  r = bench_train.case_result(spec)
  assert r["status"] == ("error: ValueError: config.data.decoder='nope' "
                         "must be one of host, gpu, auto"), r
  assert "Traceback" in capsys.readouterr().err


def test_gpu_host_threads_reach_the_gpu_stream_cases_only():
  # --gpu_host_threads: the GPU decoder's host side in the training
  # process's threads, in the gpu cases' specs (and so their rows' keys);
  # the host decoder's cases keep the workers.
  args = type("A", (), dict(
      step_batches="", modes="precomputed", microbatch=64, reps=1,
      stream_batches="128", decoders="gpu,host", stream_steps=1, workers=3,
      decode_size=0, quick=True, ladder="", image_model="b16",
      gpu_host_threads=4, gpu_variants=""))()
  by = {c["decoder"]: c for c in bench_train.plan(args, {})}
  assert by["gpu"]["gpu_host_threads"] == 4 and by["gpu"]["workers"] == 3
  assert "gpu_host_threads" not in by["host"]
  args.gpu_host_threads = 0
  assert all("gpu_host_threads" not in c for c in bench_train.plan(args, {}))
  assert "gpu_host_threads" in bench_train.KEY


def test_gpu_variants_are_one_gpu_case_each_and_reach_the_child(capsys):
  # --gpu_variants: nvImageCodec's settings (and the workers) per gpu case,
  # named in the row's key; the host cases are one each.
  args = type("A", (), dict(
      step_batches="", modes="precomputed", microbatch=64, reps=1,
      stream_batches="128", decoders="gpu,host", stream_steps=1, workers=3,
      decode_size=0, quick=True, ladder="", image_model="b16",
      gpu_host_threads=0, gpu_variants=(
          " ; workers=4 backend=hw:0.5,hybrid option=:num_cuda_streams=2 "
          "option=nvjpeg_cuda_decoder:hybrid_huffman_threshold=0 "
          "cpu_threads=6")))()
  cases = bench_train.plan(args, {})
  assert [(c["decoder"], c["workers"]) for c in cases] == [
      ("gpu", 3), ("gpu", 4), ("host", 3)]
  default, tuned, host = cases
  assert default["gpu_decoder"] == "default" and default["gpu_settings"] == {}
  assert tuned["gpu_settings"] == {
      "backend": "hw:0.5,hybrid", "cpu_threads": 6,
      "options": ":num_cuda_streams=2 "
                 "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"}
  assert tuned["gpu_decoder"].startswith("workers=4 backend=hw:0.5,hybrid")
  assert "gpu_decoder" not in host and "gpu_decoder" in bench_train.KEY
  keys = {tuple(c.get(k) for k in bench_train.KEY) for c in cases}
  assert len(keys) == 3
  for bad, says in (("streams=2", "'streams=2' in 'streams=2' is not "
                     "key=value"), ("cpu_threads=x", "needs an int"),
                    ("threads=0", "gpu_decoder_threads=0 must be an int in"),
                    ("backend=gpu", "'gpu' is not one of"),
                    ("option=fancy", "is not [decoder_id]:option=value")):
    args.gpu_variants = bad
    with pytest.raises(ValueError) as e:
      bench_train.plan(args, {})
    assert says in str(e.value) and "\n" not in str(e.value), e.value
  # The child sets them on config.data before its early check.
  spec = dict(kind="stream", mode="stream", batch=8, microbatch=8, steps=1,
              workers=1, decode_size=0, decoder="host", jpeg_size=32,
              embed_reps=1, model=bench_train.QUICK,
              gpu_settings={"cpu_threads": -2})
  r = bench_train.case_result(spec)
  assert r["status"] == ("error: ValueError: config.data.gpu_decoder_cpu_"
                         "threads=-2 must be an int >= 0 (0 = nvImageCodec's "
                         "default, one per core)"), r
  capsys.readouterr()


def test_b32_and_precompute_cases_are_planned():
  # --image_model b32: ViT-B/32 (patch 32, the rest B/16's); and
  # --precompute_images: one train.precompute case per decoder and gpu
  # variant, several nvImageCodec decoders per GPU (threads=N) among them.
  assert bench_train.MODELS["b32"] == dict(bench_train.FULL, vit_patch=32)
  args = type("A", (), dict(
      step_batches="", modes="precomputed", microbatch=8192, reps=1,
      stream_batches="", decoders="gpu,host", stream_steps=1, workers=12,
      decode_size=256, quick=False, ladder="", image_model="b32",
      gpu_host_threads=0,
      gpu_variants="workers=4 threads=4 read_ahead=32;threads=2",
      precompute_images="65536"))()
  cases = bench_train.plan(args, bench_train.MODELS["b32"])
  assert [(c["kind"], c["decoder"], c["workers"], c.get("gpu_settings"))
          for c in cases] == [
              ("precompute", "gpu", 4, {"threads": 4, "read_ahead": 32}),
              ("precompute", "gpu", 12, {"threads": 2}),
              ("precompute", "host", 12, None)]
  assert all(c["image_model"] == "b32" and c["microbatch"] == 8192
             and c["jpeg_size"] == 256 for c in cases)
  assert len({tuple(c.get(k) for k in bench_train.KEY) for c in cases}) == 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["stream", "precompute"])
def test_gpu_decoder_cases_run_end_to_end_on_the_stand_in(kind, monkeypatch):
  # A stream and a precompute case with decoder gpu and the variant words
  # the GPU runs use (several decoders, read-ahead), in-process on the CPU
  # devices with nvImageCodec's call made by test_gpu_decode's stand-in:
  # the plumbing from --gpu_variants to the rows, before any GPU time.
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  from tests import test_gpu_decode  # pylint: disable=import-outside-toplevel
  from train.data.decode import choice  # pylint: disable=import-outside-toplevel
  made = []
  module = test_gpu_decode._fake_nvimgcodec(made)  # pylint: disable=protected-access
  monkeypatch.setitem(sys.modules, "nvidia",
                      types.SimpleNamespace(nvimgcodec=module))
  monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", module)
  monkeypatch.setattr(choice, "gpu_unavailable", lambda: "")
  variant, = bench_train.gpu_variants("threads=3 read_ahead=2")
  spec = dict(kind=kind, mode=kind, batch=256, microbatch=32,
              measure_loss=False, reps=1, steps=1, workers=1,
              gpu_host_threads=1, decode_size=32, decoder="gpu", jpeg_size=40,
              embed_reps=1, model=bench_train.QUICK, image_model="quick",
              **variant)
  r = bench_train.case_result(spec)
  assert r["status"] == "ok", r["status"]
  assert len(made) % 3 == 0 and made  # three decoders per device
  if kind == "stream":
    assert r["bad_examples"] == 0 and r["embed_img_s"] > 0
    assert {"nvimgcodec", "to_jax", "parts", "resize"} <= set(
        r["decode_thread"])
  else:
    assert r["precompute_img_s"] > 0 and r["workers"] == 1


def test_stages_case_times_each_stage_and_writes_its_row(tmp_path,
                                                         monkeypatch, capsys):
  # --stages: one micro-batch through the device-alone embedding's stages
  # (transfer, resize, normalise, tower, and the fused call three ways),
  # the child run in this process.
  def run_child(argv, *, timeout_s, env=None, phase_tag=None, echo_tag=None):
    return bench_train.case_result(json.loads(argv[2]))
  monkeypatch.setattr(harness, "run_child", run_child)
  bench_train.main(["--quick", "--stages", "--step_batches", "", "--ladder",
                    "", "--reps", "1", "--out", str(tmp_path)])
  row = _rows(tmp_path)[("stages", 64)]
  assert row["status"] == "ok" and row["host_image_size"] == 48
  for stage in bench_train.STAGES:
    assert row[f"{stage}_img_s"] > 0 and row[f"{stage}_ms"] > 0, stage
  with open(tmp_path / "bench_train.csv") as f:
    header = f.readline().strip().split(",")
  assert {"transfer_img_s", "resize_img_s", "tower_img_s"} <= set(header)
  out = capsys.readouterr().out
  assert "[bench_train]   stages (64 images a call, 48 px): transfer " in out


def test_microbatch_sizes_remat_and_loss_dtype_are_one_case_each():
  args = type("A", (), dict(
      step_batches="65536", modes="precomputed", microbatch="8192,auto",
      reps=1, stream_batches="", decoders="host", stream_steps=1, workers=1,
      decode_size=256, quick=False, ladder="", image_model="b16",
      gpu_host_threads=0, gpu_variants="", remat="none,block",
      loss_dtype="bfloat16", stages=False))()
  cases = bench_train.plan(args, {})
  assert [(c["microbatch"], c.get("remat")) for c in cases] == [
      (8192, None), (8192, "block"), ("auto", None), ("auto", "block")]
  assert all(c["loss_dtype"] == "bfloat16" for c in cases)
  assert len({tuple(c.get(k) for k in bench_train.KEY) for c in cases}) == 4
  with pytest.raises(ValueError, match="--microbatch: 'big' is not a size"):
    bench_train.microbatches("8192,big")
