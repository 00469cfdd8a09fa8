"""benchmarks/bench_towers.py on the CPU: the plan, and a quick run of two
cases in their own processes (the pipeline, not the numbers)."""
import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench_towers as bt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def test_every_planned_case_has_a_spec():
  names = [p[0] for p in bt.PLAN]
  assert len(set(names)) == len(names)
  for name, kind, est, cap in bt.PLAN:
    assert kind in bt.CHILDREN, name
    label, case = bt.case_spec(name, kind)
    assert label and 0 < est < cap, name
    if kind == "lit":
      assert case["tower"] == "hf"
      assert case["mode"] in ("precomputed", "on_the_fly")


class _Rows:
  def __init__(self):
    self.rows = []

  def add(self, **row):
    self.rows.append(row)


def test_torch_rows_time_both_variants_per_case_and_keep_failures():
  """The torch cases' loop, with a stand-in for torch (no torch on the CPU
  VM): every case runs eager then compiled, synced after each call; a
  variant that raises is a status row and the rest still run."""
  calls, syncs = [], []

  class FakeTorch:
    class cuda:  # pylint: disable=invalid-name
      is_available = staticmethod(lambda: True)
      synchronize = staticmethod(lambda: syncs.append(1))
      max_memory_allocated = staticmethod(lambda: 2**30)

    @staticmethod
    def compile(m, dynamic):
      assert dynamic is False

      def compiled(x):
        raise RuntimeError("out of memory")
      return compiled

  def call(x):
    return lambda f: calls.append((x, f(x)))
  rows = _Rows()
  bt.torch_rows(rows, FakeTorch, lambda x: x * 2,
                [("p16", 8, call(16)), ("p77", 4, call(77))], 3, "m {}")
  got = [(r["part"], r["impl"], r["status"] if "status" in r else r["reps"])
         for r in rows.rows]
  oom = "oom: out of device memory in the run: out of memory"
  assert got == [("p16", "m eager", 3), ("p16", "m torch.compile", oom),
                 ("p77", "m eager", 3), ("p77", "m torch.compile", oom)]
  assert calls[:5] == [(16, 32)] * 5 and len(syncs) == 10  # 2 warm-up + 3.
  assert rows.rows[0]["peak_gib"] == 1.0 and rows.rows[0]["per_s"] > 0


@pytest.mark.slow
def test_quick_run_writes_rows_and_keeps_the_budget(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_towers.py"),
         "--quick", "--out", str(tmp_path), "--cases", "vit,text_jax_eos"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                     timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "bench_towers.jsonl") as f:
    rows = [json.loads(line) for line in f]
  # One ViT row; the text case runs 77 tokens first, then 16.
  assert [(r["case"], r["part"], r["status"]) for r in rows] == [
      ("vit", "vit_b16_fwd", "ok"), ("text_jax_eos", "text_fwd_bwd_L77", "ok"),
      ("text_jax_eos", "text_fwd_bwd_L16", "ok")], rows
  assert all(r["per_s"] > 0 and r["reps"] == 2 for r in rows)
  assert "ours (default)" in p.stdout
  # No budget left: every case is skipped, with the reason, and no child runs.
  p = subprocess.run(cmd + ["--budget_s", "0"], capture_output=True,
                     text=True, env=env, timeout=120, check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "bench_towers.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["case"] for r in rows] == ["vit", "text_jax_eos"]
  assert all(r["status"].startswith("skipped: ") for r in rows), rows
