"""The float32 matmul precision of every tiled backend: one policy.

bfloat16 / float16 inputs always run at ``lax.Precision.DEFAULT``: tensor
cores with float32 accumulation. float32 inputs run at one of three
precisions, named as ``jax.lax.Precision`` names them:

* "default": TF32 tensor cores (a 10-bit mantissa). Each operand is
  rounded to nearest TF32 first: Triton 3.6's TF32 dot truncates, which
  shrinks every product by ~1e-3 on average, a bias that the loss does not
  average away. The loss keeps each query's positive out of the tiles (at
  every precision: ``losses.terms.confident``) and takes it with its
  float32 logit, so a confident model's small loss is not the difference
  of two TF32-rounded numbers. What is left is the negatives' own TF32
  error, ~4e-4 * scale / sqrt(D) per logit, which the gradients carry
  (~2e-2 at D = 3, scale 100). The softmax backward's panels G are then float16,
  and its GEMMs run on 16-bit tensor cores (``panel_backward.softmax_grad``):
  float16 keeps TF32's 10 mantissa bits, so this rounds G and the operands
  as TF32 GEMMs would, at twice their rate and half G's bytes.
* "high": 3-pass TF32 (x ~ big + small, the small x small product
  dropped): float32-accurate logits (~1e-6) at about three TF32 passes.
  The Triton-language kernels run Triton's "tf32x3" dot, the Pallas-Triton
  kernels ``DotAlgorithmPreset.TF32_TF32_F32_X3``, XLA its own
  ``Precision.HIGH``.
* "highest": full IEEE float32 (CUDA cores, several times slower).

Which one, in this order:

1. ``precision=`` of the loss, or ``BlockSizes.f32_precision`` (the loss
   puts its ``precision=`` there; ``BlockSizes(f32_precision=...)`` needs no
   block sizes);
2. "highest" when JAX's own float32 switch asks for it
   (``jax.default_matmul_precision`` / ``jax_default_matmul_precision``
   "highest" or "float32"), read when the loss is traced, so a ``with``
   block around the call takes effect (it is part of jit's cache key);
3. the backend's own default, ``F32_DEFAULT`` on its class: for the kernel
   backends ``BY_DEPTH``, "default" (TF32, the positive put back) from
   ``TF32_MIN_DEPTH`` on and "high" below it, so that float32 is within
   1e-3 of float64 by default at the cost of TF32 where TF32 is exact
   enough; "highest" for the portable ``xla`` backend (the exactness
   baseline, held to ~1e-5).

Off the GPU every precision is exact float32 (the interpreters and XLA's
CPU dot ignore TF32), so the rounding above happens only in compiled
kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

PRECISIONS = ("default", "high", "highest")
# BlockSizes' earlier name for "default".
ALIASES = {"tf32": "default"}
_JAX_HIGHEST = ("highest", "float32", "fastest_float32_off")
_LAX = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
        "highest": lax.Precision.HIGHEST}
# A backend default: TF32 from this embedding depth on, 3-pass TF32 below.
# TF32's logit error, ~4e-4 * scale / sqrt(D) (the positive put back), is
# what the gradients carry; at scale 100 on trained-looking inputs a float64
# model of rounded TF32 tiles puts their error (relative to the summed
# terms) at 3.2e-3 at D = 3, 1.1e-3 at D = 8, 4.5e-4 at D = 32 and 2.7e-4
# at D = 64 (the loss within 2e-4 everywhere), so 64 keeps a margin of ~4
# under 1e-3. Below it the tiles are exp-bound, and the two extra passes
# cost little; at the usual D of 256 to 1024 TF32 is ~3x faster.
BY_DEPTH = "by depth"
TF32_MIN_DEPTH = 64


def canonical(value, what="precision"):
  """``value`` as one of ``PRECISIONS`` (None stays None), or a one-line
  ValueError naming ``what``."""
  if value is None:
    return None
  value = ALIASES.get(value, value) if isinstance(value, str) else value
  if value not in PRECISIONS:
    raise ValueError(f"{what} must be one of {PRECISIONS} (or None: the "
                     f"backend's default), got {value!r}")
  return value


def f32_mode(f32_precision: str | None, default: str, depth: int) -> str:
  """The precision of float32 inputs of embedding depth ``depth`` (the
  order above)."""
  if f32_precision is not None:
    return canonical(f32_precision)
  if jax.config.jax_default_matmul_precision in _JAX_HIGHEST:
    return "highest"
  if default == BY_DEPTH:
    return "default" if depth >= TF32_MIN_DEPTH else "high"
  return default


def tf32_tiles(dtype, f32_precision: str | None, default: str,
               depth: int) -> bool:
  """Whether inputs of ``dtype`` and ``depth`` run on TF32 tiles (float32
  at "default"): where the loss puts the positive back in float32 and the
  Triton kernels round their operands to TF32."""
  return (jnp.dtype(dtype) == jnp.float32
          and f32_mode(f32_precision, default, depth) == "default")


def matmul_precision(dtype, f32_precision: str | None, default: str,
                     depth: int) -> lax.Precision:
  """The ``lax.Precision`` of a backend's matmuls on inputs of ``dtype``
  and embedding depth ``depth``."""
  if jnp.dtype(dtype) != jnp.float32:
    return lax.Precision.DEFAULT  # bf16 / f16 tensor cores.
  return _LAX[f32_mode(f32_precision, default, depth)]


def xla_dot_precision(prec, platform: str):
  """``prec`` as XLA's own dots take it on ``platform`` (the xla backend's
  tiles and the kernels' backward GEMMs): XLA on the GPU reads
  ``Precision.HIGH`` as one TF32 pass, so "high" (3-pass TF32) is the
  ``TF32_TF32_F32_X3`` algorithm there. Measured before (H100, jax
  0.11.2): the backward's dX GEMM on one TF32 pass put float32 gradients
  1.5e-3 off at D = 16 ("positives" groups, where G's entries cancel).
  Elsewhere every precision is exact float32."""
  if prec == lax.Precision.HIGH and platform == "gpu":
    return lax.DotAlgorithmPreset.TF32_TF32_F32_X3
  return prec


def round_tf32(x):
  """float32 ``x`` rounded to nearest TF32 (10 mantissa bits, ties to
  even); inf and NaN stay as they are, a value past TF32's largest finite
  one becomes inf (as any rounding to a narrower format)."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  keep = bits + jnp.uint32(0xFFF) + ((bits >> 13) & jnp.uint32(1))
  rounded = lax.bitcast_convert_type(keep & jnp.uint32(0xFFFFE000),
                                     jnp.float32)
  return jnp.where(jnp.isfinite(x), rounded, x)
