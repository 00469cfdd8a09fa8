"""Session setup shared by every test module.

The cross-device tests (ring, gather, sigmoid ring, trainer) need several
devices; on a CPU, XLA provides them only if the flag is in XLA_FLAGS before
the CPU backend starts, i.e. before any test module imports jax.
"""
import os

_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES}".strip()
