"""Sources beside TFDS: webdataset shards and CSV/TSV/JSONL tables.

A synthetic corpus (tests/corpus.py) with a corrupt JPEG, empty captions,
members without their pair and a truncated final shard: the bad examples are
skipped, counted and named; the good ones all arrive, once per epoch, with
their own captions; streams are deterministic, shard across processes and
resume bitwise; a missing shard or table fails at start-up in one line; and
the on-device normalisation of uint8 equals the host float path.
"""
import hashlib
import io
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from tests import corpus as corpus_lib
from train import data as D
from train.data.decode import host as host_lib
from train.data.ledger import TooMuchBadData
from train.towers import tower as tower_lib

S = corpus_lib.IMAGE_SIZE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return corpus_lib.make_corpus(tmp_path_factory.mktemp("corpus"))


_config = corpus_lib.data_config


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same(a, b):
  return all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
             for x, y in zip(a, b, strict=True))


def _pixels(jpg):
  return host_lib.resize_crop(np.asarray(Image.open(io.BytesIO(jpg)).convert(
      "RGB")), S)


def _digest(image):
  return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


def test_webdataset_skips_counts_and_names_bad_data(corpus, caplog):
  config = _config("webdataset:" + corpus.pattern)
  D.check_data_config(config)
  source = D.open_source(config.data, "train")
  # Found while indexing: the orphans, the empty caption member and the cut.
  found = {w: r for w, r in source.bad_at_open}
  for where, reason in corpus.wds_bad.items():
    if reason in ("orphan member", "truncated shard"):
      assert reason in found[where], (where, found)
  n_good = len(corpus.good)
  with caplog.at_level(logging.WARNING):
    it = D.make_train_iterator(config, batch_size=n_good, seed=0)
    epoch = next(it)
  # Every good example exactly once in an epoch, with its caption and label;
  # none of the bad.
  tok = D.make_tokenizer(config)
  want = {_digest(_pixels(jpg)): (tok.decode(tok.encode([cap]))[0], label)
          for jpg, cap, label in corpus.good.values()}
  got = {}
  for image, text, label in zip(epoch["image"], tok.decode(epoch["text"]),
                                epoch["label"]):
    got[_digest(image)] = (text, int(label))
  assert got == want
  assert epoch["image"].dtype == np.uint8
  # Counted: every bad example (the blank caption and the corrupt JPEG are
  # found when read), named by shard and key in the log.
  assert it.bad == len(corpus.wds_bad), (it.bad, it.ledger.by_reason)
  for where, reason in corpus.wds_bad.items():
    assert any(where in r.getMessage() and reason in r.getMessage()
               for r in caplog.records), (where, reason)
  state = it.get_state()["bad_data"]
  assert state["bad"] == len(corpus.wds_bad)
  assert state["seen"] >= n_good + len(corpus.wds_bad)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_tables_read_the_same_examples(corpus, fmt, caplog):
  prefix = "csv" if fmt != "jsonl" else "jsonl"
  config = _config(f"{prefix}:{corpus.tables[fmt]}")
  D.check_data_config(config)
  with caplog.at_level(logging.WARNING):
    source = D.open_source(config.data, "train")
    it = D.make_train_iterator(config, batch_size=1, seed=1)
    images = []
    while it.get_state()["next_position"] < len(source):  # One epoch...
      images.append(next(it)["image"][0])
    # ... of 61 good rows (64 - 3 bad), and perhaps the next epoch's first.
    images = images[:61]
  bad = corpus.table_bad
  # The empty caption is found while reading the table, the missing and the
  # corrupt image files when their rows are reached.
  line = bad["empty"] + (1 if fmt == "jsonl" else 2)  # CSV: a header row
  assert [w for w, _ in source.bad_at_open] == [f"train.{fmt}:{line}"]
  named = {r.getMessage().split(": ")[1] for r in caplog.records
           if "skipped a bad example" in r.getMessage()}
  assert len(named) == 3, named
  assert it.bad >= 3, it.ledger.by_reason
  messages = " | ".join(r.getMessage() for r in caplog.records)
  assert "cannot read image" in messages and "undecodable image" in messages
  # The same pixels as the webdataset's good examples (plus the rows that
  # are bad only there), each once.
  digests = [_digest(im) for im in images]
  assert len(set(digests)) == 61
  wds = {_digest(_pixels(jpg)) for jpg, _, _ in corpus.good.values()}
  assert wds <= set(digests)


def test_streams_are_deterministic_sharded_and_resume_bitwise(corpus):
  config = _config("webdataset:" + corpus.pattern)
  n = len(corpus.good)
  a = _take(D.make_train_iterator(config, batch_size=24, seed=3,
                                  microbatch_size=8), 10)
  b = _take(D.make_train_iterator(config, batch_size=24, seed=3,
                                  microbatch_size=8), 10)
  c = _take(D.make_train_iterator(config, batch_size=24, seed=4,
                                  microbatch_size=8), 10)
  assert _same(a, b) and not _same(a, c)
  # Threads and the in-memory cache change nothing.
  d = _take(D.make_train_iterator(
      _config("webdataset:" + corpus.pattern, num_threads=1, cache_max_mb=0),
      batch_size=24, seed=3, microbatch_size=8), 10)
  assert _same(a, d)
  # Resume after k micro-batches (across the bad examples and an epoch end:
  # 10 x 8 > n), from a JSON round trip as in a checkpoint.
  for k in (0, 5, 9):
    it = D.make_train_iterator(config, batch_size=24, seed=3, microbatch_size=8)
    _take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 6)
    bad_then = it.bad
    resumed = D.make_train_iterator(config, batch_size=24, seed=3,
                                    microbatch_size=8)
    resumed.set_state(state)
    assert _same(expected, _take(resumed, 6)), k
    assert resumed.bad == bad_then
  # Two processes: disjoint shards that together hold every good example.
  shards = []
  for p in range(2):
    it = D.make_train_iterator(config, batch_size=8, seed=0, process_index=p,
                               process_count=2)
    imgs = np.concatenate([next(it)["image"] for _ in range(n // 2 // 8)])
    shards.append({_digest(x) for x in imgs})
  assert not shards[0] & shards[1]
  assert len(shards[0] | shards[1]) == 8 * 2 * (n // 2 // 8)


def test_too_much_bad_data_stops_with_a_clear_error(corpus):
  config = _config("webdataset:" + corpus.pattern, max_bad_fraction=0.05)
  with pytest.raises(TooMuchBadData, match=r"examples of the training data "
                     r"were bad \(.*% > config.data.max_bad_fraction=0.05; "
                     r"checked from min\(1000, corpus size\) = 62 examples "
                     r"seen on\)"):
    it = D.make_train_iterator(config, batch_size=8, seed=0)
    _take(it, 20)


def test_missing_and_unreadable_files_fail_at_startup(corpus, tmp_path):
  missing = corpus.pattern.replace("{000..003}", "{000..004}")
  with pytest.raises(ValueError, match=r"^config.data.name: shard '.*"
                     r"train-004.tar' does not exist \(1 of the 5 shards in "
                     r"the pattern is missing\)$") as e:
    D.check_data_config(_config("webdataset:" + missing))
  assert "\n" not in str(e.value)
  # The count is of the missing ones (the first named).
  with pytest.raises(ValueError, match=r"train-004.tar' does not exist \(3 "
                     r"of the 7 shards in the pattern are missing\)$"):
    D.check_data_config(_config("webdataset:" + corpus.pattern.replace(
        "{000..003}", "{000..006}")))
  not_tar = tmp_path / "x-0.tar"
  not_tar.write_bytes(b"not a tar file" * 100)
  with pytest.raises(ValueError, match="is not a readable tar file"):
    D.open_source(_config(f"webdataset:{not_tar}").data, "train")
  with pytest.raises(ValueError, match=r"table '.*nope.csv' does not exist"):
    D.check_data_config(_config(f"csv:{tmp_path}/nope.csv"))
  with pytest.raises(ValueError, match="has no column 'picture'"):
    D.open_source(_config(f"csv:{corpus.tables['csv']}",
                          table_image_column="picture").data, "train")
  with pytest.raises(ValueError, match="no named splits"):
    D.open_source(_config("webdataset:" + corpus.pattern).data, "test")
  with pytest.raises(ValueError, match="max_bad_fraction"):
    D.check_data_config(_config("webdataset:" + corpus.pattern,
                                max_bad_fraction=2.0))


def test_uint8_normalised_on_device_equals_the_host_float_path():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (5, 7, 9, 3), dtype=np.uint8)
  images[0, 0, 0] = (0, 128, 255)
  host = host_lib.to_float(images)
  device = np.asarray(jax.jit(tower_lib.SYMMETRIC)(images))
  np.testing.assert_array_equal(device, host)  # bitwise
  assert host.min() == -1.0 and host.max() == 1.0
  # An ImageNet-style mean/std: bitwise as on the host, and against float64.
  norm = tower_lib.Normalization((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
  np.testing.assert_array_equal(np.asarray(jax.jit(norm)(images)),
                                norm.numpy(images))
  want = (images / 255.0 - np.array(norm.mean)) / np.array(norm.std)
  np.testing.assert_allclose(np.asarray(jax.jit(norm)(images)), want,
                             rtol=1e-6, atol=1e-6)
  # Cast to the compute dtype on the device.
  assert tower_lib.SYMMETRIC(images, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.slow
def test_worker_processes_give_the_same_stream(corpus):
  """grain worker processes (config.data.num_workers) and reader threads
  give the same micro-batches, bad examples included, and resume alike."""
  base = _config("webdataset:" + corpus.pattern, cache_max_mb=0)
  procs = _config("webdataset:" + corpus.pattern, cache_max_mb=0,
                  num_workers=2, num_threads=1)
  a = D.make_train_iterator(base, batch_size=24, seed=3, microbatch_size=8)
  want = _take(a, 12)
  b = D.make_train_iterator(procs, batch_size=24, seed=3, microbatch_size=8)
  try:
    got = _take(b, 7)
    state = b.get_state()
    assert _same(want[:7], got) and b.bad == _take_bad(a, base, 7)
    b.set_state(state)
    assert _same(want[7:], _take(b, 5))
  finally:
    b.close()


def _take_bad(_, config, k):
  it = D.make_train_iterator(config, batch_size=24, seed=3, microbatch_size=8)
  _take(it, k)
  return it.bad
