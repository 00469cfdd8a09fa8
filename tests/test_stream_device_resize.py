"""Resize on the device (config.data.decode_size): the host delivers uint8
C x C, ``Tower.embed`` resizes C -> image_size per micro-batch.

- The device resize (train/towers/resize.py) is the host's Pillow bicubic
  (``host.resize_crop``) to within the levels pinned here, on random and
  on smooth images; at C = image_size ``Tower.embed`` is unchanged, bitwise.
- The iterator delivers C x C (an image already C x C untouched), and
  decode_size is part of its fingerprint: a saved stream of another
  decode_size is refused, the same one resumes bitwise.
- The streamed step equals the whole-batch step with C > S images.
- Precompute with decode_size, then training from the embeddings, gives
  the on-the-fly loss at step 1; bad values are one-line config errors.
"""
import io

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from PIL import Image
from types import SimpleNamespace as NS

from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from tests import corpus as corpus_lib
from tests import test_stream as ts
from train import data as D
from train import precompute as precompute_lib
from train import train as train_lib
from train.data.sources import embeddings as emb_lib
from train.data import pipeline
from train.data.decode import host as host_lib
from train.towers import own
from train.towers import resize as resize_lib
from train.towers import text as text_lib
from train.towers import tower as tower_lib

corpus = ts.corpus            # The same module-scoped fixtures.
shapes_dir = ts.shapes_dir


def _smooth(n, c):
  """Smooth colour gradients and low-frequency waves (photo-like)."""
  yy, xx = np.mgrid[0:c, 0:c] / c
  waves = [(1, 2), (2, 1), (3, 1), (0.5, 0.5)]
  return np.stack([np.stack([127.5 + 127.5 * np.sin(
      2 * np.pi * (f * xx + g * yy) + p) for p in (0, 1, 2)], -1)
                   for f, g in waves[:n]]).round().astype(np.uint8)


# Measured (jax 0.11.2, CPU): Pillow's own result in all but a few pixels.
# random: max 1 level, mean <= 0.005; smooth: max 2, mean <= 0.12. Without
# the per-pass clip and rounding, random images differ by up to 23 levels.
@pytest.mark.parametrize("c,s", [(256, 224), (64, 32), (48, 32), (40, 32),
                                 (256, 128)])
@pytest.mark.parametrize("kind,max_diff,mean_diff",
                         [("random", 1, 0.01), ("smooth", 2, 0.15)])
def test_device_resize_is_the_hosts_pillow_bicubic(c, s, kind, max_diff,
                                                   mean_diff):
  if kind == "random":
    images = np.random.default_rng(c + s).integers(0, 256, (4, c, c, 3),
                                                   dtype=np.uint8)
  else:
    images = _smooth(4, c)
  device = np.asarray(jax.jit(resize_lib.resize_square,
                              static_argnums=1)(images, s))
  host = np.stack([host_lib.resize_crop(im, s) for im in images])
  assert device.shape == host.shape == (4, s, s, 3)
  assert device.dtype == np.float32
  np.testing.assert_array_equal(device, np.round(device))  # whole levels
  diff = np.abs(device - host.astype(np.float32))
  assert diff.max() <= max_diff, diff.max()
  assert diff.mean() <= mean_diff, diff.mean()


def _tower(s=16, d=16):
  img = own.make_module(NS(kind="cnn", cnn_features=(4, 8)), d, jnp.float32)
  params = img.init(jax.random.key(0), jnp.zeros((1, s, s, 3)))["params"]
  return tower_lib.Tower(module=img, params=params, image_size=s,
                         normalization=tower_lib.SYMMETRIC, embed_dim=d)


def test_embed_is_unchanged_at_the_towers_size_and_resizes_above_it():
  tower = _tower()
  rng = np.random.default_rng(0)
  at_s = rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
  want = jax.jit(lambda p, x: tower.module.apply(
      {"params": p}, tower_lib.SYMMETRIC(x)))(tower.params, at_s)
  np.testing.assert_array_equal(np.asarray(tower(at_s)), np.asarray(want))
  np.testing.assert_array_equal(
      np.asarray(resize_lib.resize_square(at_s, 16)), at_s.astype(np.float32))
  # C > S: embedding the device-resized image is embedding that image (it is
  # whole levels: the same uint8 at S gives bitwise the same embedding).
  big = rng.integers(0, 256, (4, 24, 24, 3), dtype=np.uint8)
  small = np.asarray(resize_lib.resize_square(big, 16)).astype(np.uint8)
  np.testing.assert_array_equal(np.asarray(tower(big)),
                                np.asarray(tower(small)))
  assert tower.preprocess(big).shape == (4, 16, 16, 3)


def test_device_resize_refuses_smaller_or_non_square_images():
  tower = _tower()
  with pytest.raises(ValueError, match="smaller than the tower's image_size"):
    tower(np.zeros((2, 8, 8, 3), np.uint8))
  with pytest.raises(ValueError, match="square"):
    tower(np.zeros((2, 24, 32, 3), np.uint8))


@pytest.mark.parametrize("n_dev", [1, 8])
def test_streamed_step_equals_the_whole_batch_step_with_decode_size(n_dev):
  b, mb, length, s, c, d = 32, 8, 8, 16, 24, 16
  tower = _tower(s, d)
  txt = text_lib.from_scratch(NS(width=16, depth=1, num_heads=2, mlp_dim=32),
                              50, length, d, jnp.float32)
  head = ContrastiveLoss(loss="softmax", backend="xla",
                         block_sizes=BlockSizes(8, 16))
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (b, c, c, 3), dtype=np.uint8)
  tokens = rng.integers(1, 50, (b, length)).astype(np.int32)
  e = jnp.zeros((2, d))
  params = {"img": tower.params,
            "txt": txt.init(jax.random.key(1), tokens[:1])["params"],
            "head": head.init(jax.random.key(2), e, e)["params"]}
  batch, inputs = ts.streamed_and_whole(tower, txt, head, params, images,
                                        tokens, n_dev, mb)
  # And both are the tower's embeddings of the host-resized images, to the
  # resize's few levels.
  host = np.stack([host_lib.resize_crop(im, s) for im in batch["image"]])
  np.testing.assert_allclose(np.asarray(inputs["image_emb"]),
                             np.asarray(tower(host)), rtol=0.05, atol=0.05)


def _config(name, **data):
  config = ml_collections.ConfigDict()
  config.data = D.default_data_config()
  config.tokenizer = D.default_tokenizer_config()
  config.data.name = name
  config.data.eval_split = ""
  config.data.image_size = 8
  config.data.max_bad_fraction = 0.5
  for k, v in data.items():
    config.data[k] = v
  return config


def test_iterator_delivers_decode_size_and_fingerprints_it(corpus):
  train, _ = corpus
  name = "webdataset:" + train.pattern
  s0 = corpus_lib.IMAGE_SIZE  # The corpus's JPEGs are 16 x 16.
  for c in (s0, 24):
    it = pipeline.make_train_iterator(_config(name, decode_size=c,
                                              cache_max_mb=0),
                                      batch_size=8, seed=0)
    mb = next(it)
    assert mb["image"].shape == (8, c, c, 3) and mb["image"].dtype == np.uint8
    assert it.get_state()["decode_size"] == c
    it.close()
  # At decode_size 16 the host only decodes: the pixels are the JPEG's.
  good = {np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB")).tobytes()
          for jpg, _, _ in train.good.values()}
  it = pipeline.make_train_iterator(_config(name, decode_size=s0),
                                    batch_size=8, seed=0)
  assert all(im.tobytes() in good for im in next(it)["image"])
  # Resumes bitwise; another decode_size (or none) refuses the state.
  for _ in range(2):
    next(it)
  state = it.get_state()
  rest = [next(it) for _ in range(3)]
  again = pipeline.make_train_iterator(_config(name, decode_size=s0),
                                       batch_size=8, seed=0)
  again.set_state(state)
  for x, y in zip(rest, [next(again) for _ in range(3)]):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  for other in (0, 24):
    it2 = pipeline.make_train_iterator(_config(name, decode_size=other),
                                       batch_size=8, seed=0)
    with pytest.raises(ValueError, match=f"decode_size: saved {s0} != now "
                       f"{other}"):
      it2.set_state(state)


@pytest.mark.parametrize("decode_size,match", [
    (-1, r"decode_size=-1 must be an int >= 0"),
    (4, r"decode_size=4 is smaller than image_size=8"),
])
def test_bad_decode_size_is_a_one_line_error(corpus, decode_size, match):
  train, _ = corpus
  config = _config("webdataset:" + train.pattern, decode_size=decode_size)
  with pytest.raises(ValueError, match=match) as e:
    D.check_data_config(config)
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_precompute_and_train_with_decode_size(tmp_path, corpus, shapes_dir):
  train, held_out = corpus
  name, ev = "webdataset:" + train.pattern, "webdataset:" + held_out.pattern
  # The corpus's 16 px JPEGs: the host resizes them to 24, the device to 16.
  fly = ts._tiny(name, ev, shapes_dir, precompute_image_embeddings=False,  # pylint: disable=protected-access
                 microbatch_size=8, total_steps=2, **{"data.decode_size": 24})
  summary = train_lib.train_and_evaluate(fly, str(tmp_path / "fly"))
  assert np.isfinite(summary["loss"])
  tokenizer = train_lib.data_lib.make_tokenizer(fly)
  tower = train_lib.make_locked_tower(fly, tokenizer)
  out = tmp_path / "emb"
  precompute_lib.precompute(fly, str(out), tower, rows_per_shard=40)
  source = emb_lib.EmbeddingSource(str(out))
  ex = train_lib.data_lib.open_source(fly.data, "train")[11]
  pix = host_lib.resize_crop(host_lib.decode_host(ex["image"], "", 24), 24)
  np.testing.assert_allclose(source[11]["image_emb"],
                             np.asarray(tower(pix[None]))[0], rtol=8e-3,
                             atol=1e-3)
  # Training from them: the on-the-fly loss at step 1, to bf16 rounding.
  pre = ts._tiny("embeddings:" + str(out), ev, shapes_dir, total_steps=2,  # pylint: disable=protected-access
                 microbatch_size=8)
  train_lib.train_and_evaluate(pre, str(tmp_path / "pre"))
  l_fly = [r["loss"] for r in ts._rows(tmp_path / "fly") if "loss" in r]  # pylint: disable=protected-access
  l_pre = [r["loss"] for r in ts._rows(tmp_path / "pre") if "loss" in r]  # pylint: disable=protected-access
  np.testing.assert_allclose(l_pre[0], l_fly[0], rtol=2e-3)
  # The same directory does not take embeddings resized on the host.
  with pytest.raises(ValueError, match="decode_size: 24 there, 0 now"):
    precompute_lib.precompute(ts._tiny(name, ev, shapes_dir), str(out),  # pylint: disable=protected-access
                              tower, rows_per_shard=40)
