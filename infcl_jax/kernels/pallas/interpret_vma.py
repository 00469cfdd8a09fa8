"""Running a Pallas kernel body so that interpret mode works inside shard_map.

Inside ``jax.shard_map`` (``check_vma=True``) the Pallas interpreter of
jax 0.11.2 evaluates the kernel's jaxpr on device-varying values, and then
rejects any straight-line primitive that mixes them with values the kernel
made itself (constants, program ids, a ref read at a constant index):
"Primitive ... requires varying manual axes to match". The body of a while
loop is not re-checked that way, so in interpret mode the body runs inside a
loop whose trip count (1) is known only at run time. The program ids are
read outside the loop (the interpreter substitutes them only there) and
passed in. Compiled (Triton) kernels run the body as it is.

The body is traced with ``jax_enable_x64`` off, so that its index
arithmetic is int32 by construction: under x64 a Python int in ``lax.div``
or a ``fori_loop`` with static bounds would otherwise be int64. The kernels
take no 64-bit operand (the backends cast to float32 / int32 first).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def run_body(body, refs, *, num_ids, interpret):
  """Calls ``body(*program_ids, *refs)``; in a one-trip loop if interpret.
  Traced with x64 off (int32 indices, see above)."""
  with jax.enable_x64(False):
    ids = tuple(pl.program_id(a) for a in range(num_ids))
    if not interpret:
      body(*ids, *refs)
      return
    once = jnp.minimum(ids[0], 0) + 1

    def run(t, c):
      body(*ids, *refs)
      return c
    lax.fori_loop(0, once, run, 0)
