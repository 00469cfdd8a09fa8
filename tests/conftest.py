"""Session setup shared by every test module.

The cross-device tests (ring, gather, sigmoid ring, trainer) need several
devices; on a CPU, XLA provides them only if the flag is in XLA_FLAGS before
the CPU backend starts, i.e. before any test module imports jax.
"""
import os

_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()

# Quick mode (`-m "not slow"`): the tests listed in slow_tests.txt (measured
# at 1.5 s or more each) are marked slow here, beside those that carry
# @pytest.mark.slow in their files. CI runs everything.
import pathlib  # pylint: disable=wrong-import-position

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
