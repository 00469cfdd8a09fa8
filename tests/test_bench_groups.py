"""CPU smoke test of benchmarks/bench_groups.py: the pipeline (checks,
interleaved rounds, the noise-floor row), not the numbers."""
import jax
import pytest

from benchmarks import bench_groups
from benchmarks import harness


@pytest.mark.slow
def test_rows_and_costs(monkeypatch):
  monkeypatch.setattr(harness, "RESULTS", [])
  assert jax.default_backend() == "cpu"
  bench_groups.cost(64, ["xla"], 2, families=("sigmoid",),
                    modes=("none", "mask", "none again"))
  got = dict(harness.RESULTS)
  assert not [k for k, v in got.items() if str(v).startswith("FAILED")], got
  assert got["check sigmoid xla mask"].startswith("loss rel 0.0e+00"), got
  for mode in ("none", "mask", "none again"):
    ms, rounds = got[f"time B=64 sigmoid xla {mode} ms"].split(" (rounds ")
    lo, hi = (float(t) for t in rounds.rstrip(")").split("-"))
    assert 0 < lo <= float(ms) <= hi, got
  assert isinstance(got["cost sigmoid xla mask %"], float)
  assert isinstance(got["cost sigmoid xla none again %"], float)
