"""Session setup shared by every test module.

The cross-device tests (ring, gather, sigmoid ring, trainer) need several
devices; on a CPU, XLA provides them only if the flag is in XLA_FLAGS before
the CPU backend starts, i.e. before any test module imports jax.
"""
import os

_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()
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

# Quick mode (`-m "not slow"`): the tests listed in slow_tests.txt (measured
# at 1.5 s or more each) are marked slow here, beside those that carry
# @pytest.mark.slow in their files. CI runs everything.
import pytest  # pylint: disable=wrong-import-position

_SLOW_LIST = pathlib.Path(__file__).with_name("slow_tests.txt")


def _listed_slow():
  lines = _SLOW_LIST.read_text().splitlines()
  return {l.strip() for l in lines if l.strip() and not l.startswith("#")}


def pytest_collection_modifyitems(config, items):
  del config
  listed = _listed_slow()
  for item in items:
    if item.nodeid in listed:
      item.add_marker(pytest.mark.slow)


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
