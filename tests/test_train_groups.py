"""The trainer's group ids (config.loss.groups, issue 26): from the data to
the loss.

- config.captions_per_image = k puts each image at k consecutive stream
  positions with distinct captions; with groups "image" they share one id,
  other images have other ids, and without groups the batch is unchanged.
- A table of one row per caption gives the rows of one image file one image
  id; precompute records a hash of the pixels, and "content" gives duplicate
  files (other paths, same pixels) one id, distinct images distinct ids.
- The step hands the ids to the loss: its loss and head gradient equal the
  float64 reference of tests/group_reference.py (one device, GradCache, and
  the ring over 8 devices); without groups the loss is the plain one.
- Bad values are one-line errors; a grouped run resumed from a checkpoint
  ends bitwise where the uninterrupted run does.
"""
import csv
import importlib.util
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from types import SimpleNamespace as NS

from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from tests import group_reference
from tests.helpers import set_overrides
from train import config_base
from train import data as data_lib
from train import precompute as precompute_lib
from train import step as step_lib
from train import train as train_lib
from train.data.sources import embeddings as emb_lib
from train.data import pipeline
from train.data.sources import table
from train.towers import text as text_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny(data_dir, **overrides):
  spec = importlib.util.spec_from_file_location(
      "lit_demo_config", os.path.join(ROOT, "configs", "lit_demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("tiny")
  c.progress_bar = False
  c.data.data_dir = str(data_dir)
  c.data.num_train_examples = 64
  c.data.num_eval_examples = 16
  return set_overrides(c, overrides)


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


# ----------------------------------------------------------------- config


@pytest.mark.parametrize("overrides,message", [
    ({"loss.groups": "images"},
     "config.loss.groups must be one of none, image, content; got 'images'"),
    ({"loss.groups": "image", "loss.group_mode": "multi"},
     "config.loss.group_mode must be one of mask, positives; got 'multi'"),
    ({"loss.group_mode": "positives"},
     "config.loss.group_mode='positives' needs config.loss.groups"),
    ({"loss.groups": "content", "precompute_image_embeddings": False},
     "config.loss.groups='content' needs precomputed embeddings"),
    ({"captions_per_image": 0},
     "config.captions_per_image=0 must be an int >= 1"),
])
def test_bad_group_config_is_one_line(shapes_dir, overrides, message):
  config = _tiny(shapes_dir, **overrides)
  with pytest.raises(ValueError) as e:
    config_base.check_config(config)
    data_lib.check_data_config(config)
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_group_config_of_the_demo_passes(shapes_dir):
  config = _tiny(shapes_dir, **{"loss.groups": "content",
                                "loss.group_mode": "positives",
                                "captions_per_image": 3})
  config_base.check_config(config)
  data_lib.check_data_config(config)


# ----------------------------------------------------------------- data


def _batches(config, n, groups, batch_size=12, source=None):
  it = data_lib.make_train_iterator(
      config, batch_size=batch_size, seed=3, source=source, groups=groups,
      captions_per_image=config.captions_per_image)
  return [next(it) for _ in range(n)]


def test_captions_per_image_share_an_image_id(shapes_dir):
  k = 3
  config = _tiny(shapes_dir, **{"captions_per_image": k})
  source = data_lib.open_source(config.data, "train")
  for batch in _batches(config, 4, "image", source=source):
    g = batch["group"]
    assert g.dtype == np.int32 and g.shape == (12,)
    # Each image at k consecutive positions: one id, one image, k captions.
    for t in range(0, 12, k):
      assert len(set(g[t:t + k])) == 1, g
      img = batch["image"][t:t + k]
      assert (img == img[:1]).all()
      assert len({bytes(x) for x in batch["text"][t:t + k]}) == k
      # The id is the image's index in the source (TFDS: one image each).
      np.testing.assert_array_equal(source[int(g[t])]["image"], img[0])
    assert len(set(g)) == 12 // k, g  # Other images: other ids.
  # Without groups: the same stream, no ids.
  plain = _batches(config, 4, "none", source=source)
  for a, b in zip(plain, _batches(config, 4, "image", source=source)):
    assert "group" not in a
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_one_caption_per_image_gives_distinct_ids(shapes_dir):
  config = _tiny(shapes_dir)
  for batch in _batches(config, 3, "image"):
    assert len(set(batch["group"])) == 12


def _png(path, pixels):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  Image.fromarray(pixels).save(path)


@pytest.fixture(scope="module")
def dup_table(tmp_path_factory):
  """A CSV of one row per caption: a.png twice (two captions), b.png, and
  c.png, a copy of a.png's pixels under another name."""
  root = tmp_path_factory.mktemp("dups")
  rng = np.random.default_rng(0)
  a, b = (rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in "ab")
  _png(root / "a.png", a)
  _png(root / "b.png", b)
  _png(root / "c.png", a)
  rows = [("a.png", "a red thing", 0), ("a.png", "something red", 1),
          ("b.png", "a blue thing", 2), ("c.png", "a copy of red", 3)]
  path = root / "pairs.csv"
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["image", "caption", "label"])
    w.writerows(rows)
  return str(path)


def _by_label(batch):
  return {int(l): int(g) for l, g in zip(batch["label"], batch["group"])}


def test_image_ids_of_a_table_and_content_ids_of_precomputed(
    tmp_path, shapes_dir, dup_table):
  source = table.TableSource("csv:" + dup_table, image_column="image",
                             caption_column="caption", label_column="label")
  assert [source[i]["image_id"] for i in range(4)] == [0, 0, 2, 3]
  config = _tiny(shapes_dir, **{
      "data.name": "csv:" + dup_table, "data.image_size": 16,
      "data.table_label_column": "label", "data.eval_split": "",
      "precompute_image_embeddings": False})
  tower = train_lib.make_locked_tower(config,
                                      data_lib.make_tokenizer(config))
  out = precompute_lib.precompute(config, str(tmp_path / "emb"), tower,
                                  log=lambda *_: None)
  emb = emb_lib.EmbeddingSource(out)
  assert emb.has_image_ids and emb.has_content_ids
  assert [emb[i]["image_id"] for i in range(4)] == [0, 0, 2, 3]
  assert [emb[i]["content_id"] for i in range(4)] == [0, 0, 2, 0]
  # Through the pipeline: a batch of all four rows, shuffled.
  (image,) = _batches(config, 1, "image", batch_size=4, source=emb)
  assert _by_label(image) == {0: 0, 1: 0, 2: 2, 3: 3}
  (content,) = _batches(config, 1, "content", batch_size=4, source=emb)
  assert _by_label(content) == {0: 0, 1: 0, 2: 2, 3: 0}
  # The raw table has no content hashes: "content" needs precompute.
  with pytest.raises(ValueError, match="needs precomputed embeddings with "
                     "content ids"):
    _batches(config, 1, "content", batch_size=4, source=source)


def test_content_hash_is_of_the_pixels():
  rng = np.random.default_rng(1)
  x = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
  y = x.copy()
  assert precompute_lib.content_hash(x) == precompute_lib.content_hash(y)
  y[3, 4, 1] ^= 1
  assert precompute_lib.content_hash(x) != precompute_lib.content_hash(y)
  assert precompute_lib.content_hash(x) != precompute_lib.content_hash(
      x.reshape(4, 16, 3))


# ----------------------------------------------------------------- the step

B, L, D = 32, 8, 16


def _step_parts(group_mode, copies_only=False):
  txt = text_lib.from_scratch(NS(width=16, depth=1, num_heads=2, mlp_dim=32),
                              50, L, D, jnp.float32)
  head = ContrastiveLoss(backend="xla", block_sizes=BlockSizes(8, 8),
                         group_mode=group_mode)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 50, (B, L)).astype(np.int32)
  emb = rng.normal(size=(B, D)).astype(np.float32)
  # Pairs 2i, 2i+1 of the first 16 rows are related: in rows 0-7 captions
  # of one image (the same image embedding), in rows 8-15 two views (other
  # embeddings, unless copies_only); one group of three copies; the rest
  # singletons.
  groups = np.arange(B, dtype=np.int32)
  groups[1:16:2] = groups[0:16:2]
  emb[1:16 if copies_only else 8:2] = emb[0:16 if copies_only else 8:2]
  groups[17:19] = 16
  emb[17:19] = emb[16]
  k1, k2 = jax.random.split(jax.random.key(0))
  e = jnp.zeros((2, D))
  params = {"img": {}, "txt": txt.init(k1, tokens[:1])["params"],
            "head": head.init(k2, e, e, groups=jnp.arange(2))["params"]}
  return txt, head, params, {"image_emb": emb, "text": tokens,
                             "group": groups}


def _reference(txt, params, batch, groups, mode):
  y = np.asarray(txt.apply({"params": params["txt"]}, batch["text"]),
                 np.float64)
  x = np.asarray(batch["image_emb"], np.float64)
  x /= np.linalg.norm(x, axis=1, keepdims=True)
  y /= np.linalg.norm(y, axis=1, keepdims=True)
  scale = float(np.exp(params["head"]["log_scale"]))
  loss, _, _, dscale, _ = group_reference.clip_loss_and_grads(
      x, y, scale, 0.0, groups, groups, mode=mode)
  return loss, dscale * scale  # d loss / d log_scale


# Each path once per mode where it matters: the plain step, GradCache, the
# ring on 8 devices.
@pytest.mark.parametrize("mode,n_dev,mb", [
    ("mask", 1, 0), ("positives", 1, 8), ("mask", 8, 16),
    ("positives", 8, 16)])
def test_the_step_hands_the_groups_to_the_loss(mode, n_dev, mb):
  txt, head, params, batch = _step_parts(mode)
  mesh = Mesh(np.array(jax.devices()[:n_dev]), (step_lib.AXIS,))
  kw = dict(mesh=mesh, image_tower=None, text_tower=txt, head=head,
            microbatch_size=mb, global_batch=B, precomputed=True,
            image_locked=True)
  grouped = jax.jit(step_lib.make_grad_fn(groups=True, **kw))
  # A run without groups builds the head without group_mode (make_head).
  kw["head"] = ContrastiveLoss(backend="xla", block_sizes=BlockSizes(8, 8))
  plain = jax.jit(step_lib.make_grad_fn(**kw))
  sharded = step_lib.shard_batch(mesh, batch)
  loss, grads = grouped(params, sharded)
  want, want_dlog = _reference(txt, params, batch, batch["group"], mode)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  np.testing.assert_allclose(float(grads["head"]["log_scale"]), want_dlog,
                             rtol=1e-4, atol=1e-6)
  # Without groups: today's loss (every other pair a negative), different
  # by far more than the tolerance (at init the few related pairs change
  # the loss by about 5e-3 against 1.4e-4).
  def no_groups(b):
    return plain(params, step_lib.shard_batch(
        mesh, {k: v for k, v in b.items() if k != "group"}))[0]
  loss0 = no_groups(batch)
  want0, _ = _reference(txt, params, batch, np.arange(B), "mask")
  np.testing.assert_allclose(float(loss0), want0, rtol=2e-5)
  assert abs(float(loss0) - float(loss)) > 20 * 2e-5 * want
  if mode == "positives":
    # When every group's images are one image (copies: the captions of one
    # image beside a locked tower), a query's positives have one logit, so
    # the multi-positive loss is the plain one, to rounding.
    _, _, _, copies = _step_parts(mode, copies_only=True)
    np.testing.assert_allclose(
        float(grouped(params, step_lib.shard_batch(mesh, copies))[0]),
        float(no_groups(copies)), rtol=2e-6)


# ----------------------------------------------------------------- resume


def _state(workdir, step):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  with ocp.PyTreeCheckpointer() as c:
    return c.restore(os.path.join(workdir, "checkpoints", str(step),
                                  "state"))


@pytest.mark.slow
def test_grouped_run_resumes_bitwise(tmp_path, shapes_dir):
  config = _tiny(shapes_dir, **{"captions_per_image": 2,
                                "loss.groups": "image",
                                "loss.group_mode": "positives",
                                "eval.every_steps": 0})
  ref, work = str(tmp_path / "ref"), str(tmp_path / "work")
  train_lib.train_and_evaluate(config, ref)
  want = _state(ref, 8)
  # The same run, its last checkpoint lost (keep 2: 6 and 8), resumed
  # from step 6.
  train_lib.train_and_evaluate(config, work)
  shutil.rmtree(os.path.join(work, "checkpoints", "8"))
  summary = train_lib.train_and_evaluate(config, work)
  assert summary["resumed_from"] == 6
  got = _state(work, 8)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_the_streamed_tower_carries_the_groups_in_step_order():
  from tests import test_stream  # pylint: disable=import-outside-toplevel
  from train import streamed_tower  # pylint: disable=import-outside-toplevel
  tower, _, _, params, images, tokens = test_stream._parts()  # pylint: disable=protected-access
  n_dev, mb = 2, 8
  mesh = Mesh(np.array(jax.devices()[:n_dev]), (step_lib.AXIS,))
  groups = (np.arange(len(images)) // 2).astype(np.int32)
  micro = [{"image": images[i:i + mb], "text": tokens[i:i + mb],
            "group": groups[i:i + mb]} for i in range(0, len(images), mb)]
  streamer = streamed_tower.StreamedImageTower(mesh, tower, params["img"])
  out = streamer.step_inputs(iter(micro), len(micro))
  # The ids sit beside their own pairs' tokens, device-major.
  np.testing.assert_array_equal(
      np.asarray(out["group"]),
      streamed_tower.device_major([m["group"] for m in micro], n_dev))
  np.testing.assert_array_equal(
      np.asarray(out["text"]),
      streamed_tower.device_major([m["text"] for m in micro], n_dev))
  assert "group" not in streamer.step_inputs(
      iter([{k: v for k, v in m.items() if k != "group"} for m in micro]),
      len(micro))
