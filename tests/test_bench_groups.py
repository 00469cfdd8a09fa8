"""CPU smoke test of benchmarks/bench_groups.py: the pipeline (checks,
interleaved rounds, the noise-floor row, per-kernel profiles), not the
numbers."""
import jax

from benchmarks import bench_groups
from benchmarks import harness


def test_rows_costs_and_profiles(tmp_path, monkeypatch):
  monkeypatch.setattr(harness, "RESULTS", [])
  assert jax.default_backend() == "cpu"
  bench_groups.cost(64, ["xla"], 2, families=("sigmoid",),
                    modes=("none", "mask", "none again"), profile=str(tmp_path))
  got = dict(harness.RESULTS)
  assert not [k for k, v in got.items() if str(v).startswith("FAILED")], got
  assert got["check sigmoid xla mask"].startswith("loss rel 0.0e+00"), got
  for mode in ("none", "mask", "none again"):
    ms, rounds = got[f"time B=64 sigmoid xla {mode} ms"].split(" (rounds ")
    lo, hi = (float(t) for t in rounds.rstrip(")").split("-"))
    assert 0 < lo <= float(ms) <= hi, got
    with open(got[f"profile sigmoid xla {mode}"], encoding="utf-8") as f:
      lines = f.read().splitlines()
    assert lines[-1].startswith("total") and len(lines) >= 2, lines
  assert isinstance(got["cost sigmoid xla mask %"], float)
  assert isinstance(got["cost sigmoid xla none again %"], float)


def test_diagonal_outside_variants_trace_differently():
  """"mask outside" / "mask inside" trace the loss with the backend's
  GROUP_DIAGONAL_OUTSIDE set (the diagonal's G written after the panels:
  a scatter), and leave the class attribute as it was."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  cls = type(registry.get("pallas", "sigmoid"))
  before = cls.GROUP_DIAGONAL_OUTSIDE
  x = jnp.ones((40, 16), jnp.bfloat16)
  g = jnp.arange(40, dtype=jnp.int32) // 2
  scatters = {}
  for mode in ("mask outside", "mask inside"):
    group_mode, outside = bench_groups.variant(mode)
    assert group_mode == "mask" and outside == (mode == "mask outside")
    with bench_groups.diagonal_outside("pallas", "sigmoid", outside):
      assert cls.GROUP_DIAGONAL_OUTSIDE is outside
      jaxpr = jax.make_jaxpr(bench_groups.loss_fn("sigmoid", "pallas",
                                                  group_mode))(x, x, g)
    scatters[mode] = str(jaxpr).count("scatter")
    assert cls.GROUP_DIAGONAL_OUTSIDE is before
  assert scatters["mask outside"] > scatters["mask inside"], scatters
  assert bench_groups.variant("none again") == (None, None)

