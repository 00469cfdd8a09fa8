"""Smoke test of benchmarks/bench_ring.py on host CPU devices, tiny sizes.

Runs the benchmark's ``main`` in this process on 1, 2 and 4 of the CPU
devices that conftest.py asks XLA for (every section: scaling, overlap, HLO
schedule, max batch), and once with a fresh process per case (the GPU
path's isolation) on 2 devices. Checks the CSV's columns, that the three
strategies report the same loss, that the loss is the float64 reference
loss of the generated inputs, and the derived columns.
"""
import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_ring
from benchmarks import harness
from benchmarks import ring_steps
from tests import np_reference

# Tiles smaller than a shard, so that multi-tile and padded paths run.
TINY = ["--b-local", "40", "--dims", "16", "--dtype", "float32",
        "--block-q", "16", "--block-k", "32", "--budget-s", "0.01",
        "--time-budget-s", "0"]


@pytest.fixture(autouse=True)
def _keep_env():
  """main() may set XLA / JAX variables (when the backend has not started
  yet); later tests of this worker, and their subprocesses, must not see
  them."""
  keys = ("XLA_FLAGS", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
          "XLA_PYTHON_CLIENT_MEM_FRACTION")
  saved = {k: os.environ.get(k) for k in keys}
  yield
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


def _need(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} host devices (conftest.py sets XLA_FLAGS)")


def _read_csv(out):
  with open(os.path.join(out, "bench_ring.csv")) as fh:
    reader = csv.DictReader(fh)
    return reader.fieldnames, list(reader)


@pytest.mark.slow
def test_main_all_sections(tmp_path):
  _need(4)
  out = str(tmp_path)
  rows, meta = bench_ring.main(
      TINY + ["--devices", "1,2,4", "--isolate", "no", "--out", out])
  header, csv_rows = _read_csv(out)
  assert header == bench_ring.FIELDS
  assert len(csv_rows) == len(rows)
  for name in ("bench_ring_meta.json", "ring_hlo.txt"):
    assert os.path.getsize(os.path.join(out, name)) > 0, name

  scaling = [r for r in csv_rows if r["section"] == "scaling"]
  assert {(r["strategy"], r["n_dev"]) for r in scaling} == {
      (s, str(n)) for s in ("ring", "gather", "plain") for n in (1, 2, 4)}
  assert all(r["status"] == "ok" for r in scaling), scaling
  for r in csv_rows:  # The CSV holds what main returned.
    same = [q for q in rows if q["section"] == r["section"]
            and q["strategy"] == r["strategy"] and str(q["n_dev"]) == r["n_dev"]
            and str(q["b_local"]) == r["b_local"]]
    assert same and all(q["status"] == r["status"] for q in same)
    if r["loss"]:
      assert float(r["loss"]) == pytest.approx(same[0]["loss"], rel=1e-6)
  for n in (1, 2, 4):
    losses = [r["loss"] for r in rows
              if r["section"] == "scaling" and r["n_dev"] == n]
    assert len(losses) == 3
    np.testing.assert_allclose(losses, losses[0], rtol=2e-5)
    mesh = ring_steps.make_mesh(n)
    x, y = ring_steps.make_inputs(mesh, 40, 16, jnp.float32)
    ref = np_reference.clip_loss_and_grads(
        np.asarray(x, np.float64), np.asarray(y, np.float64),
        ring_steps.LOGIT_SCALE)[0]
    np.testing.assert_allclose(losses[0], ref, rtol=2e-5)
  for r in scaling:
    assert float(r["ms"]) > 0 and float(r["xla_plan_gb"]) > 0 < float(r["xla_total_gb"])
    eff = float(r["efficiency"])
    assert eff == 1.0 if r["n_dev"] == "1" else eff > 0
    if r["strategy"] == "ring":
      assert float(r["time_over_ring"]) == 1.0

  overlap = {r["strategy"]: r for r in csv_rows if r["section"] == "overlap"}
  assert set(overlap) == {"ring", "compute_only", "transfer_only"}
  assert all(r["status"] == "ok" and r["n_dev"] == "4"
             for r in overlap.values())
  assert meta["overlap"]["compute_ms"] > 0 and meta["overlap"]["transfer_ms"] > 0
  # The CPU runtime keeps collectives synchronous: the ring's ppermutes are
  # found, and found synchronous.
  assert meta["hlo"]["status"] == "ok" and meta["hlo"]["n_sync"] > 0
  assert meta["hlo"]["n_async"] == 0

  maxb = [r for r in csv_rows if r["section"] == "maxbatch"]
  assert [int(r["b_local"]) for r in maxb] == [40, 80, 160]  # cap 4 x b.
  assert all(r["status"] == "ok" for r in maxb)
  assert meta["maxbatch"]["run_b_local"] == 160
  assert meta["overlap"]["text"].startswith("ring ")
  with open(os.path.join(out, "ring_hlo.txt")) as fh:  # Report + listing.
    assert "==== optimized, scheduled HLO ====" in fh.read()
  with open(os.path.join(out, "bench_ring_meta.json")) as fh:
    assert json.load(fh)["platform"] == "cpu"


@pytest.mark.slow
def test_main_isolated_and_resume(tmp_path):
  """A fresh process per case (as on GPUs), then --resume reuses the rows."""
  _need(2)
  out = str(tmp_path)
  args = TINY + ["--devices", "2", "--strategies", "ring,plain",
                 "--sections", "scaling", "--isolate", "yes", "--out", out]
  rows, meta = bench_ring.main(args)
  assert meta["isolate"] is True
  assert [r["status"] for r in rows] == ["ok", "ok"], rows
  assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=2e-5)
  rows2, _ = bench_ring.main(args + ["--resume"])
  assert [r["wall_s"] for r in rows2] == [r["wall_s"] for r in rows]
  header, csv_rows = _read_csv(out)
  assert header == bench_ring.FIELDS and len(csv_rows) == 2


@pytest.mark.slow
def test_memory_limit_paths(tmp_path, monkeypatch):
  """The GPU-only branches, driven by a fake device memory limit of 100 kB:
  a case whose XLA plan exceeds it is not run, and max batch compiles the
  steps it would not run and stops at the first plan over the limit."""
  _need(4)
  real = harness.device_bytes

  def fake(key, devices=None):
    return [100e3] * len(devices) if key == "bytes_limit" else real(key, devices)
  monkeypatch.setattr(harness, "device_bytes", fake)
  rows, meta = bench_ring.main(
      TINY + ["--devices", "2,4", "--strategies", "ring,plain", "--sections",
              "scaling,maxbatch", "--max-step-s", "0", "--isolate", "no",
              "--out", str(tmp_path)])
  by = {(r["section"], r["strategy"], r["n_dev"], r["b_local"]): r
        for r in rows}
  for n in (2, 4):  # The ring's plan at b = 40 is ~50 kB per device.
    assert by[("scaling", "ring", n, 40)]["status"] == "ok"
  plain4 = by[("scaling", "plain", 4, 40)]  # b x 4b logits: ~160 kB.
  assert plain4["status"].startswith("oom (XLA plan"), plain4
  assert plain4["xla_total_gb"] > 100e3 / 1e9 and "ms" not in plain4
  maxb = [r for r in rows if r["section"] == "maxbatch"]
  assert [r["b_local"] for r in maxb] == [40, 80, 160]
  assert maxb[0]["status"] == "ok"
  assert maxb[1]["status"].startswith("compiled, not run") and "<= limit" in maxb[1]["status"]
  assert maxb[2]["status"].startswith("compiled, not run") and "> limit" in maxb[2]["status"]
  assert meta["maxbatch"]["run_b_local"] == 40
  assert meta["maxbatch"]["planned_b_local"] == 80


def test_overlap_numbers():
  """Overhead over compute-only, transfer-only, the fraction hidden, and the
  overhead beyond the transfer (the issue's 2-GPU figures)."""
  ov = bench_ring.overlap_numbers(113.7, 108.5, 2.5)
  assert ov["overhead_ms"] == pytest.approx(5.2)
  assert ov["hidden"] == 0.0 and ov["excess_ms"] == pytest.approx(2.7)
  text = bench_ring.overlap_text(ov)
  assert "overhead 5.20 ms" in text and "exceeds the whole transfer" in text
  ov = bench_ring.overlap_numbers(109.0, 108.5, 2.5)
  assert ov["hidden"] == pytest.approx(0.8) and ov["excess_ms"] == 0
  assert "exceeds" not in bench_ring.overlap_text(ov)
  ov = bench_ring.overlap_numbers(108.0, 108.5, 2.5)  # Faster than compute.
  assert ov["hidden"] == 1.0 and "faster than its compute" in (
      bench_ring.overlap_text(ov))
  assert bench_ring.overlap_numbers(1.0, 1.0, 0.0)["hidden"] == 1.0


@pytest.mark.slow
def test_spawn_phase_timeouts():
  """An isolated case that does not finish says in which phase it stopped;
  after compiling, it carries the compile time and the XLA plan."""
  spec = dict(kind="transfer_only", strategy="transfer_only", n=1, b_local=8,
              d=8, dtype="float32", backend="xla", block_q=0, block_k=0,
              budget_s=0.01, fresh=True)
  r = bench_ring.spawn(dict(spec, test_delay_s={"compile": 120}), "cpu",
                       timeout_s=60, compile_timeout_s=2)
  assert r["status"].startswith("timeout in compile (>2s"), r
  r = bench_ring.spawn(dict(spec, test_delay_s={"run": 120}), "cpu",
                       timeout_s=14, compile_timeout_s=12)
  assert r["status"].startswith("timeout>14s while running (compiled in "), r
  assert "XLA plan" in r["status"] and r["compile_s"] >= 0
  r = bench_ring.spawn(spec, "cpu", timeout_s=60, compile_timeout_s=30)
  assert r["status"] == "ok" and r["ms"] > 0, r


def _scaling(strategy, n, b, ms, **kw):
  return dict(section=kw.pop("section", "scaling"), strategy=strategy,
              n_dev=n, b_local=b, status="ok", ms=ms, **kw)


def test_efficiency_against_the_slowest_gpu():
  """Weak-scaling efficiency t(1) N / t(N), also against the slowest GPU's
  own 1-GPU step where other GPUs ran it; each strategy's time over the
  ring's."""
  rows = [_scaling("ring", 1, 65536, 50.0),
          _scaling("ring", 1, 65536, 52.0, section="single_gpu",
                   first_device=1),
          _scaling("ring", 2, 65536, 104.0),
          _scaling("gather", 1, 65536, 50.0),
          _scaling("gather", 2, 65536, 103.0),
          _scaling("ring", 1, 8192, 1.3),
          _scaling("ring", 2, 8192, 2.7)]
  bench_ring.derive(rows)
  ring2 = rows[2]
  assert ring2["efficiency"] == pytest.approx(100 / 104)
  assert ring2["efficiency_slowest_gpu"] == pytest.approx(104 / 104)
  assert rows[4]["time_over_ring"] == pytest.approx(103 / 104)
  assert "efficiency_slowest_gpu" not in rows[6]  # No other GPU measured.
  assert rows[6]["efficiency"] == pytest.approx(2.6 / 2.7)


def test_max_batch_runs_once_between_limits():
  """Above --max-step-s but below --max-once-s a step runs once; above
  both it is compiled only."""
  specs = []

  class FakeJob:
    rows = []

    def spec(self, kind, strategy, n, b, **kw):
      return dict(kind=kind, strategy=strategy, n=n, b_local=b, **kw)

    def run(self, section, spec):
      specs.append(spec)
      row = dict(section=section, strategy="ring", n_dev=spec["n"],
                 b_local=spec["b_local"])
      if spec["run"]:
        row.update(status="ok", ms=1000.0 * 4 ** len(specs))
      else:
        row.update(status="compiled", xla_total_gb=1.0, bytes_limit_gb=2.0)
      self.rows.append(row)
      return row

    def write_csv(self):
      pass

  out = bench_ring.max_batch(FakeJob(), 2, 100, 800, max_step_s=5,
                             max_once_s=20)
  # b=100 runs (no estimate), 200: est 16 s -> once, 400: est 64 s ->
  # compiled only (fits the plan), 800: compiled only.
  assert [(s["b_local"], s["run"], s["once"]) for s in specs] == [
      (100, True, False), (200, True, True), (400, False, False),
      (800, False, False)]
  assert out["run_b_local"] == 200 and out["planned_b_local"] == 800


def test_child_env_sees_the_requested_gpus(monkeypatch):
  """A child for GPU ``first`` of n sees exactly those devices (the 1-GPU
  baseline on the second GPU once ran on the CPU: an empty list)."""
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  env = bench_ring._child_env(1, "gpu", first=1)  # pylint: disable=protected-access
  assert env["CUDA_VISIBLE_DEVICES"] == "1"
  assert bench_ring._child_env(2, "gpu")["CUDA_VISIBLE_DEVICES"] == "0,1"  # pylint: disable=protected-access
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
  assert bench_ring._child_env(1, "gpu", first=1)["CUDA_VISIBLE_DEVICES"] == "5"  # pylint: disable=protected-access


def test_child_env_preallocates_for_the_plain_baseline(monkeypatch):
  """Only the plain baseline on GPUs gets a preallocated arena (on-demand
  growth near the device limit did not finish its 64k N = 2 step)."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  env = bench_ring._child_env(2, "gpu", strategy="plain")  # pylint: disable=protected-access
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  for strategy, platform in (("ring", "gpu"), ("gather", "gpu"),
                             ("plain", "cpu")):
    env = bench_ring._child_env(2, platform, strategy=strategy)  # pylint: disable=protected-access
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false", strategy
