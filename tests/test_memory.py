"""Memory scaling from XLA's own buffer assignment (compile only, no run).

The tiled backend's temporary memory for loss + grads must grow linearly in
B and stay far below one B x B float32 matrix; the full-matrix reference
grows quadratically. Compiling is cheap, so these run at real sizes on CPU.
"""
import jax
import jax.numpy as jnp
import pytest

from infcl_jax import contrastive_loss

D = 768


def temp_bytes(batch, backend, dtype=jnp.bfloat16, **kw):
  x = jax.ShapeDtypeStruct((batch, D), dtype)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  f = lambda x, y, t: contrastive_loss(x, y, t, backend=backend, **kw)
  grad = jax.jit(jax.grad(f, argnums=(0, 1, 2)))
  return grad.lower(x, x, t).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("direction", ["both", "image_to_text"])
def test_tiled_memory_is_linear_in_batch(direction):
  sizes = [16384, 32768, 65536]
  temps = [temp_bytes(b, "xla", direction=direction) for b in sizes]
  # O(B * D) f32 gradient accumulators, far below one f32 B x B matrix.
  assert temps[-1] < 0.1 * sizes[-1] ** 2 * 4, temps
  # Doubling B at most doubles the temp memory (plus a constant tile).
  for (b0, t0), (b1, t1) in zip(zip(sizes, temps), zip(sizes[1:], temps[1:])):
    assert 1.3 < t1 / t0 < 2.3, (b0, t0, b1, t1)


def test_reference_memory_is_quadratic():
  t0, t1 = temp_bytes(4096, "reference"), temp_bytes(8192, "reference")
  assert t1 / t0 > 3.5, (t0, t1)
  assert t1 > 8192 * 8192 * 4
