"""Held-out evaluation: retrieval over every caption, zero-shot top-k with
class names and templates from data, and streamed data-parallel embedding.

References are written independently here (full similarity matrices and
stable argsorts with the tie rule spelled out) and run on fresh random
embeddings of odd sizes; the streamed evaluation is compared with an
in-memory one on the synthetic set, and its memory with the split size.
"""
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import lit_demo
from train import data as data_lib
from train.eval import evaluator
from train import metrics
from train import step as step_lib
from train.data.decode import host as host_lib
from train import train
from train.data import eval_sets
from train.data.sources import synthetic
from train.eval import names
from train.eval import retrieval
from train.eval import embed as embed_lib
from train.eval import zeroshot

TFDS_IMAGENET_LABELS = os.path.join(
    os.path.dirname(__import__("tensorflow_datasets").__file__),
    "datasets", "imagenet2012", "labels.txt")


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _rank_by_sort(scores, is_match):
  """Position of the best match in a stable descending sort where, among
  equal scores, matches come first (the tie rule of train/eval)."""
  order = np.lexsort((~is_match, -scores))
  return int(np.flatnonzero(is_match[order])[0])


def _reference_recall(img, txt, owner, ks=(1, 5, 10)):
  sim = img.astype(np.float64) @ txt.astype(np.float64).T
  i2t = [_rank_by_sort(sim[i], owner == i) if np.any(owner == i)
         else len(owner) for i in range(len(img))]
  t2i = [_rank_by_sort(sim[:, t], np.arange(len(img)) == owner[t])
         for t in range(len(txt))]
  out = {f"i2t_r{k}": np.mean(np.asarray(i2t) < k) for k in ks}
  out.update({f"t2i_r{k}": np.mean(np.asarray(t2i) < k) for k in ks})
  return out


@pytest.mark.parametrize("seed", [0, 1])
def test_retrieval_with_five_captions_equals_the_reference(seed):
  rng = np.random.default_rng(seed)
  n, d = 37, 6  # Low dimension: many near-ties, and frequent misses.
  counts = np.full(n, 5)
  counts[[3, 11]] = [4, 7]  # COCO has images with more or fewer than 5.
  owner = np.repeat(np.arange(n), counts)
  img = _unit(rng.normal(size=(n, d)))
  txt = _unit(img[owner] + rng.normal(size=(len(owner), d)) * 1.2)
  # Exact ties: a caption duplicated onto another image's caption, and two
  # identical images.
  txt[20] = txt[40]
  img[30] = img[31]
  img, txt = img.astype(np.float32), txt.astype(np.float32)
  want = _reference_recall(img, txt, owner)
  for block in (1024, 7):  # The blocked similarity changes nothing.
    i2t = retrieval.image_to_text_ranks(img, txt, owner, block=block)
    t2i = retrieval.text_to_image_ranks(img, txt, owner, block=block)
    got = {f"i2t_r{k}": np.mean(i2t < k) for k in (1, 5, 10)}
    got.update({f"t2i_r{k}": np.mean(t2i < k) for k in (1, 5, 10)})
    assert got == pytest.approx(want, abs=0), block
  assert retrieval.recall(img, txt, owner) == pytest.approx(want, abs=0)
  assert 0 < want["i2t_r1"] < want["i2t_r10"] < 1


def test_retrieval_any_caption_counts_and_every_caption_is_a_query():
  # Image 0's 2nd caption is the best match of image 0; its 1st is far off.
  img = np.eye(3, dtype=np.float32)
  txt = np.array([[0, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 0]], np.float32)
  owner = np.array([0, 0, 1, 2])
  got = retrieval.recall(img, txt, owner, ks=(1, 2))
  # i2t: image 0 hits through its 2nd caption; image 1's own caption 2 ties
  # caption 3 (a tie: still a hit); image 2 is beaten by image 0's caption 0.
  assert got["i2t_r1"] == pytest.approx(2 / 3) and got["i2t_r2"] == 1.0
  # t2i: all 4 captions are queries; caption 0 and caption 3 rank their own
  # image second.
  assert got["t2i_r1"] == 0.5 and got["t2i_r2"] == 1.0


def test_retrieval_and_zero_shot_of_nan_embeddings_are_nan():
  img = np.eye(3, dtype=np.float32)
  img[1, 0] = np.nan
  got = retrieval.recall(img, np.eye(3, dtype=np.float32), np.arange(3))
  assert all(np.isnan(v) for v in got.values())
  z = zeroshot.accuracy(img, np.eye(3, dtype=np.float32), np.arange(3))
  assert np.isnan(z["zeroshot_top1"]) and np.isnan(z["zeroshot_top5"])


def test_zero_shot_top_k_equals_the_reference_and_chance_is_uniform():
  rng = np.random.default_rng(3)
  n, c, d = 101, 13, 5
  cls = _unit(rng.normal(size=(c, d))).astype(np.float32)
  labels = rng.integers(0, c, n)
  img = _unit(cls[labels] + rng.normal(size=(n, d))).astype(np.float32)
  img[7] = cls[2]  # A tie between classes 2 and 4 ...
  cls[4] = cls[2]
  labels[7] = 4    # ... resolved in the true class's favour.
  sim = img.astype(np.float64) @ cls.astype(np.float64).T
  ranks = np.array([_rank_by_sort(sim[i], np.arange(c) == labels[i])
                    for i in range(n)])
  got = zeroshot.accuracy(img, cls, labels, block=10)
  assert got["zeroshot_top1"] == np.mean(ranks < 1)
  assert got["zeroshot_top5"] == np.mean(ranks < 5)
  assert got["zeroshot_chance"] == 1 / 13 and got["zeroshot_num_classes"] == 13
  assert 0.2 < got["zeroshot_top1"] < got["zeroshot_top5"] < 1
  with pytest.raises(ValueError, match="labels outside"):
    zeroshot.accuracy(img, cls, labels + 13)


def test_chance_is_printed_one_way():
  m = {"zeroshot_top1": 0.547, "zeroshot_top5": 0.98,
       "zeroshot_num_classes": 8.0, "zeroshot_chance": zeroshot.chance(8)}
  assert zeroshot.describe(m) == ("top-1 54.7%, top-5 98.0% (8 classes; "
                                  "chance 1/8 = 12.5%, 4.4x)")
  line = metrics.eval_line(3, m)
  assert "zero-shot " + zeroshot.describe(m) in line


def test_template_averaging_cancels_a_template_nuisance():
  # Prompt embeddings: one-hot of the class plus a +-1 template component.
  classes, templates = ["a", "b", "c"], ["{} x", "{} yy"]
  prompts = zeroshot.prompts(classes, templates)
  assert prompts == ["a x", "a yy", "b x", "b yy", "c x", "c yy"]
  emb = np.zeros((6, 4), np.float32)
  for i, p in enumerate(prompts):
    emb[i, classes.index(p[0])] = 1.0
    emb[i, 3] = 1.0 if p.endswith("x") else -1.0
  np.testing.assert_allclose(zeroshot.average_templates(emb, 3),
                             np.eye(3, 4), atol=1e-6)


# ------------------------------------------------------- names and templates


def _data(**kw):
  c = lit_demo.get_config("tiny").data
  for k, v in kw.items():
    c[k] = v
  return c


def test_class_names_and_templates_from_files_and_lists(tmp_path):
  label_names = ["cat_face", "dog"]
  p = names.resolve(_data(), label_names)
  assert p.classnames == ("cat face", "dog")  # The dataset's, "_" -> " ".
  assert p.templates == names.BASE_TEMPLATES
  plain = tmp_path / "names.txt"
  plain.write_text("# my names\nkitty\n\npuppy\n")
  tmpl = tmp_path / "templates.txt"
  tmpl.write_text("a {} here.\nitap of a {}.\n")
  p = names.resolve(_data(zeroshot_classnames_file=str(plain),
                          zeroshot_templates_file=str(tmpl)), label_names)
  assert p.classnames == ("kitty", "puppy")
  assert p.templates == ("a {} here.", "itap of a {}.")
  assert p.classnames_from == str(plain) and p.templates_from == str(tmpl)
  tsv = tmp_path / "names.tsv"
  tsv.write_text("dog\tDog\ncat_face\tCat\nother\tunused\n")
  p = names.resolve(_data(zeroshot_classnames_file=str(tsv)), label_names)
  assert p.classnames == ("Cat", "Dog")  # Mapped by label, in label order.
  p = names.resolve(_data(zeroshot_classnames=("x", "y"),
                          zeroshot_templates=("{}!",)), label_names)
  assert p.classnames == ("x", "y") and p.templates == ("{}!",)


def test_wordnet_ids_get_clip_names_and_prompts():
  with open(TFDS_IMAGENET_LABELS) as f:  # What TFDS imagenet2012 labels are.
    wnids = f.read().split()
  assert len(wnids) == 1000
  p = names.resolve(_data(), wnids)
  assert p.classnames[:3] == ("tench", "goldfish", "great white shark")
  assert p.classnames[207] == "Golden Retriever"
  assert len(set(p.classnames)) >= 995 and not any(
      names.is_wordnet([c]) for c in p.classnames)
  assert len(p.templates) == 80 and p.templates[0] == "a bad photo of a {}."
  assert p.classnames_from == names.IMAGENET_CLASSNAMES
  # A subset of the classes (ImageNet-A/R style) maps by ID, not by position.
  sub = names.resolve(_data(), [wnids[207], wnids[0]])
  assert sub.classnames == ("Golden Retriever", "tench")
  # The user's templates still win over the default ensemble.
  assert names.resolve(_data(zeroshot_templates=("a {}.",)),
                       wnids).templates == ("a {}.",)


@pytest.mark.parametrize("content,kw,message", [
    ("a\nb\nc\n", {}, "3 names for the dataset's 2 classes"),
    ("cat\tx\nb\n", {}, "mixes the 'name' and 'label<TAB>name'"),
    ("cat_face\tx\n", {}, "no name for 1 of the dataset's labels"),
    ("", {}, "has no class names"),
    (None, {"zeroshot_templates": ("no placeholder",)}, "exactly once"),
    (None, {"zeroshot_templates": ("{} and {}",)}, "exactly once"),
    (None, {"zeroshot_classnames_file": "/no/such/names.txt"},
     "file not found: '/no/such/names.txt'"),
])
def test_bad_names_and_templates_are_one_line_errors(tmp_path, content, kw,
                                                     message):
  if content is not None:
    path = tmp_path / "n.txt"
    path.write_text(content)
    kw = {"zeroshot_classnames_file": str(path), **kw}
  with pytest.raises(ValueError, match=message) as e:
    names.resolve(_data(**kw), ["cat_face", "dog"])
  assert "\n" not in str(e.value)


# ------------------------------------------------------- streamed evaluation


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _tiny(data_dir, **kw):
  c = lit_demo.get_config("tiny")
  c.data.data_dir = data_dir
  c.data.num_eval_examples = 29  # Odd: the last batch is padded.
  for k, v in kw.items():
    node, key = c, k.split(".")
    for part in key[:-1]:
      node = node[part]
    node[key[-1]] = v
  return c


def _model(config):
  tokenizer = data_lib.make_tokenizer(config)
  image_tower, text_tower, head = train.make_models(config, tokenizer)
  params = train.init_params(config, image_tower, text_tower, head, tokenizer)
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  return tokenizer, image_tower, text_tower, params, mesh


def _in_memory(config, tokenizer, image_tower, text_tower, params):
  """The whole split in memory, one forward pass, as [-1, 1] floats."""
  zs, rs = data_lib.make_eval_sets(config, tokenizer)
  examples = zs.split.read_all()
  images = host_lib.to_float(np.stack([e["image"] for e in examples]))
  img = np.asarray(image_tower.module.apply({"params": params["img"]},
                                            images))
  prompts = zeroshot.prompts(zs.classnames, zs.templates)
  cls = zeroshot.average_templates(np.asarray(text_tower.apply(
      {"params": params["txt"]}, tokenizer.encode(prompts))),
      len(zs.classnames))
  labels = np.array([e["label"] for e in examples])
  texts, owner = evaluator.caption_table([e["captions"] for e in examples])
  txt = np.asarray(text_tower.apply({"params": params["txt"]},
                                    tokenizer.encode(texts)))
  out = zeroshot.accuracy(_unit(img), cls, labels)
  out.update(retrieval.recall(_unit(img), _unit(txt), owner))
  return img, out


@pytest.mark.slow  # ~20 s on 2 cores: two evaluators and the reference.
def test_streamed_evaluation_equals_the_in_memory_one(data_dir):
  config = _tiny(data_dir)
  tokenizer, image_tower, text_tower, params, mesh = _model(config)
  img_ref, want = _in_memory(config, tokenizer, image_tower, text_tower,
                             params)
  for bs in (8, 24):  # 4 batches (last: 5 rows) and 2 (last: 5 rows).
    config.eval.batch_size = bs
    ev = train.make_evaluator(config, mesh, image_tower, text_tower,
                              tokenizer)
    got = ev(jax.device_put(params, NamedSharding(mesh, P())))
    assert got["zeroshot_num_examples"] == 29
    assert got["retrieval_num_images"] == 29
    assert got["retrieval_num_captions"] == 29  # One caption per test image.
    for k, v in want.items():
      assert got[k] == pytest.approx(v, abs=1e-9), (bs, k)
    emb = embed_lib.embed_split(
        ev.zeroshot.split, mesh=mesh, image_embed=ev._embed_img,
        params=params["img"], batch_size=bs)
    np.testing.assert_allclose(emb.images, img_ref, rtol=1e-5, atol=1e-6)
  # The same names and templates given as files: the same numbers.
  d = os.path.join(data_dir, "prompts")
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "names.txt"), "w") as f:
    f.write("\n".join(synthetic.SHAPES) + "\n")
  with open(os.path.join(d, "templates.txt"), "w") as f:
    f.write("\n".join(synthetic.ZEROSHOT_TEMPLATES) + "\n")
  config = _tiny(data_dir, **{
      "data.zeroshot_classnames_file": os.path.join(d, "names.txt"),
      "data.zeroshot_templates_file": os.path.join(d, "templates.txt")})
  ev = train.make_evaluator(config, mesh, image_tower, text_tower, tokenizer)
  assert ev.zeroshot.prompts.classnames_from.endswith("names.txt")
  got = ev(jax.device_put(params, NamedSharding(mesh, P())))
  assert got["zeroshot_top1"] == want["zeroshot_top1"]
  assert got["zeroshot_top5"] == want["zeroshot_top5"]
  # Other names change what is evaluated (and are used: a class-name file
  # overrides the dataset's).
  with open(os.path.join(d, "names.txt"), "w") as f:
    f.write("\n".join(f"thing {i}" for i in range(8)) + "\n")
  zs, _ = data_lib.make_eval_sets(config, tokenizer)
  assert zs.classnames == [f"thing {i}" for i in range(8)]


def _fake_split(n, size):
  """An EvalSplit of n random images, without any dataset behind it."""
  def read(indices):
    out = []
    for i in indices:
      rng = np.random.default_rng(i)
      out.append({"image": rng.integers(0, 256, (size, size, 3), np.uint8),
                  "captions": [f"image {i}"], "label": i % 3})
    return out
  return eval_sets.EvalSplit(name=f"fake[{n}]", num_examples=n,
                             total_examples=n, image_size=size, read=read)


def test_streamed_memory_does_not_grow_with_the_split():
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  size, d, bs = 64, 8, 16
  w = jnp.asarray(np.random.default_rng(0).normal(size=(size * size * 3, d)),
                  jnp.float32)
  embed = embed_lib.make_image_embed(
      mesh, lambda p, x: x.reshape(x.shape[0], -1).astype(jnp.float32) @ p)
  peaks = {}
  for n in (64, 512):
    split = _fake_split(n, size)
    embed_lib.embed_split(split, mesh=mesh, image_embed=embed, params=w,
                          batch_size=bs)  # Compiles; warms caches.
    tracemalloc.start()
    emb = embed_lib.embed_split(split, mesh=mesh, image_embed=embed,
                                params=w, batch_size=bs)
    peaks[n] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert emb.images.shape == (n, d) and emb.labels.tolist() == [
        i % 3 for i in range(n)]
    # Against the same split embedded in one piece.
    whole = np.stack([e["image"] for e in split.read_all()])
    want = np.asarray(whole.reshape(n, -1).astype(np.float32) @ w)
    np.testing.assert_allclose(emb.images, want,
                               atol=1e-5 * np.abs(want).max())
  image_bytes = size * size * 3
  growth = peaks[512] - peaks[64]
  # What it holds per example: an embedding row and its caption; never the
  # decoded image (which alone would be 448 x 12 KiB = 5.3 MiB more).
  assert growth < (512 - 64) * (d * 4 + 600), (peaks, growth)
  assert growth < 0.1 * (512 - 64) * image_bytes


def test_config_check_names_bad_zero_shot_keys(tmp_path):
  def error(**kw):
    c = _tiny(str(tmp_path / "tfds"))
    for k, v in kw.items():
      c.data[k] = v
    with pytest.raises(ValueError) as e:
      data_lib.check_data_config(c)
    assert "\n" not in str(e.value)
    return str(e.value)
  assert "zeroshot_classnames_file: file not found: '/no/names.txt'" in error(
      zeroshot_classnames_file="/no/names.txt")
  assert "zeroshot_templates_file: file not found" in error(
      zeroshot_templates_file="nope.txt")
  assert "both set" in error(zeroshot_templates=("a {}.",),
                             zeroshot_templates_file=names.IMAGENET_TEMPLATES)
  assert "exactly once" in error(zeroshot_templates=("a photo",))
  # A shipped file is found by its name alone.
  c = _tiny(str(tmp_path / "tfds"))
  c.data.zeroshot_templates_file = "imagenet_clip_templates.txt"
  data_lib.check_data_config(c)


def test_the_training_split_size_feeds_the_batch_warning(data_dir):
  from train import optim  # pylint: disable=import-outside-toplevel
  from train.data import sources  # pylint: disable=import-outside-toplevel
  from train.data.sources import tfds  # pylint: disable=import-outside-toplevel
  config = _tiny(data_dir)
  tfds.builder_for(config.data)  # Prepared.
  # The trainer passes the training source's length (any source format).
  n = len(sources.open_source(config.data, config.data.split))
  assert n == config.data.num_train_examples == 128
  assert optim.batch_repeat_warning(256, n, "train").startswith(
      "[lit] warning: config.batch_size=256 is larger than the 128 examples")
  assert optim.batch_repeat_warning(128, n, "train") is None
