"""Tests of train.data: synthetic_shapes, the TFDS/grain pipeline, tokenizers,
eval sets and config errors. Everything is generated locally (no network)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest

from train import data as D
from train.data.decode import host as host_lib
from train.data.sources import synthetic
from train.data.sources import tfds
from train.data import tokenizer as tokenizer_lib

IMAGE_SIZE = 16
NUM_TRAIN = 256
NUM_TEST = 64


def _config(data_dir, **overrides):
  config = ml_collections.ConfigDict()
  config.data = D.default_data_config()
  config.tokenizer = D.default_tokenizer_config()
  config.data.data_dir = str(data_dir)
  config.data.image_size = IMAGE_SIZE
  config.data.num_train_examples = NUM_TRAIN
  config.data.num_eval_examples = NUM_TEST
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  return config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  path = tmp_path_factory.mktemp("tfds")
  synthetic.prepare(path, image_size=IMAGE_SIZE, num_train=NUM_TRAIN,
                    num_test=NUM_TEST, seed=0)
  return path


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same_batches(a, b):
  return all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
             for x, y in zip(a, b, strict=True))


def _image_ids(batches):
  """Content hashes of the images (pixel noise makes every image unique)."""
  return [hashlib.sha1(img.tobytes()).hexdigest()
          for b in batches for img in b["image"]]


# ----------------------------------------------------------------- tokenizer

def test_byte_tokenizer_round_trip_and_layout():
  tok = tokenizer_lib.ByteTokenizer(max_len=24)
  texts = ["a small red circle", "", "größer ☆ star", "x" * 40]
  ids = tok.encode(texts)
  assert ids.shape == (4, 24) and ids.dtype == np.int32
  assert ids.min() >= 0 and ids.max() < tok.vocab_size
  assert tok.decode(ids)[:3] == texts[:3]
  # EOS right after the text, pad after it; truncation keeps EOS.
  n = len(texts[0].encode())
  assert ids[0, n] == tok.eos_id and (ids[0, n + 1:] == tok.pad_id).all()
  assert ids[1, 0] == tok.eos_id and (ids[1, 1:] == 0).all()
  assert ids[3, -1] == tok.eos_id and tok.decode(ids[3:])[0] == "x" * 23
  assert np.array_equal(tok.encode([b"a small red circle"])[0], ids[0])
  with pytest.raises(TypeError, match="list of strings"):
    tok.encode("not a list")


def test_sentencepiece_tokenizer(tmp_path):
  spm = pytest.importorskip("sentencepiece")  # in the dev extra: CI has it
  corpus = tmp_path / "corpus.txt"
  lines = [synthetic._fill(t, dict(size="small", color=c, shape=s, hpos="left",
                                   vpos="top", bg="gray"),
                           np.random.default_rng(i))
           for i, (t, c, s) in enumerate(
               (t, c, s) for t in synthetic.TRAIN_TEMPLATES
               for c in synthetic.COLOR_NAMES for s in synthetic.SHAPES)]
  corpus.write_text("\n".join(lines))
  spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"),
                                 vocab_size=60, model_type="unigram",
                                 minloglevel=2)
  config = _config(tmp_path, **{"tokenizer.kind": "sentencepiece",
                                "tokenizer.spm_path": str(tmp_path / "m.model"),
                                "tokenizer.max_len": 32})
  tok = D.make_tokenizer(config)
  ids = tok.encode(lines[:5])
  assert ids.shape == (5, 32) and tok.vocab_size == 62
  assert tok.decode(ids) == lines[:5]
  assert (ids[:, 0] > tok.eos_id).all()  # real pieces, shifted past pad/eos


def test_sentencepiece_missing_package_or_file(tmp_path, monkeypatch):
  model = tmp_path / "m.model"
  config = _config(tmp_path, **{"tokenizer.kind": "sentencepiece",
                                "tokenizer.spm_path": str(model)})
  with pytest.raises(ValueError, match="spm_path=.*no such file"):
    D.make_tokenizer(config)
  model.write_bytes(b"not a model")
  monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails
  with pytest.raises(ValueError, match="pip install sentencepiece"):
    D.make_tokenizer(config)
  config.tokenizer.spm_path = ""
  with pytest.raises(ValueError, match="needs config.tokenizer.spm_path"):
    D.make_tokenizer(config)


# ------------------------------------------------------------ synthetic data

def test_render_is_deterministic_and_real():
  a, attrs_a, _ = synthetic.render_example(3, "train", 17, 32)
  b, attrs_b, _ = synthetic.render_example(3, "train", 17, 32)
  c, _, _ = synthetic.render_example(4, "train", 17, 32)
  assert np.array_equal(a, b) and attrs_a == attrs_b
  assert not np.array_equal(a, c)
  assert a.shape == (32, 32, 3) and a.dtype == np.uint8
  for i in range(40):
    img, attrs, _ = synthetic.render_example(0, "train", i, 32)
    img = img.astype(np.float32)
    assert img.std() > 10  # not a constant canvas
    # The pixels that differ most from the background have the caption's
    # color: the picture shows what the caption says.
    bg = np.median(img.reshape(-1, 3), axis=0)
    dist = np.linalg.norm(img - bg, axis=-1)
    fg = img[dist > 0.8 * dist.max()].mean(axis=0)
    want = np.array(synthetic.COLORS[attrs["color"]], np.float32)
    assert np.linalg.norm(fg - want) < 60, (attrs, fg)


def test_shapes_and_sizes_differ_in_pixels():
  """Per-class foreground masks differ, and 'large' covers more than 'small'."""
  masks = {s: [] for s in synthetic.SHAPES}
  area = {s: [] for s in synthetic.SIZES}
  for i in range(400):
    img, attrs, _ = synthetic.render_example(1, "train", i, 32)
    img = img.astype(np.float32)
    bg = np.median(img.reshape(-1, 3), axis=0)
    fg = np.linalg.norm(img - bg, axis=-1) > 60
    area[attrs["size"]].append(fg.mean())
    masks[attrs["shape"]].append(fg.mean())
  assert np.mean(area["large"]) > 2 * np.mean(area["small"])
  # Same size distribution for all shapes, yet different coverage: e.g. a
  # ring or star covers less of its bounding circle than a circle does.
  cover = {s: np.mean(v) for s, v in masks.items()}
  assert cover["circle"] > 1.3 * cover["star"]
  assert cover["circle"] > 1.3 * cover["ring"]


def test_heldout_combinations_and_templates(data_dir):
  builder = tfds.builder_for(_config(data_dir).data)
  for split, want_heldout in (("train", False), ("test", True)):
    source = builder.as_data_source(split=split)
    combos = {(int(ex["label"]), int(ex["color"])) for ex in
              (source[i] for i in range(len(source)))}
    assert all(synthetic.is_heldout(*c) == want_heldout for c in combos)
  assert len(synthetic._allowed_combos("test")) == 16
  # Every shape has held-out colors, so zero-shot covers all classes.
  assert {s for s, _ in synthetic._allowed_combos("test")} == set(range(8))
  # No training caption uses a zero-shot prompt's wording.
  train = builder.as_data_source(split="train")
  captions = [c.decode() for i in range(len(train))
              for c in train[i]["captions"]["text"]]
  stems = [t.split("{}")[0].strip() for t in synthetic.ZEROSHOT_TEMPLATES]
  assert not any(stem in cap for cap in captions for stem in stems)
  assert len(set(captions)) > len(captions) // 2  # varied phrasing


def test_prepare_is_cached_and_reproducible(data_dir, tmp_path):
  path = synthetic.dataset_dir(data_dir, IMAGE_SIZE, NUM_TRAIN, NUM_TEST, 0)
  stamp = os.path.getmtime(os.path.join(path, "dataset_info.json"))
  assert synthetic.prepare(data_dir, image_size=IMAGE_SIZE, num_train=NUM_TRAIN,
                           num_test=NUM_TEST, seed=0) == path
  assert os.path.getmtime(os.path.join(path, "dataset_info.json")) == stamp
  # A generation killed midway leaves TFDS's temporary directory; the next
  # prepare removes it and generates the dataset.
  stale = synthetic.dataset_dir(tmp_path / "k", 8, 16, 4, 0)
  partial = os.path.join(os.path.dirname(stale), "incomplete.ABC123_1.1.0")
  os.makedirs(partial)
  assert synthetic.prepare(tmp_path / "k", image_size=8, num_train=16,
                           num_test=4) == stale
  assert not os.path.exists(partial)
  assert len(tfds._builder_from_dir(stale).as_data_source(split="train")) == 16
  # Two processes generating into one directory at once (multi-process
  # start-up) both succeed; a generation in another directory reads back
  # identical examples (deterministic generation and TFDS write order).
  code = ("import sys; from train.data.sources import synthetic; "
          "print(synthetic.prepare(sys.argv[1], image_size=8, num_train=48, "
          "num_test=8))")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  dirs = [tmp_path / "a", tmp_path / "a", tmp_path / "b"]
  procs = [subprocess.Popen([sys.executable, "-c", code, str(d)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for d in dirs]
  outs = [p.communicate(timeout=120) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs
  assert outs[0][0] == outs[1][0]
  builders = [tfds._builder_from_dir(out.strip().splitlines()[-1])
              for out, _ in (outs[0], outs[2])]
  for split, n in (("train", 48), ("test", 8)):
    a, b = (bld.as_data_source(split=split) for bld in builders)
    assert len(a) == len(b) == n
    for i in range(n):
      assert np.array_equal(a[i]["image"], b[i]["image"])
      assert a[i]["captions"]["text"] == b[i]["captions"]["text"]


# ------------------------------------------------------------------ pipeline

def test_batches_shape_dtype_range(data_dir):
  it = D.make_train_iterator(_config(data_dir), batch_size=8, seed=0)
  batch = next(it)
  assert batch["image"].shape == (8, IMAGE_SIZE, IMAGE_SIZE, 3)
  assert batch["image"].dtype == np.uint8  # normalised on the device
  assert 0 <= batch["image"].min() < batch["image"].max() <= 255
  assert batch["text"].shape == (8, 64) and batch["text"].dtype == np.int32
  assert batch["label"].dtype == np.int32
  assert ((batch["label"] >= 0) & (batch["label"] < 8)).all()
  tok = D.make_tokenizer(_config(data_dir))
  for caption, label in zip(tok.decode(batch["text"]), batch["label"]):
    assert synthetic.SHAPES[label] in caption  # caption matches the label


def test_determinism_and_seed(data_dir):
  config = _config(data_dir)
  a = _take(D.make_train_iterator(config, batch_size=16, seed=5), 6)
  b = _take(D.make_train_iterator(config, batch_size=16, seed=5), 6)
  c = _take(D.make_train_iterator(config, batch_size=16, seed=6), 6)
  assert _same_batches(a, b)
  assert not np.array_equal(a[0]["image"], c[0]["image"])
  # Reader threads and the in-memory cache do not change the batches.
  config1 = _config(data_dir, **{"data.num_threads": 1,
                                 "data.cache_max_mb": 0})
  d = _take(D.make_train_iterator(config1, batch_size=16, seed=5), 6)
  assert _same_batches(a, d)


@pytest.mark.parametrize("k", [0, 3, 17])
def test_resume_is_exact(data_dir, k):
  """State after k batches -> a fresh iterator yields the same next batches,
  across an epoch boundary (256 examples / 24 per batch)."""
  config = _config(data_dir)
  it = D.make_train_iterator(config, batch_size=24, seed=2)
  _take(it, k)
  state = json.loads(json.dumps(it.get_state()))  # survives a checkpoint
  expected = _take(it, 6)
  resumed = D.make_train_iterator(config, batch_size=24, seed=2)
  resumed.set_state(state)
  assert _same_batches(expected, _take(resumed, 6))
  # Rewinding a running iterator works too.
  it.set_state(state)
  assert _same_batches(expected, _take(it, 6))


def test_resume_rejects_other_stream(data_dir):
  config = _config(data_dir)
  state = D.make_train_iterator(config, batch_size=8, seed=0).get_state()
  other = D.make_train_iterator(config, batch_size=8, seed=1)
  with pytest.raises(ValueError, match="seed: saved 0 != now 1"):
    other.set_state(state)


def test_epochs_cover_data_and_reshuffle(data_dir):
  config = _config(data_dir)
  batches = _take(D.make_train_iterator(config, batch_size=32, seed=0),
                  2 * NUM_TRAIN // 32)
  ids = _image_ids(batches)
  first, second = ids[:NUM_TRAIN], ids[NUM_TRAIN:]
  assert len(set(first)) == NUM_TRAIN and set(first) == set(second)
  assert first != second  # a new permutation each epoch


def test_process_shards_disjoint_and_covering(data_dir):
  config = _config(data_dir)
  everything = set(_image_ids(_take(
      D.make_train_iterator(config, batch_size=32, seed=0), NUM_TRAIN // 32)))
  shards = []
  for p in range(3):
    n = len(range(p, NUM_TRAIN, 3))  # 86, 85, 85: one epoch of the shard
    it = D.make_train_iterator(config, batch_size=n, seed=0, process_index=p,
                               process_count=3)
    ids = _image_ids([next(it)])
    assert len(set(ids)) == n
    shards.append(set(ids))
  assert not (shards[0] & shards[1] or shards[0] & shards[2] or shards[1] & shards[2])
  assert shards[0] | shards[1] | shards[2] == everything
  with pytest.raises(ValueError, match="process_index=3"):
    D.make_train_iterator(config, batch_size=4, process_index=3, process_count=3)


def test_preprocess_resize_crop_gray():
  img = np.zeros((40, 80, 3), np.uint8)
  img[:, 20:60] = 255  # a centered white band: the central crop keeps it
  out = host_lib.preprocess_image(img, 16)
  assert out.shape == (16, 16, 3) and out.dtype == np.float32
  assert out[:, 2:14].min() > 0.9
  gray = host_lib.preprocess_image(np.full((20, 10, 1), 255, np.uint8), 8)
  assert gray.shape == (8, 8, 3) and np.allclose(gray, 1.0)


# ----------------------------------------------------------------- eval sets

def test_eval_sets(data_dir):
  config = _config(data_dir)
  tok = D.make_tokenizer(config)
  zeroshot, retrieval = D.make_eval_sets(config, tok)
  assert zeroshot.images.shape == (NUM_TEST, IMAGE_SIZE, IMAGE_SIZE, 3)
  assert zeroshot.classnames == list(synthetic.SHAPES)
  assert zeroshot.templates == list(synthetic.ZEROSHOT_TEMPLATES)
  assert set(zeroshot.labels.tolist()) <= set(range(8))
  assert len(set(zeroshot.labels.tolist())) >= 6
  assert zeroshot.images.dtype == np.uint8  # Normalised on the device.
  # One split serves both sets; every caption of each image is kept.
  assert retrieval.split is zeroshot.split
  assert len(retrieval.captions) == NUM_TEST
  assert np.array_equal(retrieval.images, zeroshot.images)
  for captions, label in zip(retrieval.captions, zeroshot.labels):
    assert captions and synthetic.SHAPES[label] in captions[0]
  # The held-out split really is held out: its images' combos are unseen.
  builder = tfds.builder_for(config.data)
  test = builder.as_data_source(split="test")
  assert all(synthetic.is_heldout(int(test[i]["label"]), int(test[i]["color"]))
             for i in range(len(test)))


# ------------------------------------------- a TFDS dataset on disk (coco-like)

_TINY_BUILDERS = textwrap.dedent('''
    import sys
    import numpy as np
    import tensorflow_datasets as tfds
    from PIL import Image

    class FakeCocoCaptions(tfds.core.GeneratorBasedBuilder, skip_registration=True):
      """Written where and as TFDS writes coco_captions (data_dir/coco_captions/
      2017/1.1.0, same feature layout: JPEG images of varying size, "image/id",
      several captions each), so `name="coco_captions"` reads it exactly as
      it would read the real one."""
      name = "coco_captions"
      VERSION = tfds.core.Version("1.1.0")
      BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="2017")]
      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, 3), encoding_format="jpeg"),
            "image/filename": tfds.features.Text(),
            "image/id": tfds.features.Scalar(np.int64),
            "captions": tfds.features.Sequence({
                "id": tfds.features.Scalar(np.int64),
                "text": tfds.features.Text()}),
        }))
      def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(0, 40),
                "val": self._generate_examples(1, 12)}
      def _generate_examples(self, split, n):
        rng = np.random.default_rng(split)
        for i in range(n):
          h, w = rng.integers(20, 60, 2)
          img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
          yield i, {"image": Image.fromarray(img), "image/id": i,
                    "image/filename": f"{i:012d}.jpg",
                    "captions": {"id": [2 * i, 2 * i + 1],
                                 "text": [f"photo {split} {i}", f"alt {split} {i}"]}}

    class TinyClassification(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")
      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(24, 24, 3)),
            "label": tfds.features.ClassLabel(names=["red_thing", "blue_thing"]),
        }))
      def _split_generators(self, dl_manager):
        return {"test": self._generate_examples()}
      def _generate_examples(self):
        for i in range(10):
          img = np.zeros((24, 24, 3), np.uint8); img[..., 2 * (i % 2)] = 200
          yield i, {"image": Image.fromarray(img), "label": i % 2}

    for cls in (FakeCocoCaptions, TinyClassification):
      cls(data_dir=sys.argv[1], file_format="array_record").download_and_prepare()
''')


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """TFDS datasets prepared by another process, so this one reads them from
  their files alone (as with a coco_captions the user prepared)."""
  path = tmp_path_factory.mktemp("tfds_generic")
  script = path / "make_tiny.py"
  script.write_text(_TINY_BUILDERS)
  subprocess.run([sys.executable, str(script), str(path)], check=True,
                 capture_output=True, cwd=path)
  return path


def _coco_config(tfds_dir, **overrides):
  base = {"data.name": "coco_captions", "data.eval_split": "val",
          "data.label_key": "", "data.num_eval_examples": 5,
          "data.image_size": 16}
  base.update(overrides)
  return _config(tfds_dir, **base)


def test_tfds_dataset_from_files(tfds_dir):
  config = _coco_config(tfds_dir)
  D.check_data_config(config)
  tok = D.make_tokenizer(config)
  it = D.make_train_iterator(config, batch_size=8, seed=0)
  batches = _take(it, 6)  # > 1 epoch of 40
  assert batches[0]["image"].shape == (8, 16, 16, 3)
  assert (batches[0]["label"] == -1).all()
  captions = [c for b in batches for c in tok.decode(b["text"])]
  assert all(c.startswith(("photo 0 ", "alt 0 ")) for c in captions)
  # One caption per example is sampled, varying with the epoch position.
  assert {c.split()[0] for c in captions} == {"photo", "alt"}
  state = it.get_state()
  expected = _take(it, 3)
  resumed = D.make_train_iterator(config, batch_size=8, seed=0)
  resumed.set_state(state)
  assert _same_batches(expected, _take(resumed, 3))
  zeroshot, retrieval = D.make_eval_sets(config, tok)
  assert zeroshot is None  # no labels and no zeroshot_name
  # The first caption of the first 5 examples (TFDS shuffles at write time).
  firsts = [c[0] for c in retrieval.captions]
  assert len(set(firsts)) == 5
  assert all(c.startswith("photo 1 ") for c in firsts)
  assert retrieval.images.shape == (5, 16, 16, 3)
  # The explicit config/version names the same data; and nothing on this
  # path needed TensorFlow (TFDS's own coco_captions class would).
  explicit = _coco_config(tfds_dir, **{"data.name": "coco_captions/2017:1.1.0"})
  assert _same_batches(
      _take(D.make_train_iterator(explicit, batch_size=8, seed=0), 2),
      batches[:2])
  assert "tensorflow" not in sys.modules


def test_tfds_zeroshot_dataset(tfds_dir):
  config = _coco_config(tfds_dir, **{"data.zeroshot_name": "tiny_classification",
                                     "data.num_eval_examples": 0})
  D.check_data_config(config)
  zeroshot, retrieval = D.make_eval_sets(config, D.make_tokenizer(config))
  assert zeroshot.classnames == ["red thing", "blue thing"]
  assert zeroshot.templates and all("{}" in t for t in zeroshot.templates)
  assert sorted(zeroshot.labels.tolist()) == [0] * 5 + [1] * 5
  # Red images of class 0, blue of class 1: the pixels went through.
  for image, label in zip(zeroshot.images, zeroshot.labels):
    image = image.astype(np.float32) * (2 / 255) - 1
    assert (image[..., 2 * label] > 0.5).all()
    assert (image[..., 2 - 2 * label] < -0.9).all()
  assert len(retrieval.captions) == 12


# -------------------------------------------------------------------- errors

def _error(config):
  with pytest.raises(ValueError) as info:
    D.check_data_config(config)
  message = str(info.value)
  assert "\n" not in message  # one clear line
  return message


def test_config_errors(tmp_path, tfds_dir):
  assert "is not a TFDS dataset" in _error(
      _config(tmp_path, **{"data.name": "no_such_dataset"}))
  assert "is neither a TFDS dataset" in _error(
      _config(tmp_path / "missing", **{"data.name": "no_such_dataset"}))
  msg = _error(_config(tmp_path, **{"data.name": "coco_captions"}))
  assert "not prepared under data_dir" in msg and "tfds build coco_captions" in msg
  msg = _error(_config(tmp_path / "missing", **{"data.name": "coco_captions"}))
  assert "does not exist" in msg
  msg = _error(_coco_config(tfds_dir, **{"data.text_key": "captions/txt"}))
  assert "captions/txt" in msg and "'text'" in msg  # lists what exists
  msg = _error(_coco_config(tfds_dir, **{"data.image_key": "image/id"}))
  assert "is a Scalar, not an Image feature" in msg  # "image/id" is one key
  msg = _error(_coco_config(tfds_dir, **{"data.split": "validation"}))
  assert "split 'validation'" in msg and "val" in msg
  msg = _error(_coco_config(tfds_dir, **{"data.name": "coco_captions/2017:9.9.9"}))
  assert "9.9.9 not prepared" in msg
  msg = _error(_coco_config(tfds_dir, **{"data.name": "coco_captions/2014"}))
  assert "config '2014' is not prepared" in msg and "['2017']" in msg
  msg = _error(_coco_config(tfds_dir, **{"data.zeroshot_name": "nothing_here"}))
  assert "config.data.zeroshot_name='nothing_here'" in msg
  # A dataset prepared as tfrecord (needs TensorFlow to read): told to convert.
  tf_dir = tmp_path / "tfrecord_dir"
  shutil.copytree(tfds_dir / "coco_captions", tf_dir / "coco_captions")
  info = tf_dir / "coco_captions" / "2017" / "1.1.0" / "dataset_info.json"
  info.write_text(info.read_text().replace('"array_record"', '"tfrecord"'))
  msg = _error(_coco_config(tf_dir))
  assert "stored as tfrecord" in msg and "tfds convert_format" in msg
  config = _config(tmp_path)
  config.data.shuffle_bufer = 10
  assert "config.data.shuffle_bufer" in _error(config)
  assert "tokenizer.kind" in _error(_config(tmp_path, **{"tokenizer.kind": "words"}))
  assert "spm_path" in _error(_config(tmp_path, **{"tokenizer.kind": "sentencepiece"}))
  assert "image_size" in _error(_config(tmp_path, **{"data.image_size": 0}))
  assert "test split" in _error(_config(tmp_path, **{"data.num_eval_examples": 0}))
  msg = _error(_config(tmp_path, **{"data.split": "validation"}))
  assert "'train' and 'test'" in msg
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  assert "cannot create" in _error(_config(blocker / "sub"))
  D.check_data_config(_config(tmp_path))  # the defaults are valid
  D.check_data_config(_config(tmp_path / "not" / "yet" / "there"))
