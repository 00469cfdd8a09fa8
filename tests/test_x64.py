"""``jax_enable_x64=True`` on every backend: the same values as with x64 off.

x64 is switched on only inside ``x64()`` blocks, which set the global flag
and restore it (JAX keys its caches by the setting, so nothing leaks into
other tests). Not ``jax.enable_x64(True)``: that context is thread-local,
and the Mosaic GPU interpreter runs the kernel in worker threads, which
would lower it with x64 off. The kernels' index arithmetic is int32 by construction: their bodies are traced with x64
off, and the test reads every kernel's jaxpr for a 64-bit value. float64
inputs are computed in float32: the float32 values, with float64 gradients.
The triton backend's kernels are Triton-language (their integers are
Triton's own); its x64 case runs in tests/test_native_triton.py's leg.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from infcl_jax import BlockSizes
from infcl_jax import contrastive_loss
from infcl_jax import sharded_contrastive_loss
from infcl_jax import sharded_sigmoid_loss
from infcl_jax import sigmoid_loss
from tests import np_reference
from tests.helpers import assert_rel_close, rand_emb, seed_of, subjaxprs

# Several row blocks, programs and panels at these sizes (the Pallas
# kernels); the Mosaic GPU kernels' smallest tiles.
BLOCKS = {"pallas": BlockSizes(block_q=16, block_k=32, block_d=16,
                               num_programs=3, bwd_block_q=16, bwd_block_k=32,
                               panel_rows=32, f32_precision="highest"),
          "mosaic": BlockSizes(block_q=64, block_k=128, block_d=64,
                               num_programs=3, bwd_block_q=64,
                               bwd_block_k=128, panel_rows=128,
                               f32_precision="highest"),
          "xla": None, "reference": None}
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")

pytestmark = pytest.mark.usefixtures("reset_mosaic_interpreter")


@contextlib.contextmanager
def x64():
  before = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", before)


def _cases(n, d):
  """(name, loss fn of (x, y, scale, bias), needs) of each path."""
  g = np.arange(n) % 5
  lab = (np.arange(n) * 7) % n
  return {
      "softmax": lambda be, bs: lambda x, y, t, b: contrastive_loss(
          x, y, t, logit_bias=b, backend=be, block_sizes=bs),
      "softmax_groups": lambda be, bs: lambda x, y, t, b: contrastive_loss(
          x, y, t, logit_bias=b, backend=be, block_sizes=bs, groups=g,
          group_mode="positives"),
      "softmax_labels": lambda be, bs: lambda x, y, t, b: contrastive_loss(
          x, y, t, logit_bias=b, backend=be, block_sizes=bs,
          direction="image_to_text", labels=lab),
      "sigmoid_groups": lambda be, bs: lambda x, y, t, b: sigmoid_loss(
          x, y, t, b, backend=be, block_sizes=bs, groups=g),
  }


def _value_and_grads(fn, x, y):
  return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3)))(
      x, y, jnp.float32(7.0), jnp.float32(-2.0))


def _assert_same(a, b, what):
  """Equal up to float32 rounding of a differently compiled program (they
  come out bitwise equal on the CPU)."""
  for name, u, v in zip(("loss", "dx", "dy", "dscale", "dbias"),
                        jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(u, np.float64),
                               np.asarray(v, np.float64), rtol=1e-6,
                               atol=1e-7, err_msg=f"{what} {name}")


def _kernel_64bit(closed):
  """{kernel name: [64-bit value types]} of every kernel in the jaxpr."""
  found = {}

  def walk(jaxpr, kernel):
    for eqn in jaxpr.eqns:
      inner = kernel
      if kernel is None and eqn.primitive.name in KERNEL_PRIMITIVES:
        inner = str(eqn.params.get("name"))
        found.setdefault(inner, [])
      if inner is not None:
        for v in [*eqn.invars, *eqn.outvars]:
          dtype = getattr(getattr(v, "aval", None), "dtype", None)
          try:
            wide = dtype is not None and np.dtype(dtype).itemsize == 8
          except TypeError:  # Barriers and other non-array types.
            wide = False
          if wide:
            found[inner].append(f"{eqn.primitive.name}: {dtype}")
      for p in eqn.params.values():
        for sub in subjaxprs(p):
          walk(sub, inner)

  walk(closed.jaxpr, None)
  return found


@pytest.mark.parametrize("backend,dtype", [
    ("pallas", jnp.float32), ("mosaic", jnp.bfloat16)])
def test_kernel_indices_are_int32_under_x64(backend, dtype):
  """Every kernel of both families, both passes, with groups and labels,
  traced under x64: no 64-bit value inside any of them."""
  n, d = 37, 20
  rng = np.random.default_rng(seed_of("x64 kernels", backend))
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, n, d, dtype)
  with x64():
    found = {}
    for make in _cases(n, d).values():
      fn = make(backend, BLOCKS[backend])
      found.update(_kernel_64bit(jax.make_jaxpr(jax.grad(
          fn, argnums=(0, 1, 2, 3)))(x, y, jnp.float32(7.0),
                                      jnp.float32(-2.0))))
  assert len(found) >= 4, found  # Forward and backward of both families.
  assert not any(found.values()), found


@pytest.mark.parametrize("backend,dtype", [
    ("xla", jnp.float32), ("reference", jnp.bfloat16),
    ("pallas", jnp.float32), ("mosaic", jnp.bfloat16)])
def test_x64_values_equal_x64_off(backend, dtype):
  """Loss and the four gradients of each path, the backend's default
  tiles (the test above traces the several-tile ones)."""
  n, d = 37, 20
  rng = np.random.default_rng(seed_of("x64 values", backend))
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, n, d, dtype)
  for name, make in _cases(n, d).items():
    fn = make(backend, None)
    off = _value_and_grads(fn, x, y)
    with x64():
      on = _value_and_grads(fn, x, y)
    assert jax.tree.map(lambda v: v.dtype, on) == jax.tree.map(
        lambda v: v.dtype, off)
    _assert_same(on, off, f"{backend} {name}")


def test_float64_inputs_are_computed_in_float32():
  """Under x64, float64 embeddings give the float32 inputs' values (the
  losses compute in float32), with float64 gradients, on every backend;
  within float32 rounding of the float64 reference."""
  n, d, t = 29, 12, 9.0
  rng = np.random.default_rng(seed_of("float64 inputs"))
  xd, yd = rng.standard_normal((n, d)), rng.standard_normal((n, d))
  xd /= np.linalg.norm(xd, axis=1, keepdims=True)
  yd /= np.linalg.norm(yd, axis=1, keepdims=True)
  ref = np_reference.clip_loss_and_grads(xd, yd, t)
  for backend in ("xla", "pallas", "mosaic", "reference"):
    def fn(a, b):
      return contrastive_loss(a, b, t, backend=backend)
    with x64():
      val, (dx, dy) = jax.value_and_grad(fn, argnums=(0, 1))(
          jnp.asarray(xd), jnp.asarray(yd))
      assert dx.dtype == dy.dtype == jnp.float64 and val.dtype == jnp.float32
    want = jax.value_and_grad(fn, argnums=(0, 1))(
        jnp.asarray(xd, jnp.float32), jnp.asarray(yd, jnp.float32))
    _assert_same((val, dx, dy), want, f"{backend} float64")
    assert abs(float(val) - ref[0]) <= 1e-5 * ref[0]
    assert_rel_close(dx, ref[1], 5e-5, what=f"{backend} dx")


@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_x64_across_devices(strategy):
  """The ring and the gather on 4 host devices (the cross-device index
  arithmetic: ppermute, axis_index, labels and group ids), xla backend."""
  mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
  n, d = 40, 16
  rng = np.random.default_rng(seed_of("x64 ring", strategy))
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, n, d, jnp.float32)
  g = np.arange(n) % 7
  lab = (np.arange(n) * 3) % n

  def losses(x, y, t, b):
    soft = sharded_contrastive_loss(
        x, y, t, logit_bias=b, mesh=mesh, axis_name="d", strategy=strategy,
        backend="xla", groups=g)
    one_way = sharded_contrastive_loss(
        x, y, t, mesh=mesh, axis_name="d", strategy=strategy, backend="xla",
        direction="image_to_text", labels=lab)
    sig = sharded_sigmoid_loss(x, y, t, b, mesh=mesh, axis_name="d",
                               backend="xla", groups=g)
    return soft + 0.5 * one_way + 0.25 * sig

  off = _value_and_grads(losses, x, y)
  with x64():
    on = _value_and_grads(losses, x, y)
  _assert_same(on, off, strategy)


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("backend", ["pallas", "mosaic", "triton"])
def test_x64_compiled_kernels_give_the_x64_off_values(backend, dtype):
  """The kernels compiled (Triton, Mosaic GPU, Triton-language) in a
  program traced under x64: every path's loss and gradients equal those
  with x64 off, at an odd size of several tiles."""
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  if not registry.available(backend, "softmax"):
    pytest.skip(f"{backend} does not run on this GPU or lacks its extra")
  n, d = 1031, 200
  rng = np.random.default_rng(seed_of("x64 gpu", backend, str(dtype)))
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, n, d, dtype)
  for name, make in _cases(n, d).items():
    fn = make(backend, BlockSizes(f32_precision="highest"))
    off = _value_and_grads(fn, x, y)
    with x64():
      on = _value_and_grads(fn, x, y)
    _assert_same(on, off, f"{backend} {name}")
