"""The towers' speed options are exact: a locked tower's params stored in
the compute dtype (``Tower.with_params_in_dtype``, config
``model.image.params_in_dtype``), and the shifted one-pass LayerNorm
(``layers.LayerNorm``) against float64 where flax's unshifted one cancels."""
import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.towers import layers
from train.towers import own
from train.towers import vit as vit_lib
from train.towers.tower import SYMMETRIC, Tower  # pylint: disable=g-multiple-import

VITS = {
    "clip": dict(class_token=True, pos_embed_cls=True, pre_norm=True,
                 pool="tok", final_norm="pooled", embed_dim=16,
                 head_bias=False, patch_bias=False, act="quick_gelu"),
    "siglip": dict(pool="map", final_norm="tokens", act="gelu_tanh"),
    "timm": dict(class_token=True, pos_embed_cls=True, pool="tok",
                 layer_scale=True, act="gelu"),
}


def _tower(module, s=32):
  params = module.init(jax.random.key(0), jnp.zeros((1, s, s, 3)))["params"]
  # Non-trivial LayerNorm params and layer scales: a bf16 rounding of them
  # would show.
  params = jax.tree.map(
      lambda p: p + 0.01 * jax.random.normal(jax.random.key(p.size), p.shape),
      params)
  return Tower(module, params, s, SYMMETRIC, 0, jnp.bfloat16)


def _images(n=3, s=32):
  return jnp.asarray(np.random.default_rng(1).integers(
      0, 256, (n, s, s, 3), dtype=np.uint8))


@pytest.mark.parametrize("family", sorted(VITS))
def test_params_in_dtype_give_bitwise_the_same_embeddings(family):
  m = vit_lib.ViT(patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64,
                  dtype=jnp.bfloat16, **VITS[family])
  tower = _tower(m)
  stored = tower.with_params_in_dtype()
  flat = flax.traverse_util.flatten_dict(stored.params, sep="/")
  kinds = {n: str(p.dtype) for n, p in flat.items()}
  assert kinds["encoder/block0/mlp/fc1/kernel"] == "bfloat16"
  assert kinds["encoder/block1/attn/qkv/bias"] == "bfloat16"
  assert kinds["embedding/kernel"] == "bfloat16"
  # LayerNorm params are used in float32, before the output is rounded.
  assert kinds["encoder/block0/norm1/scale"] == "float32"
  if family == "timm":
    assert kinds["encoder/block0/ls1"] == "float32"  # multiplied as is
  x = _images()
  a, b = np.asarray(tower(x)), np.asarray(stored(x))
  assert np.abs(a).max() > 0
  np.testing.assert_array_equal(a, b)
  assert tower.fingerprint != stored.fingerprint


def test_params_in_dtype_of_the_cnn_and_of_a_float32_tower():
  tower = _tower(own.SmallCNN((8, 16), 12, dtype=jnp.bfloat16))
  stored = tower.with_params_in_dtype()
  assert stored.params["conv0a"]["kernel"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(tower(_images())),
                                np.asarray(stored(_images())))
  f32 = Tower(tower.module.clone(dtype=jnp.float32), tower.params, 32,
              SYMMETRIC, 12, jnp.float32)
  assert f32.with_params_in_dtype() is f32


def test_config_params_in_dtype_builds_a_stored_locked_tower():
  from train import config_base  # pylint: disable=g-import-not-at-top
  from train.towers import build  # pylint: disable=g-import-not-at-top
  c = config_base.base_config()
  c.model.image.kind = "vit"
  c.model.image.params_in_dtype = True
  c.data.image_size = 16
  config_base.check_config(c)
  t = build.make_image_tower(c, jnp.bfloat16)
  assert t.params["encoder"]["block0"]["mlp"]["fc1"]["kernel"].dtype == \
      jnp.bfloat16
  c.model.image.params_in_dtype = False
  ref = build.make_image_tower(c, jnp.bfloat16)
  assert ref.params["encoder"]["block0"]["mlp"]["fc1"]["kernel"].dtype == \
      jnp.float32
  x = _images(2, 16)
  np.testing.assert_array_equal(np.asarray(ref(x)), np.asarray(t(x)))
  c.model.image.params_in_dtype = True
  c.model.image.locked = False
  with pytest.raises(ValueError, match="params_in_dtype needs"):
    config_base.check_config(c)


def _ln64(x, scale, bias, eps):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * scale + bias


@pytest.mark.parametrize("mean", [0.0, 30.0, 3e3, -3e4])
def test_layer_norm_equals_float64_at_large_means(mean):
  rng = np.random.default_rng(0)
  x = (mean + rng.standard_normal((64, 768)) * 0.7).astype(np.float32)
  x[5, 0] += 500.0   # a row whose shift (its first element) is an outlier
  x[6, 3] += 500.0   # a row with an outlier elsewhere
  ln = layers.LayerNorm(1e-6)
  p = ln.init(jax.random.key(0), x)["params"]
  p = {"scale": 1.0 + 0.1 * rng.standard_normal(768).astype(np.float32),
       "bias": 0.1 * rng.standard_normal(768).astype(np.float32)}
  got = np.asarray(ln.apply({"params": p}, jnp.asarray(x)), np.float64)
  ref = _ln64(x, p["scale"], p["bias"], 1e-6)
  # The error is float32 ulps times (x0 - mean)^2 / var, the cancellation
  # the shift leaves, whatever |mean|: a few ulps for ordinary rows, ~5e-5
  # relative in row 5, whose shift is a 30 std outlier (1e-4 allowed).
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
  assert np.abs(got - ref)[7:].max() < 2e-6
  # flax's unshifted one-pass variance, the same params, at the same means:
  # beyond 1e3 std it has no digits left (it is shown failing, so the
  # float64 check above can fail).
  flax_ln = nn.LayerNorm(1e-6)
  bad = np.abs(np.asarray(flax_ln.apply({"params": p}, jnp.asarray(x)),
                          np.float64) - ref).max()
  assert (bad > 1e-2) == (abs(mean) >= 3e3), bad


def test_layer_norm_in_bf16_is_the_float32_one_rounded():
  x = jnp.asarray(np.random.default_rng(2).standard_normal((8, 64)) + 5,
                  jnp.bfloat16)
  ln = layers.LayerNorm(1e-5, dtype=jnp.bfloat16)
  p = ln.init(jax.random.key(0), x)
  y = ln.apply(p, x)
  assert y.dtype == jnp.bfloat16
  ref = _ln64(np.asarray(x.astype(jnp.float32)), 1.0, 0.0, 1e-5)
  np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2**-8,
                             atol=2**-8)
