"""The GPU's exactness grid of ``bash scripts/gpu.sh verify`` (``-m gpu``).

Every tiled backend (mosaic, triton, pallas, xla) x every input dtype
(bfloat16, float16, float32) x every mode of the loss, each at the GPU's
default tiles (no ``block_sizes``) on odd sizes, against float64 relative to
the true values, at three confidences (a row loss of 10, 1e-4 and 1e-30; one
compiled program per case, only the scale changes):

* plain: both directions;
* one-way: text_to_image with extra images (keys without a query);
* labels: image_to_text, each query's positive a key of its own label;
* labels + groups: three id layouts (``LABEL_GROUP_LAYOUTS``): each
  query's positive outside its group, the only related pair, or nothing
  related;
* groups "mask": the other captions of an image left out;
* groups "positives": singletons and groups of 2 and 3, a pair of id arrays;
* sigmoid: SigLIP, plain and with groups.

The bounds are the project's: 1e-3 (float32), 3e-2 (16-bit, against the
float64 loss of the rounded inputs). float32 on the kernels' default TF32
tiles is compared, at 1e-3, with float64 of the TF32-rounded operands (the
positives, which the loss takes outside the tiles, in float32:
``np_reference.clip_loss_and_grads(tiles="tf32")``), as 16-bit inputs are
with float64 of theirs; with ``precision="high"`` with plain float64
(``test_float32_at_the_tf32_threshold``). float16 is asked at the loss of 10
only: at D = 200 the gradient entries of a loss of 1e-4 (~ scale * loss /
(B sqrt(D))) are already below float16's smallest normal, 6e-5, in the
float16 gradients the caller gets back, whatever the kernel did.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import contrastive_loss, sigmoid_loss
from tests import group_reference
from tests import np_reference
from tests import test_confident as tc
from tests.helpers import as64, seed_of

# INFCL_VERIFY_ON_CPU=1 runs the grid's logic on the CPU (its xla cases are
# quick there): how the grid was checked before its first GPU run.
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu"
                                 and not os.environ.get("INFCL_VERIFY_ON_CPU"),
                                 reason="the GPU's grid (gpu.sh verify)")]

BACKENDS = ["mosaic", "triton", "pallas", "xla"]
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
LEVELS = [10.0, 1e-4, 1e-30]
N, N_KEYS, D = 1031, 1100, 200
MODES = ["plain", "one_way", "labels", "labels_groups", "mask", "positives"]


@functools.lru_cache(maxsize=None)
def _softmax_fn(backend, direction, group_mode, has_labels, has_groups,
                precision=None):
  def f(x, y, t, labels, groups):
    return contrastive_loss(
        x, y, t, direction=direction, backend=backend,
        labels=labels if has_labels else None,
        groups=groups if has_groups else None, group_mode=group_mode,
        precision=precision)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


@functools.lru_cache(maxsize=None)
def _inputs64(mode, level, layout=0):
  """Float64 inputs of a case, shared by the dtypes and backends:
  (x, y, t, labels, g_x, g_y, direction, near)."""
  rng = np.random.default_rng(seed_of("verify", mode, level, layout))
  labels = g_x = g_y = near = None
  direction, n_x, n_y = "both", N, N
  if mode == "positives":
    g_x, g_y, near = tc.mixed_ids(N, pair=True)
    x, y, t = np_reference.positives_inputs(rng, N, N, D, level, g_x, g_y,
                                            near=near)
    return x, y, t, None, g_x, g_y, direction, near
  if mode == "one_way":
    direction, n_x = "text_to_image", N_KEYS
  elif mode in ("labels", "labels_groups"):
    direction, n_y = "image_to_text", N_KEYS
    labels = rng.permutation(N_KEYS)[:N]
  groups = np.repeat(np.arange(N), 3)[:N] if mode == "mask" else None
  x, y, t = np_reference.confident_inputs(
      rng, n_x, n_y, D, level, direction=direction, labels=labels,
      groups=groups)
  if mode == "mask":
    g_x = g_y = groups
  elif mode == "labels_groups":
    g_x, g_y = LABEL_GROUP_LAYOUTS[layout](labels)
  return x, y, t, labels, g_x, g_y, direction, near


# labels= with groups=: (image ids, text ids) from the labels. Each query's
# positive is then outside its group, in it, or nothing is related.
LABEL_GROUP_LAYOUTS = [
    # The case: ids i + 7 on both sides, the positive elsewhere.
    lambda labels: (np.arange(N) + 7, np.arange(N_KEYS) + 7),
    # Only the positives related: the plain loss.
    lambda labels: ((np.arange(N_KEYS) + 7)[labels], np.arange(N_KEYS) + 7),
    # Nothing related.
    lambda labels: (np.arange(N), 10**6 + np.arange(N_KEYS)),
]


def _case(mode, level, dtype, layout=0, tiles=None):
  """(x, y, t, labels, groups, ref, direction, group_mode, check_layout) at
  ``dtype``; the reference is taken on the rounded inputs (``tiles``: see
  ``np_reference.clip_loss_and_grads``)."""
  x, y, t, labels, g_x, g_y, direction, near = _inputs64(mode, level, layout)
  del near
  x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
  group_mode = "positives" if mode == "positives" else "mask"
  rel = None if g_x is None else np.equal.outer(g_x, g_y)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), t, 0.0, direction,
                                         labels, rel, group_mode=group_mode,
                                         tiles=tiles)
  groups = None if g_x is None else (jnp.asarray(g_x), jnp.asarray(g_y))
  lab = None if labels is None else jnp.asarray(labels)
  return (x, y, jnp.float32(t), lab, groups, ref, direction, group_mode,
          (rel, direction))


# mosaic runs float32 on the Triton-language kernels, triton's own (its
# ``fallback``): one mode there checks the route, triton's cases the rest.
SOFTMAX_CASES = [
    pytest.param(b, d, m, id=f"{b}-{jnp.dtype(d).name}-{m}")
    for b in BACKENDS for d in DTYPES for m in MODES
    if not (b == "mosaic" and d == jnp.float32 and m != "plain")]


@pytest.mark.parametrize("backend,dtype,mode", SOFTMAX_CASES)
def test_softmax(backend, dtype, mode):
  layouts = range(len(LABEL_GROUP_LAYOUTS)) if mode == "labels_groups" else [0]
  for level in LEVELS:
    if dtype == jnp.float16 and level < 1:
      continue
    for layout in layouts:
      # labels= with groups= runs the xla backend's tiles (IEEE float32 by
      # default) on every backend: plain float64 there.
      tiles = (None if mode == "labels_groups"
               else tc.reference_tiles(dtype, backend, D))
      (x, y, t, labels, groups, ref, direction, group_mode,
       check_layout) = _case(mode, level, dtype, layout, tiles)
      fn = _softmax_fn(backend, direction, group_mode, labels is not None,
                       groups is not None)
      out = fn(x, y, t, labels, groups)
      what = (f"{backend} {jnp.dtype(dtype).name} {mode}[{layout}] loss "
              f"{level:g} scale {float(t):.1f}")
      if mode == "positives":
        tc.check_positives(out, ref, dtype, what, check_layout)
      else:
        tc.check(out, ref, dtype, what)


@functools.lru_cache(maxsize=None)
def _sigmoid_fn(backend, has_groups):
  def f(x, y, t, b, groups):
    return sigmoid_loss(x, y, t, b, backend=backend,
                        groups=groups if has_groups else None)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "groups"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigmoid(backend, dtype, grouped):
  rng = np.random.default_rng(seed_of("verify sigmoid", grouped))
  x, y = (jnp.asarray(a / np.linalg.norm(a, axis=1, keepdims=True), dtype)
          for a in rng.standard_normal((2, N, D)))
  ids = np.repeat(np.arange(N), 2)[:N] if grouped else None
  t, b = 10.0, -10.0
  if grouped:
    ref = group_reference.sigmoid_loss_and_grads(as64(x), as64(y), t, b, ids)
  else:
    ref = np_reference.sigmoid_loss_and_grads(as64(x), as64(y), t, b)
  out = _sigmoid_fn(backend, grouped)(
      x, y, jnp.float32(t), jnp.float32(b),
      None if ids is None else jnp.asarray(ids))
  val, (dx, dy, dt, db) = out
  bound = tc.BOUND[dtype]
  errs = {"loss": abs(float(val) - ref[0]) / abs(ref[0]),
          "d image": tc.rel_err(dx, ref[1]), "d text": tc.rel_err(dy, ref[2]),
          "d scale": abs(float(dt) - ref[3]) / abs(ref[3]),
          "d bias": abs(float(db) - ref[4]) / abs(ref[4])}
  bad = {k: f"{v:.2e}" for k, v in errs.items() if not v <= bound}
  assert not bad, f"{backend} sigmoid {jnp.dtype(dtype).name}: {bad}"


@pytest.mark.parametrize("precision", [None, "high"],
                         ids=["default", "high"])
@pytest.mark.parametrize("backend", ["mosaic", "triton", "pallas"])
def test_float32_at_the_tf32_threshold(backend, precision):
  """float32 at D = 64, the smallest depth that runs on TF32 tiles by
  default (``backends.precision.TF32_MIN_DEPTH``), one-way with labels
  and extra keys, a confident model: by default within 1e-3 of float64 of
  the TF32-rounded operands (``test_confident.reference_tiles``: TF32's
  own error, 1.6e-3 measured at a loss of 8e-9, reaches 1e-2 at 1e-30 and
  scale 170), and with ``precision="high"``, 3-pass TF32, within 1e-3 of
  plain float64 whatever the confidence."""
  fn = _softmax_fn(backend, "image_to_text", "mask", True, False, precision)
  for level in (10.0, 1e-4, 1e-9, 1e-30):
    rng = np.random.default_rng(seed_of("verify d64", level))
    labels = rng.permutation(N_KEYS)[:N]
    x, y, t = np_reference.confident_inputs(
        rng, N, N_KEYS, 64, level, direction="image_to_text", labels=labels)
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    ref = np_reference.clip_loss_and_grads(
        as64(x), as64(y), t, 0.0, "image_to_text", labels,
        tiles=tc.reference_tiles(jnp.float32, backend, 64, precision))
    tc.check(fn(x, y, jnp.float32(t), jnp.asarray(labels), None), ref,
             jnp.float32, f"{backend} float32 D=64 {precision or 'default'} "
             f"loss {level:g} scale {t:.1f}")
