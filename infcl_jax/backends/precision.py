"""The float32 matmul precision of every tiled backend: one policy.

bfloat16 / float16 inputs always run at ``lax.Precision.DEFAULT``: tensor
cores with float32 accumulation. float32 inputs run at, in this order:

1. ``BlockSizes.f32_precision`` when it is set ("tf32" or "highest");
2. "highest" when JAX's own float32 switch asks for it
   (``jax.default_matmul_precision`` / ``jax_default_matmul_precision``
   "highest" or "float32"), read when the loss is traced, so a ``with``
   block around the call takes effect (it is part of jit's cache key);
3. the backend's own default, ``F32_DEFAULT`` on its class. The portable
   ``xla`` backend keeps "highest": it is the exactness baseline, held to
   ~1e-5 in float32, where TF32 (a 10-bit mantissa) would give ~1e-3 on
   the logits. The kernel backends take "tf32": they exist for speed, and
   that is what XLA's own float32 GEMMs do on a GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
_JAX_HIGHEST = ("highest", "float32", "fastest_float32_off")


def f32_mode(f32_precision: str | None, default: str) -> str:
  """"tf32" or "highest" for float32 inputs (the order above)."""
  if f32_precision is not None:
    return f32_precision
  if jax.config.jax_default_matmul_precision in _JAX_HIGHEST:
    return "highest"
  return default


def matmul_precision(dtype, f32_precision: str | None,
                     default: str) -> lax.Precision:
  """The ``lax.Precision`` of a backend's matmuls on inputs of ``dtype``."""
  if (jnp.dtype(dtype) == jnp.float32
      and f32_mode(f32_precision, default) == "highest"):
    return lax.Precision.HIGHEST
  # DEFAULT: bf16 / f16 tensor cores; TF32 for float32 on the GPU.
  return lax.Precision.DEFAULT
