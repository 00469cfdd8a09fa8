"""infcl_jax.flax.ContrastiveLoss: parameters, defaults, clamp, pass-through."""
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from tests import np_reference

BS = BlockSizes(block_q=8, block_k=16)


def _emb(seed, n=21, d=12):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, d)).astype(np.float32),
          rng.normal(size=(n, d)).astype(np.float32))


def _norm64(a):
  a = np.asarray(a, np.float64)
  return a / np.linalg.norm(a, axis=1, keepdims=True)


def _through_normalization(x, d_xhat):
  """Float64 gradient w.r.t. raw x of a loss of x / |x|, given d/d(x / |x|):
  the radial component is removed and the rest divided by |x|."""
  x = np.asarray(x, np.float64)
  norm = np.linalg.norm(x, axis=1, keepdims=True)
  xhat = x / norm
  return (d_xhat - np.sum(d_xhat * xhat, axis=1, keepdims=True) * xhat) / norm


def test_softmax_defaults_value_and_grad_match_float64():
  x, y = _emb(0)
  head = ContrastiveLoss(backend="xla", block_sizes=BS)
  v = head.init(jax.random.key(0), x, y)
  assert set(v["params"]) == {"log_scale"}  # CLIP: no bias by default.
  np.testing.assert_allclose(v["params"]["log_scale"], math.log(1 / 0.07),
                             rtol=1e-6)
  # Move away from the init so the check is not at a special point.
  v = {"params": {"log_scale": jnp.float32(1.7)}}
  loss, g = jax.value_and_grad(
      lambda p, x, y: head.apply({"params": p}, x, y), argnums=(0, 1))(
          v["params"], x, y)
  t = math.exp(1.7)
  ref, dx, _, dscale, _ = np_reference.clip_loss_and_grads(
      _norm64(x), _norm64(y), t)
  np.testing.assert_allclose(loss, ref, rtol=2e-5)
  # d/dt' = t * dL/dt (chain rule through exp).
  np.testing.assert_allclose(g[0]["log_scale"], t * dscale, rtol=1e-4,
                             atol=1e-6)
  # Embedding grads pass through the head's normalization.
  want = _through_normalization(x, dx)
  gx = np.asarray(g[1], np.float64)
  np.testing.assert_allclose(gx, want, rtol=1e-4,
                             atol=1e-5 * np.abs(want).max())


def test_sigmoid_defaults_are_siglip_init_and_match_float64():
  x, y = _emb(1, n=17)
  head = ContrastiveLoss(loss="sigmoid", backend="xla", block_sizes=BS)
  v = head.init(jax.random.key(0), x, y)
  np.testing.assert_allclose(v["params"]["log_scale"], math.log(10.0),
                             rtol=1e-6)
  np.testing.assert_allclose(v["params"]["bias"], -10.0)
  p = {"log_scale": jnp.float32(2.0), "bias": jnp.float32(-3.0)}
  loss, g = jax.value_and_grad(
      lambda p: head.apply({"params": p}, x, y))(p)
  t = math.exp(2.0)
  ref, _, _, d_scale, d_bias = np_reference.sigmoid_loss_and_grads(
      _norm64(x), _norm64(y), t, -3.0)
  np.testing.assert_allclose(loss, ref, rtol=2e-5)
  # d/dt' = t * dL/dt (chain rule through exp).
  np.testing.assert_allclose(g["log_scale"], t * d_scale, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(g["bias"], d_bias, rtol=1e-4, atol=1e-6)


def test_clamp_caps_the_scale_and_stops_its_gradient():
  x, y = _emb(2)
  head = ContrastiveLoss(backend="xla", block_sizes=BS)
  p = {"log_scale": jnp.float32(7.0)}  # Above log(100).
  scale, bias = head.apply({"params": p},
                           method=ContrastiveLoss.scale_and_bias)
  np.testing.assert_allclose(scale, 100.0, rtol=1e-6)
  assert float(bias) == 0.0
  g = jax.grad(lambda p: head.apply({"params": p}, x, y))(p)
  assert float(g["log_scale"]) == 0.0
  ref = np_reference.clip_loss_and_grads(_norm64(x), _norm64(y), 100.0)[0]
  np.testing.assert_allclose(head.apply({"params": p}, x, y), ref, rtol=2e-5)


def test_softmax_with_bias_and_backend_pass_through():
  x, y = _emb(3, n=13)
  kw = dict(use_bias=True, init_bias=0.5, direction="image_to_text")
  tiled = ContrastiveLoss(backend="xla", block_sizes=BS, **kw)
  ref = ContrastiveLoss(backend="reference", **kw)
  v = tiled.init(jax.random.key(0), x, y)
  assert float(v["params"]["bias"]) == 0.5
  np.testing.assert_allclose(tiled.apply(v, x, y), ref.apply(v, x, y),
                             rtol=2e-5)
  want = np_reference.clip_loss_and_grads(
      _norm64(x), _norm64(y), 1 / 0.07, 0.5, direction="image_to_text")[0]
  np.testing.assert_allclose(tiled.apply(v, x, y), want, rtol=2e-5)


@pytest.mark.parametrize("loss,strategy", [
    ("softmax", "ring"), ("softmax", "gather"), ("softmax", "auto"),
    ("sigmoid", "auto")])
def test_axis_name_inside_shard_map_gives_the_global_loss(loss, strategy):
  n_dev = 4
  if jax.device_count() < n_dev:
    pytest.skip("needs 4 devices (tests/conftest.py sets 8 host devices)")
  mesh = Mesh(np.array(jax.devices()[:n_dev]), ("d",))
  x, y = _emb(4, n=8 * n_dev)
  single = ContrastiveLoss(loss=loss, backend="xla", block_sizes=BS)
  v = single.init(jax.random.key(0), x, y)
  ringed = single.clone(axis_name="d", strategy=strategy)
  f = jax.shard_map(lambda v, x, y: ringed.apply(v, x, y), mesh=mesh,
                    in_specs=(P(), P("d"), P("d")), out_specs=P())
  got, g_ring = jax.jit(jax.value_and_grad(f))(v, x, y)
  want, g_single = jax.value_and_grad(single.apply)(v, x, y)
  np.testing.assert_allclose(got, want, rtol=2e-5)
  # check_vma=True (the default): the replicated parameters' gradients are
  # summed over the devices, i.e. equal the single-device gradients.
  for k in g_single["params"]:
    np.testing.assert_allclose(g_ring["params"][k], g_single["params"][k],
                               rtol=1e-4, atol=1e-7)


def test_bad_loss_name_is_a_clear_error():
  x, y = _emb(5)
  with pytest.raises(ValueError, match="loss must be one of"):
    ContrastiveLoss(loss="cosine").init(jax.random.key(0), x, y)
  with pytest.raises(ValueError, match="strategy applies to the softmax"):
    ContrastiveLoss(loss="sigmoid", strategy="gather").init(
        jax.random.key(0), x, y)
  with pytest.raises(ValueError, match="strategy must be one of"):
    ContrastiveLoss(strategy="tree").apply({"params": {"log_scale": 1.0}},
                                           x, y)


def test_import_infcl_jax_does_not_import_flax():
  code = ("import sys, infcl_jax; "
          "assert 'infcl_jax.flax' not in sys.modules; "
          "assert 'flax' not in sys.modules, 'flax imported'")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_labels_pass_through_to_the_softmax_loss():
  x, y = _emb(6, n=9)
  head = ContrastiveLoss(direction="image_to_text", backend="xla",
                         block_sizes=BS)
  v = head.init(jax.random.key(0), x, y)
  lab = np.array([8, 0, 0, 3, 4, 5, 6, 7, 1])
  got = head.apply(v, x, y, jnp.asarray(lab))
  want = np_reference.clip_loss_and_grads(
      _norm64(x), _norm64(y), 1 / 0.07, 0.0, "image_to_text", lab)[0]
  np.testing.assert_allclose(got, want, rtol=2e-5)
  with pytest.raises(ValueError, match="labels= applies to the softmax"):
    ContrastiveLoss(loss="sigmoid").init(jax.random.key(0), x, y,
                                         jnp.asarray(lab))


def test_import_without_flax_names_the_extra(monkeypatch):
  import importlib  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  for mod in ("flax", "flax.linen", "infcl_jax.flax"):
    monkeypatch.setitem(sys.modules, mod, None)
  monkeypatch.delitem(sys.modules, "infcl_jax.flax")
  with pytest.raises(ImportError) as e:
    importlib.import_module("infcl_jax.flax")
  msg = str(e.value)
  assert 'pip install "infcl-jax[flax]"' in msg and "\n" not in msg, msg
