"""float32 on the GPU's TF32 tiles, emulated on the CPU: the numbers the GPU
computes, checked before a device run.

The interpreters compute exact float32 (XLA's CPU dot ignores TF32), so
``-m gpu`` would be the first to see TF32's rounding. Here the Pallas
interpreter is made to do what the compiled kernels do on TF32 tiles: the
operands rounded to nearest TF32 (``precision.round_tf32``; the products of
two TF32 numbers are exact in float32, as in the tensor cores) and, in the
softmax backward, float16 gradient panels with 16-bit GEMMs. A confident
model's loss and gradients are then held to 1e-3 of float64 of the
TF32-rounded operands (``np_reference.clip_loss_and_grads(tiles="tf32")``,
the GPU grid's reference in ``test_gpu_verify``), in the modes where the
positives leave the tiles by index or by group.

What this caught: in ``group_mode="positives"`` the float16 panels put a
confident one-key row's gradient 2.9e-3 off (one scale per batch for G,
set by the O(1) entries of a query with several related keys), now float32
panels there (``BlockSizes.f32_panels``); and the grid's float32 bound of
1e-3 against plain float64, which TF32's own logit error exceeds at scale
130 (1.3e-3 at D = 200).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import contrastive_loss
from infcl_jax.backends import triton_tiles
from tests import np_reference
from tests import test_confident as tc
from tests.helpers import as64, seed_of

N, N_KEYS, D = 261, 290, 96
TILES = tc.KERNEL_TILES


@pytest.fixture
def tf32_tiles(monkeypatch):
  """The Pallas interpreter with the compiled kernels' TF32 numerics."""
  monkeypatch.setattr(triton_tiles.TritonTiles, "tf32_numerics", True)


def _case(mode, level):
  rng = np.random.default_rng(seed_of("tf32 emulated", mode, level))
  labels = g_x = g_y = None
  direction = "both"
  if mode == "positives":
    g_x, g_y, near = tc.mixed_ids(N, pair=True)
    x, y, t = np_reference.positives_inputs(rng, N, N, D, level, g_x, g_y,
                                            near=near)
  else:
    n_y = N
    if mode == "labels":
      direction, n_y = "image_to_text", N_KEYS
      labels = rng.permutation(N_KEYS)[:N]
    x, y, t = np_reference.confident_inputs(rng, N, n_y, D, level,
                                            direction=direction,
                                            labels=labels)
  return x, y, t, labels, g_x, g_y, direction


@pytest.mark.parametrize("level", [1e-4, 1e-30])
@pytest.mark.parametrize("mode", ["plain", "labels", "positives"])
def test_confident_float32_on_emulated_tf32_tiles(tf32_tiles, mode, level):
  x, y, t, labels, g_x, g_y, direction = _case(mode, level)
  group_mode = "positives" if mode == "positives" else "mask"
  rel = None if g_x is None else np.equal.outer(g_x, g_y)
  x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
  ref = np_reference.clip_loss_and_grads(
      as64(x), as64(y), t, 0.0, direction, labels, rel,
      group_mode=group_mode, tiles="tf32")
  groups = None if g_x is None else (jnp.asarray(g_x), jnp.asarray(g_y))
  lab = None if labels is None else jnp.asarray(labels)
  f = lambda x, y, t: contrastive_loss(
      x, y, t, labels=lab, groups=groups, group_mode=group_mode,
      direction=direction, backend="pallas", block_sizes=TILES)
  out = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(
      x, y, jnp.float32(t))
  what = f"emulated TF32 {mode} loss {level:g} scale {t:.1f}"
  if mode == "positives":
    tc.check_positives(out, ref, jnp.float32, what, (rel, direction))
  else:
    tc.check(out, ref, jnp.float32, what)


def test_the_tf32_reference_is_not_plain_float64():
  """The reference's TF32 rounding matters where the test looks: at a row
  loss of 1e-30 the loss of the rounded operands differs from float64's by
  more than the 1e-3 the kernels are held to (else the tests above could
  not tell the two apart)."""
  x, y, t, labels, _, _, direction = _case("labels", 1e-30)
  x32 = as64(jnp.asarray(x, jnp.float32))
  y32 = as64(jnp.asarray(y, jnp.float32))
  plain = np_reference.clip_loss_and_grads(x32, y32, t, 0.0, direction,
                                           labels)
  tf32 = np_reference.clip_loss_and_grads(x32, y32, t, 0.0, direction,
                                          labels, tiles="tf32")
  assert abs(tf32[0] - plain[0]) / plain[0] > 1e-3
  assert tc.rel_err(tf32[1], plain[1]) > 1e-3
