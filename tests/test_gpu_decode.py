"""The batch-decoder path (config.data.decoder = "gpu") and its host twin.

CPU tests run the GPU path's logic (train/data/decode.py: micro-batches of
encoded images decoded in one call, topped up past the ones that fail, on
a prefetch thread, resumable) with the GPU call swapped for the host
decoder, against the host path on the same corpus (tests/corpus.py: a
truncated JPEG, empty captions, orphans, a cut shard). The ``gpu`` tests
run nvImageCodec itself on the device (pixels against the host path within
a measured bound, every kind of bad member, resume).
"""
import hashlib
import io
import json

import ml_collections
import numpy as np
import pytest
from PIL import Image

from tests import corpus as corpus_lib
from train import data as D
from train.data import decode
from train.data import pipeline
from train.data.source import BadExample
from train.data.source import TooMuchBadData

S = corpus_lib.IMAGE_SIZE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return corpus_lib.make_corpus(tmp_path_factory.mktemp("corpus"))


def _config(name, **data):
  config = ml_collections.ConfigDict()
  config.data = D.default_data_config()
  config.tokenizer = D.default_tokenizer_config()
  config.data.name = name
  config.data.eval_split = ""
  config.data.image_size = S
  config.data.max_bad_fraction = 0.5
  config.data.wds_label_field = "label"
  config.data.table_label_column = "label"
  for k, v in data.items():
    config.data[k] = v
  return config


def _jpeg(image, **kw):
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format="JPEG", **kw)
  return buf.getvalue()


def _digest(image):
  return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


def _take(it, n):
  return [next(it) for _ in range(n)]


def _flat(batches):
  """(image digest, tokens, label) per example, in stream order."""
  return [(_digest(np.asarray(b["image"][i])), b["text"][i].tobytes(),
           int(b["label"][i])) for b in batches for i in range(len(b["text"]))]


def _same(a, b):
  return all(set(x) == set(y) and all(np.array_equal(np.asarray(x[k]),
                                                     np.asarray(y[k]))
                                      for k in x)
             for x, y in zip(a, b, strict=True))


def _images(seed=0):
  """JPEGs of the kinds a web corpus holds: baseline 4:2:0, 4:4:4,
  progressive, grayscale, non-square, and one large enough for the draft
  (DCT-scaled) decode at the sizes used here."""
  rng = np.random.default_rng(seed)
  smooth = lambda h, w: np.asarray(Image.fromarray(rng.integers(
      0, 255, (6, 6, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC))
  return [_jpeg(smooth(64, 64), quality=90),
          _jpeg(smooth(48, 80), quality=75, subsampling=0),
          _jpeg(smooth(70, 50), quality=85, progressive=True),
          _jpeg(rng.integers(0, 255, (40, 60), dtype=np.uint8)),
          _jpeg(smooth(300, 420), quality=80)]


# ------------------------------------------------------------ the JPEG check

def test_every_cut_of_a_jpeg_is_found_and_whole_ones_pass():
  for data in _images():
    assert decode.jpeg_problem(data) == ""
    assert decode.jpeg_problem(data + b"trailing bytes") == ""
    for cut in range(2, len(data) - 1):  # the last byte of EOI included
      problem = decode.jpeg_problem(data[:cut])
      assert problem.startswith(("truncated JPEG", "corrupt JPEG")), cut
  assert decode.jpeg_problem(b"<html>not found</html>") == ""  # not a JPEG
  assert decode.jpeg_problem(b"\xff\xd8garbage").startswith("corrupt JPEG")


def test_host_decoders_agree_bitwise_with_pillow_and_name_bad_images():
  pytest.importorskip("simplejpeg")
  for data in _images():
    for size in (0, 16, 40, 64):
      fast = decode.decode_host(data, "k", size, library="simplejpeg")
      slow = decode.decode_host(data, "k", size, library="pillow")
      assert fast.shape == slow.shape and np.array_equal(fast, slow), size
  png = io.BytesIO()
  Image.fromarray(np.zeros((5, 7, 3), np.uint8)).save(png, format="PNG")
  assert decode.decode_host(png.getvalue(), "k").shape == (5, 7, 3)
  whole = _images()[0]
  for data, fragment in ((whole[:len(whole) // 3], "truncated JPEG"),
                         (whole[:-2], "no end-of-image marker"),
                         (b"<html>404</html>", "not an image"),
                         (b"", "not an image")):
    with pytest.raises(BadExample, match=fragment) as e:
      decode.decode_host(data, "shard.tar:0042", 16)
    assert e.value.where == "shard.tar:0042"
    assert e.value.reason.startswith("undecodable image")


def test_device_resize_crop_is_the_hosts_within_one_level():
  # The GPU decoder's resize/crop (jax, here on the CPU) against the host's
  # pipeline.resize_crop on the same pixels, at sizes where Pillow resizes
  # in one step (shrinking by less than 4x: past that Pillow box-reduces
  # first, its reducing_gap, and the two differ by a few levels).
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from train.data import gpu_decode  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  cases = [(16, 16, 16), (24, 16, 16), (16, 30, 16), (50, 70, 40),
           (60, 33, 32), (256, 256, 224), (256, 340, 224), (300, 256, 224)]
  for h, w, size in cases:
    low = rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)
    im = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC))
    im = np.clip(im + rng.normal(0, 10, im.shape), 0, 255).astype(np.uint8)
    dev = np.asarray(gpu_decode.resize_crop_device(jnp.asarray(im[None]),
                                                   size))[0]
    host = pipeline.resize_crop(im, size)
    assert dev.shape == host.shape == (size, size, 3)
    d = np.abs(dev.astype(np.int16) - host)
    assert d.max() <= 1 and (d > 0).mean() <= 0.005, (h, w, size)


# ----------------------------------------- the batch path, on the host decoder

class _Failing(decode.HostBatchDecoder):
  """The host decoder, failing the images whose decoded pixels are in
  ``digests`` (as a GPU decode can fail where the host's succeeds), and
  recording the batch sizes it was called with."""

  def __init__(self, digests=()):
    super().__init__()
    self.digests, self.calls = set(digests), []

  def decode(self, encoded, wheres, size):
    self.calls.append(len(encoded))
    images, ok, bad = super().decode(encoded, wheres, size)
    keep, out = [], []
    for j, i in enumerate(np.flatnonzero(ok)):
      if _digest(images[j]) in self.digests:
        ok[i] = False
        bad.append((int(i), wheres[i], "undecodable image (device: failed)"))
      else:
        keep.append(images[j])
    bad.sort()
    out = np.stack(keep) if keep else images[:0]
    return out, ok, bad


@pytest.mark.parametrize("fmt", ["webdataset", "csv"])
def test_batch_path_gives_the_host_stream_and_counts(corpus, fmt):
  name = ("webdataset:" + corpus.pattern if fmt == "webdataset"
          else "csv:" + corpus.tables["csv"])
  config = _config(name)
  host = D.make_train_iterator(config, batch_size=24, seed=3,
                               microbatch_size=8)
  dec = _Failing()
  batch = D.make_train_iterator(config, batch_size=24, seed=3,
                                microbatch_size=8, batch_decoder=dec)
  assert isinstance(batch, decode.Prefetch)
  a, b = _take(host, 12), _take(batch, 12)  # 96 > an epoch's 58 or 61
  assert _same(a, b)
  assert all(x["image"].dtype == np.uint8 and x["image"].shape == (8, S, S, 3)
             for x in b)
  assert batch.bad == host.bad and batch.seen == host.seen and host.bad > 0
  assert batch.ledger.by_reason == host.ledger.by_reason
  # Taken between micro-batches, the two states are the same: a run can
  # resume on the other decoder.
  assert batch.get_state() == host.get_state()
  assert set(dec.calls) == {8}  # the host found every bad one: no top-ups
  batch.close()


def test_a_failed_decode_costs_only_itself_and_keeps_the_order(corpus, caplog):
  config = _config("webdataset:" + corpus.pattern)
  whole = _flat(_take(D.make_train_iterator(
      config, batch_size=8, seed=1, batch_decoder=_Failing()), 20))
  # Fail three distinct images, each wherever it falls in the stream.
  fail = {whole[i][0] for i in (0, 9, 17)}
  dec = _Failing(fail)
  caplog.clear()
  with caplog.at_level("WARNING"):
    it = D.make_train_iterator(config, batch_size=8, seed=1,
                               batch_decoder=dec)
    got = _take(it, 15)
  assert all(len(b["text"]) == 8 for b in got)
  kept = [e for e in whole if e[0] not in fail]
  assert _flat(got) == kept[:120]
  # Every failure in the span taken is counted once and logged once (with
  # its shard and key), beside the source's own bad examples.
  failed = sum(e[0] in fail for e in whole[:whole.index(kept[119]) + 1])
  logged = [r.getMessage() for r in caplog.records
            if "skipped a bad example" in r.getMessage()]
  assert failed >= 3
  assert sum("device: failed" in m for m in logged) == failed
  assert all(".tar:" in m for m in logged)
  assert it.bad == len(logged) < it.ledger.log_first
  assert max(dec.calls) == 8 and min(dec.calls) < 8  # top-ups after failures
  it.close()


def test_batch_path_resumes_bitwise_from_a_json_state(corpus):
  config = _config("webdataset:" + corpus.pattern)
  fail = set()
  probe = _flat(_take(D.make_train_iterator(
      config, batch_size=8, seed=2, batch_decoder=_Failing()), 4))
  fail = {probe[5][0]}
  for k in (0, 3, 7):
    it = D.make_train_iterator(config, batch_size=8, seed=2,
                               batch_decoder=_Failing(fail))
    _take(it, k)
    state = json.loads(json.dumps(it.get_state()))
    expected, bad_then = _take(it, 6), None
    bad_then = it.bad
    it.close()
    resumed = D.make_train_iterator(config, batch_size=8, seed=2,
                                    batch_decoder=_Failing(fail))
    resumed.set_state(state)
    assert _same(expected, _take(resumed, 6)), k
    assert resumed.bad == bad_then
    resumed.close()


def test_too_much_bad_data_stops_the_batch_path(corpus):
  config = _config("webdataset:" + corpus.pattern, max_bad_fraction=0.05)
  it = D.make_train_iterator(config, batch_size=8, seed=0,
                             batch_decoder=_Failing())
  with pytest.raises(TooMuchBadData, match="config.data.max_bad_fraction"):
    _take(it, 20)


def test_decoder_config_errors_are_one_line(corpus):
  config = _config("webdataset:" + corpus.pattern, decoder="cpu")
  with pytest.raises(ValueError, match=r"config.data.decoder='cpu' must be "
                     "one of host, gpu, auto"):
    D.check_data_config(config)
  why = decode.gpu_unavailable()
  if why:  # This machine: no extra or no GPU.
    config = _config("webdataset:" + corpus.pattern, decoder="gpu")
    with pytest.raises(ValueError) as e:
      D.check_data_config(config)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "config.data.decoder='gpu' cannot run: ")
    assert "gpu-decode" in msg or "CUDA GPU" in msg
    with pytest.raises(ValueError, match="cannot run"):
      D.make_train_iterator(config, batch_size=8)
    # "auto" falls back to the host path.
    config.data.decoder = "auto"
    it = D.make_train_iterator(config, batch_size=8)
    assert isinstance(it, pipeline.TrainIterator)
  # A source of decoded images: "gpu" is refused in one line, "auto" and
  # "host" decode on the host.
  class Decoded:
    spec, bad_at_open = "decoded:0", []
  config = _config("webdataset:" + corpus.pattern, decoder="gpu")
  if not why:
    with pytest.raises(ValueError, match=r"decoded:0 delivers decoded ones"):
      decode.make_batch_decoder(config.data, Decoded())
  config.data.decoder = "auto"
  assert decode.make_batch_decoder(config.data, Decoded()) is None


# ------------------------------------------------------------------- GPU

GPU_WHY = decode.gpu_unavailable()
# Measured on an H200 (nvImageCodec 0.9.0.20 with nvJPEG 13.2, fancy
# upsampling, 256 px JPEGs at quality 90): the GPU's pixels against the
# host path's (libjpeg-turbo): max |diff| 1 level and 0.01% of the pixels
# at 256 px (decode only), max 2 and 0.2% (mean 0.002) after the resize to
# 224. The bound: that max, a mean of 0.01.
PIXEL_MAX, PIXEL_MEAN = 2, 0.01


def _pool(n=256, size=256):
  from train.data import synthetic  # pylint: disable=import-outside-toplevel
  pool = synthetic.JpegPool(n, size=size, pool=n)
  return [pool[i]["image"] for i in range(n)]


def _gpu_vs_host(jpgs, size, **kw):
  from train.data import gpu_decode  # pylint: disable=import-outside-toplevel
  where = [f"k{i}" for i in range(len(jpgs))]
  g, gok, gbad = gpu_decode.GpuBatchDecoder(**kw).decode(jpgs, where, size)
  h, hok, hbad = decode.HostBatchDecoder().decode(jpgs, where, size)
  assert np.array_equal(gok, hok) and [b[:2] for b in gbad] == [
      b[:2] for b in hbad]
  assert g.dtype == np.uint8 and g.shape == h.shape
  return np.abs(np.asarray(g).astype(np.int16) - h)


@pytest.mark.gpu
@pytest.mark.skipif(bool(GPU_WHY), reason=f"GPU decoder: {GPU_WHY}")
class TestGpuDecoder:

  def test_gpu_pixels_are_the_host_paths_within_the_measured_bound(self):
    jpgs = _pool()
    for size in (256, 224):  # decode_size=256 (no resize), and 256 -> 224
      # ("cuda", nvJPEG's CUDA-only backend, cannot be created by this
      # build here: "Could not create decoder. Code: 7".)
      for backend in ("auto", "hw"):
        d = _gpu_vs_host(jpgs, size, backend=backend)
        print(f"256 px JPEGs -> {size}, backend {backend}: max |diff| "
              f"{d.max()}, mean {d.mean():.4f}, pixels differing "
              f"{(d > 0).mean():.4f}")
        assert d.max() <= PIXEL_MAX and d.mean() <= PIXEL_MEAN
    # The kinds of JPEG of _images (4:4:4, progressive, grayscale,
    # non-square; one the host decodes at a DCT scale, and downscales past
    # Pillow's reducing gap): reported, with a loose sanity bound, not a
    # measured one (the host's draft decode and box reduction are not the
    # GPU's full decode and antialiased resize).
    for size in (16, 40):
      d = _gpu_vs_host(_images(), size)
      print(f"mixed JPEGs -> {size}: max |diff| {d.max()}, mean "
            f"{d.mean():.4f}")
      assert d.mean() <= 4

  def test_gpu_path_gives_the_host_stream_with_every_kind_of_bad_member(
      self, corpus, tmp_path):
    import tarfile  # pylint: disable=import-outside-toplevel
    # Beside the corpus's (a JPEG cut to a third, empty and blank captions,
    # orphans, a cut shard): a file that is no image, a JPEG whose header
    # is garbage, a JPEG cut just before its end marker, and a PNG (the
    # host decodes it; the GPU answers None and hands it back).
    good = _images()[0]
    png = io.BytesIO()
    Image.fromarray(np.full((20, 24, 3), 90, np.uint8)).save(png, "PNG")
    extra = {"html": b"<html>404</html>", "hdr": b"\xff\xd8\xff\xe0garbage",
             "noeoi": good[:-2], "png": png.getvalue(), "fine": good}
    path = tmp_path / "extra-000.tar"
    with tarfile.open(path, "w") as tar:
      for key, data in extra.items():
        for ext, blob in (("jpg", data), ("txt", f"a {key}".encode()),
                          ("json", b'{"label": 1}')):
          info = tarfile.TarInfo(f"{key}.{ext}")
          info.size = len(blob)
          tar.addfile(info, io.BytesIO(blob))
    name = "webdataset:" + corpus.pattern + "::" + str(path)
    host = D.make_train_iterator(_config(name), batch_size=8, seed=5)
    gpu = D.make_train_iterator(_config(name, decoder="gpu"), batch_size=8,
                                seed=5)
    assert isinstance(gpu, decode.Prefetch)
    a, b = _take(host, 12), _take(gpu, 12)
    for x, y in zip(a, b):
      assert np.array_equal(x["text"], y["text"])
      assert np.array_equal(x["label"], y["label"])
      d = np.abs(np.asarray(y["image"]).astype(np.int16) - x["image"])
      assert d.mean() <= 4, d.mean()
    assert gpu.bad == host.bad and gpu.seen == host.seen
    assert gpu.ledger.by_reason == host.ledger.by_reason
    assert gpu.get_state() == host.get_state()
    gpu.close()

  def test_gpu_path_resumes_bitwise(self, corpus):
    config = _config("webdataset:" + corpus.pattern, decoder="gpu")
    it = D.make_train_iterator(config, batch_size=8, seed=2)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    expected, bad_then = _take(it, 6), it.bad
    it.close()
    resumed = D.make_train_iterator(config, batch_size=8, seed=2)
    resumed.set_state(state)
    assert _same(expected, _take(resumed, 6))
    assert resumed.bad == bad_then
    resumed.close()

  def test_step_one_loss_is_the_host_paths_within_bf16(self, tmp_path):
    host = _step_one_loss(tmp_path / "host", "host")
    gpu = _step_one_loss(tmp_path / "gpu", "gpu")
    print(f"step-1 loss: host {host!r}, gpu {gpu!r}")
    assert abs(gpu - host) <= 2**-8 * abs(host)


def _step_one_loss(tmp_path, decoder):
  """The trainer end to end (the tiny LiT demo, the locked tower streamed
  per micro-batch of 8) for one step on the corpus: its loss."""
  from tests import test_stream  # pylint: disable=import-outside-toplevel
  from train import train as train_lib  # pylint: disable=import-outside-toplevel
  train = corpus_lib.make_corpus(tmp_path / "c", num=96)
  config = test_stream._tiny(  # pylint: disable=protected-access
      "webdataset:" + train.pattern, "", tmp_path / "tfds",
      precompute_image_embeddings=False, microbatch_size=8, total_steps=1)
  config.data.decoder = decoder
  train_lib.train_and_evaluate(config, str(tmp_path / "w"))
  rows = [r for r in test_stream._rows(tmp_path / "w") if "loss" in r]  # pylint: disable=protected-access
  return rows[0]["loss"]


@pytest.mark.slow
def test_the_trainer_runs_the_batch_path_to_the_host_paths_loss(
    tmp_path, monkeypatch):
  # The GPU call swapped for the host decoder: the trainer takes the batch
  # path's Prefetch iterator (state, ledger) and gets the same loss, bitwise.
  host = _step_one_loss(tmp_path / "host", "host")
  monkeypatch.setattr(decode, "gpu_unavailable", lambda: "")
  import train.data.gpu_decode as gpu_decode  # pylint: disable=import-outside-toplevel
  calls = []

  class Counted(decode.HostBatchDecoder):
    def decode(self, encoded, wheres, size):
      calls.append(len(encoded))
      return super().decode(encoded, wheres, size)
  monkeypatch.setattr(gpu_decode, "GpuBatchDecoder", Counted)
  batch = _step_one_loss(tmp_path / "batch", "gpu")
  assert calls and set(calls) == {8}
  assert batch == host


def test_prefetch_closed_midway_continues_where_the_consumer_was(corpus):
  # The thread runs ahead; closing (as set_state and a checkpoint restore
  # do) must not lose or repeat the micro-batches it held.
  config = _config("webdataset:" + corpus.pattern)
  whole = _take(D.make_train_iterator(config, batch_size=8, seed=4,
                                      batch_decoder=_Failing()), 9)
  it = D.make_train_iterator(config, batch_size=8, seed=4,
                             batch_decoder=_Failing())
  got = _take(it, 3)
  it.close()
  got += _take(it, 3)
  it.close()
  got += _take(it, 3)
  assert _same(whole, got)
  it.close()
