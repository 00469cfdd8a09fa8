"""Bad examples are counted once each, by reason, on real tar shards with
planted bad members: a corrupt JPEG, an HTML page saved as .jpg, an empty
caption and a caption without its image.

The stream meets the undecodable ones again every epoch; the counts stay
what was planted, from the images or from their precomputed embeddings,
resumed or not; the bad-fraction check starts at min(1000, corpus size).
"""
import json
import os
import sys

import pytest

from tests import lit_fixtures
from train import data as D
from train.data.ledger import TooMuchBadData

sys.path.insert(0, lit_fixtures.ROOT)

PLANTED = ("corrupt_jpeg", "not_a_jpeg", "empty_caption", "orphan")
WANT = {"undecodable image": 2, "empty caption": 1, "orphan member": 1}
NUM_GOOD = 28                       # 32 members' examples in 2 shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  return lit_fixtures.shards(tmp_path_factory.mktemp("bad"), "train",
                             num=NUM_GOOD, planted=PLANTED)


def _config(shards, **data):
  from configs import lit_pretrained  # pylint: disable=g-import-not-at-top
  c = lit_pretrained.get_config("user_small")
  c.model.image.init = lit_fixtures.checkpoint(lit_fixtures.os.path.dirname(
      shards.pattern))
  c.data.name = "webdataset:" + shards.pattern
  c.data.eval_split = ""
  c.data.max_bad_fraction = 0.5
  for k, v in data.items():
    c.data[k] = v
  return c


def _run(it, n):
  for _ in range(n):
    next(it)
  return it


# 3 epochs of the 28 good examples in micro-batches of 8.
EPOCHS_3 = -(-3 * NUM_GOOD // 8)


def test_planted_bad_members_are_counted_once_each_by_reason(shards):
  assert sorted(shards.bad.values()) == sorted(
      k for k, n in WANT.items() for _ in range(n))
  it = _run(D.make_train_iterator(_config(shards), batch_size=8, seed=0),
            EPOCHS_3)
  assert it.bad == len(PLANTED), it.ledger.by_reason
  assert dict(it.ledger.by_reason) == WANT
  assert it.seen == NUM_GOOD + len(PLANTED)  # Each example once.
  assert it.ledger.fraction == len(PLANTED) / (NUM_GOOD + len(PLANTED))


def test_a_resumed_stream_counts_the_same(shards):
  config = _config(shards)
  first = _run(D.make_train_iterator(config, batch_size=8, seed=0), 4)
  state = first.get_state()
  resumed = D.make_train_iterator(config, batch_size=8, seed=0)
  resumed.set_state(state)
  _run(resumed, EPOCHS_3 - 4)
  whole = _run(D.make_train_iterator(config, batch_size=8, seed=0), EPOCHS_3)
  assert resumed.ledger.state() == whole.ledger.state()
  assert resumed.bad == len(PLANTED)


def test_precomputed_embeddings_count_the_same(shards, tmp_path):
  """LiT precomputes the locked tower's embeddings (bad rows recorded
  there); training on them counts each bad example once too."""
  from train import model as model_lib  # pylint: disable=g-import-not-at-top
  from train import precompute  # pylint: disable=g-import-not-at-top
  config = _config(shards)
  tok = D.make_tokenizer(config)
  tower = model_lib.make_locked_tower(config, tok)
  out = precompute.precompute(config, str(tmp_path / "emb"), tower,
                              log=lambda *_: None)
  source = D.open_source(config.data.copy_and_resolve_references(),
                         config.data.split)
  emb = D.sources.open_source(_embeddings(config, out), "train")
  assert len(emb) == len(source)
  it = _run(D.make_train_iterator(config, batch_size=8, seed=0, source=emb),
            EPOCHS_3)
  assert it.bad == len(PLANTED) and dict(it.ledger.by_reason) == WANT
  # The iterator's state names the embeddings by their contents, not by
  # where they are: moved (a workdir moved), they resume; a state written
  # before, naming their old directory, resumes too; one naming other
  # embeddings that are still there does not.
  state = it.get_state()
  assert state["dataset"] == emb.stream_spec and str(tmp_path) not in str(
      state)
  moved = tmp_path / "moved" / "emb"
  moved.parent.mkdir()
  os.rename(out, moved)
  again = D.sources.open_source(_embeddings(config, str(moved)), "train")
  for saved in (state, dict(state, dataset="embeddings:" + out)):
    fresh = D.make_train_iterator(config, batch_size=8, seed=0, source=again)
    fresh.set_state(saved)
    assert fresh.bad == len(PLANTED)
  other = tmp_path / "other"
  other.mkdir()
  (other / "meta.json").write_text(json.dumps(
      dict(again.meta, fingerprint="another tower")))
  with pytest.raises(ValueError, match="does not match this input pipeline"):
    D.make_train_iterator(config, batch_size=8, seed=0, source=again
                          ).set_state(dict(state, dataset=f"embeddings:{other}"))


def _embeddings(config, out):
  data = config.data.copy_and_resolve_references()
  with data.unlocked():
    data.name = "embeddings:" + out
  return data


def test_the_check_starts_at_the_whole_of_a_small_corpus(shards):
  """12.5% bad > 10%: the run stops once the whole corpus (32 < 1000) has
  been seen, not before, with the start in its line; 20% lets it run."""
  corpus = NUM_GOOD + len(PLANTED)
  it = D.make_train_iterator(_config(shards, max_bad_fraction=0.1),
                             batch_size=8, seed=0)
  assert it.ledger.min_seen == corpus
  with pytest.raises(TooMuchBadData, match=(
      rf"^4 of {corpus} examples of the training data were bad \(12.50% > "
      rf"config.data.max_bad_fraction=0.1; checked from min\(1000, corpus "
      rf"size\) = {corpus} examples seen on\)")):
    _run(it, EPOCHS_3)
  _run(D.make_train_iterator(_config(shards, max_bad_fraction=0.2),
                             batch_size=8, seed=0), EPOCHS_3)


def test_a_caption_that_is_not_utf8_is_bad_not_trained_on(tmp_path):
  """A .txt in another encoding (latin-1, cp1252) is a bad example named
  with its shard:key, in a webdataset shard and in a table, never decoded
  with replacement characters."""
  import io  # pylint: disable=g-import-not-at-top
  import tarfile  # pylint: disable=g-import-not-at-top
  from tests import corpus as corpus_lib  # pylint: disable=g-import-not-at-top
  sh = lit_fixtures.shards(tmp_path / "s", "u", num=12, per_shard=16)
  path = sh.pattern
  with tarfile.open(path) as src:
    members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
  bad_text = "a photo of a café ring".encode("latin-1")
  with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
    for m, data in members:
      if m.name == "000004.txt":
        data = bad_text
      m.size = len(data)
      tar.addfile(m, io.BytesIO(data))
  config = corpus_lib.data_config("webdataset:" + path)
  source = D.open_source(config.data, "train")
  it = _run(D.make_train_iterator(config, batch_size=4, seed=0), 6)
  assert dict(it.ledger.by_reason) == {"caption is not valid UTF-8": 1}
  assert it.ledger.state()["counted"] == ["u-000000.tar:000004"]
  with pytest.raises(D.sources.contract.BadExample,
                     match=r"u-000000.tar:000004: "
                     r"caption is not valid UTF-8 \(byte 0xe9 at 16\)"):
    source[source.keys.index("u-000000.tar:000004")]
  # A CSV row with such a caption: bad at open, named by file:line.
  table = tmp_path / "t.csv"
  (tmp_path / "img.jpg").write_bytes(members[0][1])
  table.write_bytes(b"image,caption\nimg.jpg,a photo\nimg.jpg," + bad_text
                    + b"\nimg.jpg," + "a café".encode() + b"\n")
  rows = D.open_source(corpus_lib.data_config(
      f"csv:{table}", table_label_column="").data, "train")
  assert rows.bad_at_open == [("t.csv:3", "caption is not valid UTF-8 (byte "
                               "0xe9 at character 16) (column 'caption')")]
  assert [rows[i]["captions"] for i in range(len(rows))] == [
      ["a photo"], ["a café"]]
