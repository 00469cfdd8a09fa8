"""The device facts a kernel launch needs, read in one place."""
from __future__ import annotations

import jax

# An H100 / H200 SXM has 132 streaming multiprocessors: the fallback where a
# device does not say (its core_count is missing or 0).
DEFAULT_SMS = 132


def num_sms() -> int:
  """Streaming multiprocessors of the first device (persistent grids launch
  one program per SM)."""
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or DEFAULT_SMS
  except RuntimeError:
    return DEFAULT_SMS
