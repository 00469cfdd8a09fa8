"""Session setup shared by every test module.

The cross-device tests (ring, gather, sigmoid ring, trainer) need several
devices; on a CPU, XLA provides them only if the flag is in XLA_FLAGS before
the CPU backend starts, i.e. before any test module imports jax.
"""
import os

_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()
# The Mosaic GPU interpreter's simulated threads wait inside XLA:CPU host
# callbacks: with XLA:CPU's default pool (one thread per core) it could hang
# on a small machine, and the library refuses to run it
# (infcl_jax.kernels.mosaic.common.check_interpreter_threads). 8 per device
# of the 8 below, and one spare: idle pool threads cost nothing.
os.environ.setdefault("PJRT_NPROC", "65")
# The ring's recommended GPU flags (infcl_jax.xla_flags), as a user would set
# them: the GPU schedule tests (test_ring_hlo.py) check the ring under them.
# The module is loaded from its file (it imports only os), so that jax is not
# imported through the package before XLA_FLAGS is final.
import importlib.util  # pylint: disable=wrong-import-position
import pathlib  # pylint: disable=wrong-import-position

_spec = importlib.util.spec_from_file_location(
    "_infcl_xla_flags",
    pathlib.Path(__file__).resolve().parent.parent / "infcl_jax" / "xla_flags.py")
_xla_flags = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_xla_flags)
os.environ["XLA_FLAGS"] = _xla_flags.recommended(os.environ["XLA_FLAGS"])

# Quick mode (`-m "not slow"`): the tests listed in slow_tests.txt are marked
# slow here, beside those that carry @pytest.mark.slow in their files. CI runs
# everything that is not `interpret`.
#
# `interpret`: the interpreter cases (Mosaic GPU interpreter, Pallas
# interpret) listed in interpret_tests.txt beyond one case per kernel and
# shape class, which the CPU run keeps. They are deselected unless the -m
# expression names them: the GPU job runs `-m "gpu or interpret"`, and
# `-m interpret` runs them anywhere.
import pytest  # pylint: disable=wrong-import-position

_HERE = pathlib.Path(__file__).parent


def _listed(name):
  lines = (_HERE / name).read_text().splitlines()
  return {l.strip() for l in lines if l.strip() and not l.startswith("#")}


# The files of most CPU time (a 2-core run, --durations=0), first: xdist's
# --dist loadfile hands files to the workers in collection order, so a long
# file collected last would run on one worker while the other idles.
LONGEST_FIRST = ("test_preemption.py", "test_train_multiprocess.py",
                 "test_train.py", "test_outage.py", "test_groups.py",
                 "test_gpu_decode.py",
                 "test_remote_data.py", "test_workdir_record.py",
                 "test_towers.py", "test_confident.py", "test_bench_ring.py",
                 "test_notebooks.py", "test_x64.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda i: rank.get(i.path.name, len(rank)))  # Stable.
  slow, interpret = _listed("slow_tests.txt"), _listed("interpret_tests.txt")
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
    if item.nodeid in interpret:
      item.add_marker(pytest.mark.interpret)
  if "interpret" in (config.getoption("markexpr") or ""):
    return
  # A test (or class) named on the command line by its id runs whatever
  # its marks: rerunning a failure from its id needs no -m.
  named = [a for a in config.args if "::" in a]

  def wanted(item):
    return item.get_closest_marker("interpret") is None or any(
        item.nodeid == a or item.nodeid.startswith((a + "[", a + "::"))
        for a in named)

  keep = [i for i in items if wanted(i)]
  if len(keep) < len(items):
    config.hook.pytest_deselected(items=[i for i in items if not wanted(i)])
    items[:] = keep


@pytest.fixture
def reset_mosaic_interpreter():
  """Resets the Mosaic GPU interpreter's process-wide state after a test.

  The interpreter keeps one simulated GPU per process; a kernel that raised
  leaves barriers and allocations behind that would fail every later
  interpreted kernel. The reset lives in JAX's private API, so a JAX that
  moved it fails here, loudly, instead of leaking state silently.
  """
  try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # pylint: disable=import-outside-toplevel
    reset = interpret_pallas_call.reset_gpu_interpret_mode_state
  except (ImportError, AttributeError) as e:
    pytest.fail(f"the Mosaic GPU interpreter's reset moved in this JAX "
                f"({e}); update reset_mosaic_interpreter in tests/conftest.py")
  yield
  reset()


def pytest_runtest_logreport(report):
  """With INFCL_FAILURES=<file>, each failure's report is appended to it as
  it happens (the controller's hook under xdist): a GPU job cut by its box
  prints no end-of-run summary, and its failures' reasons would be lost."""
  path = os.environ.get("INFCL_FAILURES")
  if path and report.failed:
    with open(path, "a", encoding="utf-8") as f:
      f.write(f"==== {report.nodeid} ({report.when}, {report.duration:.1f} s)"
              f"\n{report.longreprtext}\n")
