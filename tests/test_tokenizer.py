"""Tokenizers against their reference libraries, and the shared contract
(pad 0 after the text, truncation to max_len - 1 tokens, EOS 1 always)."""
import json
import os

import numpy as np
import pytest
import tokenizers

from train.data import tokenizer as T

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "towers")
EXPECTED = json.load(open(os.path.join(FIX, "tokenizer_expected.json"),
                          encoding="utf-8"))


@pytest.mark.parametrize("where", ["clip_bpe", "clip_bpe_json",
                                   "clip_bpe_json/tokenizer.json"])
def test_clip_bpe_encodes_like_transformers_clip_tokenizer(where):
  """The ids of CLIPTokenizer (recorded by make_tower_fixtures.py) from
  vocab.json + merges.txt, a directory with tokenizer.json, or the file."""
  tok = T.ClipBpeTokenizer(os.path.join(FIX, where), max_len=20)
  ids = tok.encode(EXPECTED["texts"])
  assert ids.dtype == np.int32 and ids.shape == (len(EXPECTED["texts"]), 20)
  for row, ref in zip(ids, EXPECTED["ids"]):
    n = len(ref)  # CLIP: [<|startoftext|>, ..., <|endoftext|>]
    assert list(row[:n - 1] - 2) == ref[:-1]
    assert row[n - 1] == tok.eos_id == 1
    assert (row[n:] == tok.pad_id).all() and tok.pad_id == 0
  assert tok.vocab_size == len(json.load(open(
      os.path.join(FIX, "clip_bpe", "vocab.json")))) + 2


def test_clip_bpe_matches_the_tokenizers_library_on_fresh_text():
  ref = tokenizers.Tokenizer.from_file(
      os.path.join(FIX, "clip_bpe_json", "tokenizer.json"))
  ours = T.ClipBpeTokenizer(os.path.join(FIX, "clip_bpe"), max_len=64)
  rng = np.random.default_rng(0)
  words = ["cat", "Dog", "photo", "the", "naïve", "42", "!?", "a.b", "x's",
           "CAFÉ", "  ", "\t", "ünïcode"]
  texts = [" ".join(rng.choice(words, rng.integers(1, 9))) for _ in range(40)]
  for text, row in zip(texts, ours.encode(texts)):
    want = ref.encode(text).ids  # With its own start/end tokens.
    n = len(want)
    assert list(row[:n - 1] - 2) == want[:-1], text
    assert row[n - 1] == 1


def test_clip_bpe_truncation_padding_decode():
  tok = T.ClipBpeTokenizer(os.path.join(FIX, "clip_bpe"), max_len=5)
  ids = tok.encode(["a photo of a cat and a dog", "", "cat"])
  assert ids.shape == (3, 5)
  assert ids[0, 4] == 1 and (ids[0, :4] > 1).all()   # 4 tokens, then EOS.
  assert list(ids[1]) == [ids[0, 0], 1, 0, 0, 0]     # Start token, EOS.
  assert tok.decode(ids[2:]) == ["cat"]
  long = T.ClipBpeTokenizer(os.path.join(FIX, "clip_bpe"), max_len=32)
  assert long.decode(long.encode(["A Photo of TWO dogs!!"])) == [
      "a photo of two dogs !!"]


def test_clip_bpe_bad_paths(tmp_path):
  with pytest.raises(ValueError, match="expected a tokenizer.json"):
    T.ClipBpeTokenizer(str(tmp_path), 8)
  (tmp_path / "tokenizer.json").write_text("{broken")
  with pytest.raises(ValueError, match="not a readable CLIP BPE"):
    T.ClipBpeTokenizer(str(tmp_path), 8)
  with pytest.raises(ValueError, match="needs config.tokenizer.bpe_path"):
    T.check_tokenizer_config({"kind": "clip_bpe", "max_len": 8})


def test_sentencepiece_equals_the_sentencepiece_library(tmp_path):
  """A real model trained here; our ids are the library's + 2."""
  spm = pytest.importorskip("sentencepiece")  # the dev extra: CI has it
  rng = np.random.default_rng(1)
  vocab = ["red", "blue", "circle", "square", "small", "large", "a", "photo",
           "of", "the", "on", "left", "right", "top", "bottom"]
  lines = [" ".join(rng.choice(vocab, rng.integers(3, 10)))
           for _ in range(300)]
  (tmp_path / "c.txt").write_text("\n".join(lines))
  spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"),
                                 model_prefix=str(tmp_path / "m"),
                                 vocab_size=40, model_type="bpe",
                                 minloglevel=2)
  ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
  tok = T.SentencePieceTokenizer(str(tmp_path / "m.model"), max_len=12)
  fresh = [" ".join(rng.choice(vocab, rng.integers(1, 12))) for _ in range(30)]
  ids = tok.encode(fresh)
  for text, row in zip(fresh, ids):
    want = ref.encode(text)[:11]
    n = len(want)
    assert list(row[:n] - 2) == want
    assert row[n] == 1 and (row[n + 1:] == 0).all()
  short = [t for t, r in zip(fresh, ids) if len(ref.encode(t)) <= 11]
  assert tok.decode(tok.encode(short)) == short
