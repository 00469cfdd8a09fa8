"""infcl_jax.nnx.ContrastiveLoss: the linen head's twin in Flax NNX.

Against the linen head (the same parameter values give the same loss and
gradients), against float64, its defaults, limits and errors; a two-tower
train step with ``nnx.jit`` and optax; and a step inside ``jax.shard_map``
on 8 host devices equal to the one-device step on the whole batch.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss as LinenLoss
from infcl_jax.nnx import ContrastiveLoss
from tests import np_reference
from tests.helpers import assert_rel_close, seed_of
from tests.test_flax_module import _norm64, _through_normalization

BS = BlockSizes(block_q=8, block_k=16)


def _emb(seed, n=21, d=12, m=None):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, d)).astype(np.float32),
          rng.normal(size=(m or n, d)).astype(np.float32))


def _params(head):
  """{name: value} of the head's (or a gradient state's) parameters."""
  return {path[-1]: v[...] for path, v in nnx.to_flat_state(
      nnx.state(head, nnx.Param))}


def _set(head, **values):
  for name, v in values.items():
    getattr(head, name)[...] = jnp.float32(v)


CASES = {
    "softmax": dict(kw={}, values={"log_scale": 1.7}),
    "sigmoid": dict(kw={"loss": "sigmoid"},
                    values={"log_scale": 2.0, "bias": -3.0}),
    "softmax_bias_groups_positives": dict(
        kw={"use_bias": True, "group_mode": "positives"},
        values={"log_scale": 2.2, "bias": 0.4},
        groups=lambda n, m: np.arange(n) // 3),
    "sigmoid_groups": dict(kw={"loss": "sigmoid"},
                           values={"log_scale": 1.1, "bias": -1.5},
                           groups=lambda n, m: np.arange(n) % 4),
    "softmax_labels": dict(kw={"direction": "image_to_text"},
                           values={"log_scale": 2.5}, m=29,
                           labels=lambda n, m: (np.arange(n) * 5) % m),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_params_same_loss_and_grads_as_linen(case):
  c = CASES[case]
  n, m = 21, c.get("m", 21)
  x, y = _emb(seed_of("nnx vs linen", case), n=n, m=m)
  extra = {k: c[k](n, m) for k in ("groups", "labels") if k in c}
  head = ContrastiveLoss(backend="xla", block_sizes=BS, **c["kw"])
  _set(head, **c["values"])
  linen = LinenLoss(backend="xla", block_sizes=BS, **c["kw"])
  variables = linen.init(jax.random.key(0), x, y, **extra)
  assert set(variables["params"]) == set(_params(head))
  params = {k: jnp.float32(v) for k, v in c["values"].items()}

  loss, (g_head, gx, gy) = nnx.value_and_grad(
      lambda h, a, b: h(a, b, **extra), argnums=(0, 1, 2))(head, x, y)
  want, (g_params, wx, wy) = jax.value_and_grad(
      lambda p, a, b: linen.apply({"params": p}, a, b, **extra),
      argnums=(0, 1, 2))(params, x, y)
  assert float(loss) == pytest.approx(float(want), rel=1e-6)
  assert set(_params(g_head)) == set(params)
  for name, g in _params(g_head).items():
    assert float(g) == pytest.approx(float(g_params[name]), rel=1e-5,
                                     abs=1e-7), name
  assert_rel_close(gx, np.asarray(wx), 1e-6, what="dx")
  assert_rel_close(gy, np.asarray(wy), 1e-6, what="dy")


def test_softmax_and_sigmoid_match_float64():
  for loss_name, values in (("softmax", {"log_scale": 1.7}),
                            ("sigmoid", {"log_scale": 2.0, "bias": -3.0})):
    x, y = _emb(seed_of("nnx float64", loss_name), n=19)
    head = ContrastiveLoss(loss_name, backend="xla", block_sizes=BS)
    _set(head, **values)
    loss, (g_head, gx) = nnx.value_and_grad(
        lambda h, a: h(a, y), argnums=(0, 1))(head, x)
    t = math.exp(values["log_scale"])
    if loss_name == "softmax":
      ref, dx, _, dscale, _ = np_reference.clip_loss_and_grads(
          _norm64(x), _norm64(y), t)
    else:
      ref, dx, _, dscale, dbias = np_reference.sigmoid_loss_and_grads(
          _norm64(x), _norm64(y), t, values["bias"])
      np.testing.assert_allclose(g_head.bias[...], dbias, rtol=1e-4,
                                 atol=1e-6)
    np.testing.assert_allclose(loss, ref, rtol=2e-5)
    # d/dt' = t * dL/dt (chain rule through exp).
    np.testing.assert_allclose(g_head.log_scale[...], t * dscale, rtol=1e-4,
                               atol=1e-6)
    assert_rel_close(gx, _through_normalization(x, dx), 1e-4,
                     what=f"{loss_name} dx")


def test_defaults_clamp_and_errors():
  clip = ContrastiveLoss()
  assert set(_params(clip)) == {"log_scale"} and clip.bias is None
  np.testing.assert_allclose(clip.log_scale[...], math.log(1 / 0.07),
                             rtol=1e-6)
  siglip = ContrastiveLoss("sigmoid")
  np.testing.assert_allclose(siglip.log_scale[...], math.log(10.0), rtol=1e-6)
  np.testing.assert_allclose(siglip.bias[...], -10.0)
  assert ContrastiveLoss("sigmoid", use_bias=False).bias is None
  # Past max_log_scale the scale is capped at 100 and t' gets no gradient.
  x, y = _emb(3)
  head = ContrastiveLoss(backend="xla", init_log_scale=7.0)
  scale, bias = head.scale_and_bias()
  assert float(scale) == pytest.approx(100.0, rel=1e-6) and float(bias) == 0
  assert float(nnx.grad(lambda h: h(x, y))(head).log_scale[...]) == 0.0
  with pytest.raises(ValueError, match="loss must be one of"):
    ContrastiveLoss("infonce")
  with pytest.raises(ValueError, match="direction applies to the softmax"):
    ContrastiveLoss("sigmoid", direction="image_to_text")
  with pytest.raises(ValueError, match="min_log_scale 3.0 > max_log_scale"):
    ContrastiveLoss(min_log_scale=3.0, max_log_scale=1.0)
  with pytest.raises(ValueError, match="labels= applies to the softmax"):
    ContrastiveLoss("sigmoid")(x, y, labels=np.arange(21))


class TwoTowers(nnx.Module):
  def __init__(self, rngs, **head_kw):
    self.img = nnx.Linear(32, 16, rngs=rngs)
    self.txt = nnx.Linear(48, 16, rngs=rngs)
    self.head = ContrastiveLoss(backend="xla", **head_kw)

  def __call__(self, images, texts):
    return self.head(self.img(images), self.txt(texts))


def _data(n, seed):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  images = jax.random.normal(k1, (n, 32))
  texts = (images @ jax.random.normal(k2, (32, 48))
           + 0.5 * jax.random.normal(k3, (n, 48)))
  return images, texts


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_two_tower_train_step_with_nnx_jit_and_optax(loss):
  images, texts = _data(64, 0)
  model = TwoTowers(nnx.Rngs(0), loss=loss)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

  @nnx.jit
  def step(model, optimizer, images, texts):
    loss, grads = nnx.value_and_grad(lambda m: m(images, texts))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, images, texts)) for _ in range(15)]
  assert losses[-1] < 0.7 * losses[0], losses
  after = nnx.state(model, nnx.Param)
  for path, v in nnx.to_flat_state(before):
    new = dict(nnx.to_flat_state(after))[path][...]
    assert not np.allclose(np.asarray(new), v[...]), path  # Every param moved.


@pytest.mark.parametrize("loss,strategy", [("softmax", "ring"),
                                           ("softmax", "gather"),
                                           ("sigmoid", "auto")])
def test_step_inside_shard_map_equals_the_one_device_step(loss, strategy):
  """8 host devices, 8 rows each: the towers and the head run on each
  device's shard, the loss is global and the replicated parameters'
  gradients come out summed (check_vma=True), so the SGD step equals the
  one-device step on the whole batch."""
  n_dev = 8
  mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
  images, texts = _data(8 * n_dev, 1)
  model = TwoTowers(nnx.Rngs(1), loss=loss, axis_name="data",
                    strategy=strategy)
  one = TwoTowers(nnx.Rngs(1), loss=loss)
  graphdef, state = nnx.split(model)

  def local(state, images, texts):
    m = nnx.merge(graphdef, state)
    value, grads = nnx.value_and_grad(lambda m: m(images, texts))(m)
    params = nnx.state(m, nnx.Param)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  value, new = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
      out_specs=(P(), P())))(state, images, texts)

  want, grads = nnx.value_and_grad(lambda m: m(images, texts))(one)
  assert float(value) == pytest.approx(float(want), rel=1e-5)
  want_new = jax.tree.map(lambda p, g: p - 0.1 * g,
                          nnx.state(one, nnx.Param), grads)
  for (path, a), (_, b) in zip(nnx.to_flat_state(new),
                               nnx.to_flat_state(want_new)):
    assert_rel_close(a[...], np.asarray(b[...]), 1e-5, atol=1e-7,
                     what=str(path))
