"""The gradient convention with ``axis_name``, pinned in all four cases.

With ``axis_name`` inside ``jax.shard_map`` the loss is the global loss, the
same on every device. Which gradients a user gets depends on two things the
library cannot see: ``check_vma`` and whether ``jax.grad`` is taken inside or
outside the ``shard_map``. Measured on jax 0.11.2 and 0.12.0.1:

=========  ==============  =================================================
check_vma  jax.grad        what comes out
=========  ==============  =================================================
True       outside         the global gradients (embeddings, scale, bias)
True       inside          exact partials for each shard; a replicated
                           parameter's grad is already the global one on
                           every device (JAX sums it: do not psum again)
False      inside          exact partials for each shard; a replicated
                           parameter's grad is this device's share: psum it
                           (sum, not mean) to get the global one
False      outside         every gradient divided by N (JAX divides the
                           cotangent of an unmapped output by N): don't
=========  ==============  =================================================

Each case is checked against the float64 numpy reference, including the 1/N
of the last row, so a JAX release that changes any of them fails here
(docs/losses.md, "Gradient convention", must then change with it).
"""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import infcl_jax
from tests import np_reference

N = 4          # devices in the mesh
B, D = 16, 8   # global batch (4 rows per device), embedding width
SCALE = 3.0
BIAS = -1.5    # sigmoid only: the softmax loss is invariant to a bias
RTOL = 2e-5    # float32 loss vs the float64 reference, relative to the norm


def _data():
  rng = np.random.default_rng(13)
  x = rng.normal(size=(B, D))
  y = rng.normal(size=(B, D))
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  return x.astype(np.float32), y.astype(np.float32)


def _family(name):
  """(local loss f(x, y, params), params, float64 (loss, dx, dy, dparams))."""
  x, y = _data()
  if name == "softmax":
    params = (np.float32(SCALE),)
    loss, dx, dy, ds, _ = np_reference.clip_loss_and_grads(x, y, SCALE)

    def f(xs, ys, p):
      return infcl_jax.contrastive_loss(xs, ys, p[0], axis_name="d",
                                        backend="xla")
    return f, params, (loss, dx, dy, (ds,))
  params = (np.float32(SCALE), np.float32(BIAS))
  loss, dx, dy, ds, db = np_reference.sigmoid_loss_and_grads(x, y, SCALE, BIAS)

  def f(xs, ys, p):
    return infcl_jax.sigmoid_loss(xs, ys, p[0], p[1], axis_name="d",
                                  backend="xla")
  return f, params, (loss, dx, dy, (ds, db))


def _close(actual, ref, what):
  actual = np.asarray(actual, np.float64)
  ref = np.asarray(ref, np.float64)
  err = np.linalg.norm(actual - ref) / max(np.linalg.norm(ref), 1e-30)
  assert err <= RTOL, f"{what}: relative error {err:.3g} (> {RTOL})"


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), ("d",))


def _specs(params):
  return (P("d"), P("d"), tuple(P() for _ in params))


@pytest.fixture(scope="module", autouse=True)
def _enough_devices():
  if len(jax.devices()) < N:
    pytest.skip(f"needs {N} devices (tests/conftest.py sets 8 on CPU)")


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_outside_shard_map(family, check_vma):
  """jax.grad of the shard_map: global gradients, or all / N if check_vma=False."""
  f, params, (loss, dx, dy, dparams) = _family(family)
  x, y = _data()
  sharded = jax.shard_map(f, mesh=_mesh(), in_specs=_specs(params),
                          out_specs=P(), check_vma=check_vma)
  value, (gx, gy, gp) = jax.jit(jax.value_and_grad(sharded, argnums=(0, 1, 2)))(
      x, y, params)
  # The documented pitfall: JAX divides the cotangent of the unmapped output
  # by N under check_vma=False, so every gradient is 1/N of the true one.
  factor = 1.0 if check_vma else 1.0 / N
  _close(value, loss, "loss")
  _close(gx, factor * dx, f"d image_emb (expected {factor} x the true gradient)")
  _close(gy, factor * dy, f"d text_emb (expected {factor} x the true gradient)")
  for name, g, ref in zip(("scale", "bias"), gp, dparams):
    _close(g, factor * ref, f"d {name} (expected {factor} x the true gradient)")


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
@pytest.mark.parametrize("check_vma", [True, False])
def test_grad_inside_shard_map(family, check_vma):
  """jax.grad inside: exact per-shard partials; params summed by JAX or by you."""
  f, params, (loss, dx, dy, dparams) = _family(family)
  x, y = _data()

  def step(xs, ys, p):
    value, (gx, gy, gp) = jax.value_and_grad(f, argnums=(0, 1, 2))(xs, ys, p)
    # Each device's parameter gradient as it comes out of jax.grad, unreduced,
    # stacked along the mesh axis so the test sees all N of them.
    return value, gx, gy, tuple(g[None] for g in gp)

  sharded = jax.shard_map(
      step, mesh=_mesh(), in_specs=_specs(params),
      out_specs=(P(), P("d"), P("d"), tuple(P("d") for _ in params)),
      check_vma=check_vma)
  value, gx, gy, gp = jax.jit(sharded)(x, y, params)
  _close(value, loss, "loss")
  # The embedding gradients are the exact partials of the global loss
  # w.r.t. each device's shard, in both modes.
  _close(gx, dx, "d image_emb")
  _close(gy, dy, "d text_emb")
  for name, per_device, ref in zip(("scale", "bias"), gp, dparams):
    per_device = np.asarray(per_device, np.float64)
    assert per_device.shape == (N,)
    if check_vma:
      # JAX already summed the replicated parameter's gradient over the
      # devices: each holds the global gradient (a further psum is N x).
      for i in range(N):
        _close(per_device[i], ref, f"d {name} on device {i}")
    else:
      # Each device holds its share; the global gradient is their SUM (psum),
      # not their mean, and no single share is it.
      _close(per_device.sum(), ref, f"sum over devices of d {name}")
      assert not np.allclose(per_device, ref, rtol=1e-3), (
          f"d {name}: every device already holds the global gradient")
