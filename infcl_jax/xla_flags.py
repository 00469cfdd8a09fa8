"""XLA flags for the multi-GPU ring: what they are and how to set them.

The ring overlaps each transfer with a tile only if XLA's GPU scheduler
places the tile between the transfer's start and done. Two flags decide it:

* ``--xla_gpu_enable_latency_hiding_scheduler=true``: the scheduler that
  moves compute between an asynchronous collective's start and done (the
  default in recent jaxlib and in NVIDIA's containers; set for certainty).
* ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: how many
  asynchronous collectives may be in flight at once (XLA's default is 1).
  With 1, the backward's last float32 gradient accumulator (b x D: 201 MB at
  b = 65,536, D = 768) cannot be in flight across the small all-reduce of
  the loss and the scale gradient that follows the home tile, so XLA
  starts it after the home tile and nothing hides it. With 2 it overlaps
  the home tile (compiled schedules on 2 H200s, jax 0.11.2, checked on 2
  GPUs by the project's GPU tests:
  https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#ring).

XLA reads ``XLA_FLAGS`` once, when JAX first initializes its backends, so
these must be set before the first computation: either in the shell
(``export XLA_FLAGS="..."``, see ``recommended()``) or by calling
``apply()`` at the start of the program. Flags the user has already set
are left as they are. The flags only concern GPUs; XLA accepts and ignores
them on other platforms.
"""
from __future__ import annotations

import os

RING_GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)


def _name(flag: str) -> str:
  return flag.split("=", 1)[0]


def recommended(xla_flags: str = "") -> str:
  """``xla_flags`` with each of ``RING_GPU_FLAGS`` it does not set appended
  (a flag the string already sets, to any value, is kept as it is)."""
  have = {_name(f) for f in xla_flags.split()}
  extra = [f for f in RING_GPU_FLAGS if _name(f) not in have]
  return " ".join(xla_flags.split() + extra)


def apply(environ=None) -> str:
  """Adds the ring's recommended flags to ``XLA_FLAGS`` (in ``environ``,
  default ``os.environ``) and returns the new value.

  Raises:
    RuntimeError: JAX's backends are already initialized, so XLA would not
      read the flags (call this before the first computation).
  """
  environ = os.environ if environ is None else environ
  new = recommended(environ.get("XLA_FLAGS", ""))
  if new == environ.get("XLA_FLAGS", "").strip():
    return new
  if environ is os.environ and _backends_initialized():
    raise RuntimeError(
        "infcl_jax.xla_flags.apply() came after JAX initialized its backends, "
        "so XLA would ignore the flags: call it before the first computation "
        f"or export XLA_FLAGS=\"{new}\"")
  environ["XLA_FLAGS"] = new
  return new


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  except ImportError:  # JAX not installed or reorganized: nothing to check.
    return False
  check = getattr(xla_bridge, "backends_are_initialized", None)
  return bool(check()) if check is not None else False
