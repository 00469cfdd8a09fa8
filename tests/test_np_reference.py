"""The float64 references are themselves checked: finite differences and JAX."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infcl_jax
from tests import np_reference


@pytest.mark.parametrize("direction,bx,by,labels", [
    ("both", 5, 5, None), ("image_to_text", 4, 7, None),
    ("text_to_image", 6, 3, None),
    # Arbitrary positives, one repeated.
    ("image_to_text", 4, 7, [6, 2, 2, 0]), ("text_to_image", 6, 3, [5, 0, 5])])
def test_analytic_grads_match_finite_differences(direction, bx, by, labels):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((bx, 3))
  y = rng.standard_normal((by, 3))
  t, b = 1.7, 0.3
  loss, dx, dy, dt, db = np_reference.clip_loss_and_grads(
      x, y, t, b, direction, labels)
  f = lambda x, y, t, b: np_reference.clip_loss_and_grads(
      x, y, t, b, direction, labels)[0]
  h = 1e-6
  for arr, grad in ((x, dx), (y, dy)):
    for idx in np.ndindex(arr.shape):
      old = arr[idx]
      arr[idx] = old + h
      up = f(x, y, t, b)
      arr[idx] = old - h
      down = f(x, y, t, b)
      arr[idx] = old
      np.testing.assert_allclose(grad[idx], (up - down) / (2 * h), atol=1e-7)
  np.testing.assert_allclose(dt, (f(x, y, t + h, b) - f(x, y, t - h, b)) / (2 * h), atol=1e-7)
  np.testing.assert_allclose(db, (f(x, y, t, b + h) - f(x, y, t, b - h)) / (2 * h), atol=1e-7)
  assert abs(db) < 1e-12  # A bias shifts all logits of a row alike.


@pytest.mark.parametrize("direction,bx,by,labels", [
    ("both", 9, 9, None), ("image_to_text", 5, 11, None),
    ("text_to_image", 8, 2, None), ("image_to_text", 5, 11, [10, 3, 3, 0, 7]),
    ("text_to_image", 8, 2, [7, 7])])
def test_jax_reference_module_matches_numpy_float64(direction, bx, by, labels):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((bx, 4))
  y = rng.standard_normal((by, 4))
  lab = None if labels is None else jnp.asarray(labels)
  with jax.enable_x64(True):
    f = lambda x, y, t, b: infcl_jax.reference.contrastive_loss_reference(
        x, y, t, logit_bias=b, direction=direction, labels=lab)
    val, grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(
        jnp.asarray(x), jnp.asarray(y), jnp.float64(2.5), jnp.float64(-1.0))
  ref = np_reference.clip_loss_and_grads(x, y, 2.5, -1.0, direction, labels)
  np.testing.assert_allclose(val, ref[0], rtol=1e-12)
  for g, r in zip(grads, ref[1:]):
    np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-14)
