"""The batch-decoder path (config.data.decoder = "gpu") and its host twin.

CPU tests run the GPU path's logic (train/data/batching.py: micro-batches of
encoded images decoded in one call, topped up past the ones that fail, on
a prefetch thread, resumable) with the GPU call swapped for the host
decoder, against the host path on the same corpus (tests/corpus.py: a
truncated JPEG, empty captions, orphans, a cut shard). The ``gpu`` tests
run nvImageCodec itself on the device (pixels against the host path within
a measured bound, every kind of bad member, resume).
"""
import collections
import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from tests import corpus as corpus_lib
from train import data as D
from train.data import batching
from tests import host_decoder
from train.data.decode import choice
from train.data.decode import host as host_lib
from train.data import pipeline
from train.data import stopwatch
from train.data.sources.contract import BadExample
from train.data.ledger import TooMuchBadData

S = corpus_lib.IMAGE_SIZE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return corpus_lib.make_corpus(tmp_path_factory.mktemp("corpus"))


_config = corpus_lib.data_config


def _jpeg(image, **kw):
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format="JPEG", **kw)
  return buf.getvalue()


def _digest(image):
  return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


def _take(it, n):
  return [next(it) for _ in range(n)]


def _take_and_close(it, n):
  """The first ``n`` micro-batches of a fresh iterator, which is closed (a
  batch path's decode threads would outlive the test)."""
  try:
    return _take(it, n)
  finally:
    it.close()


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
    assert host_lib.jpeg_problem(data) == ""
    assert host_lib.jpeg_problem(data + b"trailing bytes") == ""
    for cut in range(2, len(data) - 1):  # the last byte of EOI included
      problem = host_lib.jpeg_problem(data[:cut])
      assert problem.startswith(("truncated JPEG", "corrupt JPEG")), cut
  assert host_lib.jpeg_problem(b"<html>not found</html>") == ""  # not a JPEG
  assert host_lib.jpeg_problem(b"\xff\xd8garbage").startswith("corrupt JPEG")


def test_host_decoders_agree_bitwise_with_pillow_and_name_bad_images():
  pytest.importorskip("simplejpeg")
  for data in _images():
    for size in (0, 16, 40, 64):
      fast = host_lib.decode_host(data, "k", size, library="simplejpeg")
      slow = host_lib.decode_host(data, "k", size, library="pillow")
      assert fast.shape == slow.shape and np.array_equal(fast, slow), size
  png = io.BytesIO()
  Image.fromarray(np.zeros((5, 7, 3), np.uint8)).save(png, format="PNG")
  assert host_lib.decode_host(png.getvalue(), "k").shape == (5, 7, 3)
  whole = _images()[0]
  for data, fragment in ((whole[:len(whole) // 3], "truncated JPEG"),
                         (whole[:-2], "no end-of-image marker"),
                         (b"<html>404</html>", "not an image"),
                         (b"", "not an image")):
    with pytest.raises(BadExample, match=fragment) as e:
      host_lib.decode_host(data, "shard.tar:0042", 16)
    assert e.value.where == "shard.tar:0042"
    assert e.value.reason.startswith("undecodable image")


def test_device_resize_crop_is_the_hosts_within_one_level():
  # The GPU decoder's resize/crop (jax, here on the CPU) against the host's
  # host.resize_crop on the same pixels (more shapes, the reducing gap
  # and the executables' bound: tests/test_gpu_decode_resize.py).
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  cases = [(16, 16, 16), (24, 16, 16), (16, 30, 16), (50, 70, 40),
           (60, 33, 32), (256, 256, 224), (256, 340, 224), (300, 256, 224)]
  for h, w, size in cases:
    low = rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)
    im = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC))
    im = np.clip(im + rng.normal(0, 10, im.shape), 0, 255).astype(np.uint8)
    dev = np.asarray(gpu_decode.resize_crop_batch([jnp.asarray(im)],
                                                  size))[0]
    host = host_lib.resize_crop(im, size)
    assert dev.shape == host.shape == (size, size, 3)
    d = np.abs(dev.astype(np.int16) - host)
    assert d.max() <= 1 and (d > 0).mean() <= 0.005, (h, w, size)


# ----------------------------------------- the batch path, on the host decoder

class _Failing(host_decoder.HostBatchDecoder):
  """The host decoder, failing the images whose decoded pixels are in
  ``digests`` (as a GPU decode can fail where the host's succeeds), and
  recording, for every device it is bound to (``for_device`` copies share
  these lists), the sizes of its calls and the images it decoded."""

  def __init__(self, digests=()):
    super().__init__()
    self.digests, self.calls, self.decoded = set(digests), [], set()

  def decode(self, encoded, wheres, size):
    assert self.device is not None  # only ever called bound to a device
    self.calls.append((self.device, len(encoded)))
    images, ok, bad = super().decode(encoded, wheres, size)
    keep, out = [], []
    for j, i in enumerate(np.flatnonzero(ok)):
      if _digest(images[j]) in self.digests:
        ok[i] = False
        bad.append((int(i), wheres[i], "undecodable image (device: failed)"))
      else:
        keep.append(images[j])
        self.decoded.add((self.device, _digest(images[j])))
    bad.sort()
    out = np.stack(keep) if keep else images[:0]
    return out, ok, bad


def _check_shards(batch, sharding, dec=None):
  """The micro-batch's images are one global array in ``sharding`` whose
  local device k (in the sharding's row order) holds rows [k*per,
  (k+1)*per); with ``dec``, every row was decoded on the device holding
  it."""
  import jax  # pylint: disable=import-outside-toplevel
  image = batch["image"]
  assert isinstance(image, jax.Array) and image.sharding == sharding
  devices = list(sharding.mesh.devices.flat)
  per = image.shape[0] // len(devices)
  assert len(image.addressable_shards) == len(devices)
  for shard in image.addressable_shards:
    k = devices.index(shard.device)
    # One device holds the whole array: its index is slice(None).
    assert shard.index[0].indices(image.shape[0])[:2] == (k * per, (k + 1) * per)
    assert shard.data.devices() == {shard.device}
    if dec is not None:
      data = np.asarray(shard.data)
      assert all((shard.device, _digest(x)) in dec.decoded for x in data)


@pytest.mark.parametrize("fmt,micro,workers", [
    ("webdataset", 8, 0), ("csv", 8, 0), ("webdataset", 24, 0),
    pytest.param("webdataset", 8, 2, marks=pytest.mark.slow)])
def test_batch_path_gives_the_host_stream_and_counts(corpus, fmt, micro,
                                                     workers):
  # workers: the bytes read, checked and tokenized in grain's worker
  # processes, as the GPU decoder's host side runs at scale.
  import jax  # pylint: disable=import-outside-toplevel
  name = ("webdataset:" + corpus.pattern if fmt == "webdataset"
          else "csv:" + corpus.tables["csv"])
  config = _config(name, num_workers=workers,
                   **({"cache_max_mb": 0} if workers else {}))
  host = D.make_train_iterator(config, batch_size=24, seed=3,
                               microbatch_size=micro)
  dec = _Failing()
  batch = D.make_train_iterator(config, batch_size=24, seed=3,
                                microbatch_size=micro, batch_decoder=dec)
  assert isinstance(batch, batching.Prefetch)
  n = 96 // micro  # 96 > an epoch's 58 or 61
  a, b = _take(host, n), _take(batch, n)
  assert _same(a, b)
  assert all(x["image"].dtype == np.uint8
             and x["image"].shape == (micro, S, S, 3) for x in b)
  sharding = batching.data_sharding()
  for x in b:
    _check_shards(x, sharding, dec)
  assert batch.bad == host.bad and batch.seen == host.seen and host.bad > 0
  assert batch.ledger.by_reason == host.ledger.by_reason
  # Taken between micro-batches, the two states are the same: a run can
  # resume on the other decoder.
  assert batch.get_state() == host.get_state()
  # The host found every bad one: no top-ups; each device decoded its own
  # shard, once per micro-batch (the thread, stopped by close, may have
  # run up to depth + 1 ahead).
  batch.close()
  host.close()
  n_dev = len(jax.devices())
  assert {size for _, size in dec.calls} == {micro // n_dev}
  per_device = collections.Counter(d for d, _ in dec.calls)
  assert set(per_device) == set(jax.devices())
  assert len(set(per_device.values())) == 1 and (
      n <= min(per_device.values()) <= n + 3)


def test_encoded_images_cross_from_workers_flat_and_come_back_whole():
  # A worker's chunk carries the encoded images as one uint8 array and
  # their ends (shared memory, not a pickle); the training process gets the
  # same bytes back, trailing NULs and all, the other fields untouched.
  from train.data.sources.contract import Bad  # pylint: disable=import-outside-toplevel
  blobs = [b"\xff\xd8abc\x00\x00", b"\xff\xd8" + bytes(range(256)), b"\x00"]
  items = [(10, {"encoded": blobs[0], "key": "a", "label": np.int32(1)}),
           (11, Bad("b", "why")),
           (12, {"encoded": blobs[1], "key": "c", "label": np.int32(2)}),
           (13, {"encoded": blobs[2], "key": "d", "label": np.int32(3)})]
  flat = pipeline._pack(items, flat=True)  # pylint: disable=protected-access
  assert "encoded" not in flat["arrays"]
  assert flat["arrays"]["encoded_flat"].dtype == np.uint8
  back = pipeline._unflatten(flat)  # pylint: disable=protected-access
  plain = pipeline._pack(items)  # pylint: disable=protected-access
  assert list(back["arrays"]["encoded"]) == blobs
  assert back["arrays"].keys() == plain["arrays"].keys()
  assert list(back["arrays"]["key"]) == ["a", "c", "d"]
  assert np.array_equal(back["arrays"]["label"], [1, 2, 3])
  assert back["bad"] == plain["bad"] == [(1, "b", "why")]
  assert np.array_equal(back["good"], plain["good"])
  none = pipeline._pack([(0, Bad("x", "y"))], flat=True)  # pylint: disable=protected-access
  assert pipeline._unflatten(none)["arrays"] is None  # pylint: disable=protected-access


def _permuted_sharding():
  """Rows over the devices in another order than jax.devices()'s."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  order = [devices[i] for i in np.random.default_rng(0).permutation(
      len(devices))]
  return NamedSharding(Mesh(np.array(order), ("data",)), P("data"))


@pytest.mark.parametrize("micro,permuted", [(8, False), (24, False),
                                            (24, True)])
def test_a_failed_decode_costs_only_itself_and_keeps_the_order(
    corpus, caplog, micro, permuted):
  # Failures in a device's shard shift the rows after them onto the
  # devices before, as the host path's stream does; each device decodes
  # the members it gained, and every row is decoded where it is held.
  config = _config("webdataset:" + corpus.pattern)
  sharding = _permuted_sharding() if permuted else batching.data_sharding()
  steps = 120 // micro
  whole = _flat(_take_and_close(D.make_train_iterator(
      config, batch_size=micro, seed=1, batch_decoder=_Failing()),
                                steps + 48 // micro))
  # Fail distinct images, wherever they fall: two in one shard, one in the
  # last row of a micro-batch (no row after it on the device), the first.
  fail = {whole[i][0] for i in (0, 9, 10, 17, micro - 1, 2 * micro + 5)}
  dec = _Failing(fail)
  caplog.clear()
  with caplog.at_level("WARNING"):
    it = D.make_train_iterator(config, batch_size=micro, seed=1,
                               batch_decoder=dec, batch_sharding=sharding)
    # The decoding iterator itself, not its prefetch thread: what it logs
    # is then exactly the span taken, not the thread's lead too.
    it = it.iterator
    got = _take(it, steps)
  assert all(len(b["text"]) == micro for b in got)
  for b in got:
    _check_shards(b, sharding, dec)
  kept = [e for e in whole if e[0] not in fail]
  assert _flat(got) == kept[:120]
  # Every image that failed in the span taken is counted and logged once
  # (with its shard and key; met again in a later epoch, not again),
  # beside the source's own bad examples. (The span: whole up to its 120th
  # kept element, by position, as an example comes again in each epoch.)
  end = np.flatnonzero([e[0] not in fail for e in whole])[119] + 1
  failed = len({e[0] for e in whole[:end]} & fail)
  logged = [r.getMessage() for r in caplog.records
            if "skipped a bad example" in r.getMessage()]
  assert failed >= 5
  assert sum("device: failed" in m for m in logged) == failed
  assert all(".tar:" in m for m in logged)
  assert it.bad == len(logged) < it.ledger.log_first
  # Top-ups: more calls than one per device and micro-batch, none of more
  # than a shard.
  n_dev = len(sharding.device_set)
  assert max(size for _, size in dec.calls) == micro // n_dev
  assert len(dec.calls) > (steps + 2) * n_dev
  it.close()


def test_a_micro_batch_that_does_not_split_over_the_devices_is_refused(
    corpus):
  import jax  # pylint: disable=import-outside-toplevel
  n = len(jax.devices())
  config = _config("webdataset:" + corpus.pattern)
  with pytest.raises(ValueError, match=rf"a micro-batch of {n + 2} examples "
                     rf"does not split over {n} local devices"):
    D.make_train_iterator(config, batch_size=n + 2, batch_decoder=_Failing())


def test_device_major_keeps_decoded_rows_on_their_devices(corpus):
  # The trainer's whole-batch path (no streaming): device_major of the
  # decoded micro-batches is the host micro-batches' device_major, in the
  # same sharding, each device's block made from its own shards.
  import jax  # pylint: disable=import-outside-toplevel
  from train import streamed_tower  # pylint: disable=import-outside-toplevel
  config = _config("webdataset:" + corpus.pattern)
  n_dev = len(jax.devices())
  host = _take(D.make_train_iterator(config, batch_size=48, seed=6,
                                     microbatch_size=16), 3)
  it = D.make_train_iterator(config, batch_size=48, seed=6,
                             microbatch_size=16, batch_decoder=_Failing())
  parts = [b["image"] for b in _take(it, 3)]
  got = streamed_tower.device_major(parts, n_dev)
  want = streamed_tower.device_major([b["image"] for b in host], n_dev)
  assert got.sharding == parts[0].sharding and got.shape == want.shape
  assert np.array_equal(np.asarray(got), want)
  for shard in got.addressable_shards:
    k = list(got.sharding.mesh.devices.flat).index(shard.device)
    assert shard.index[0] == slice(k * 6, (k + 1) * 6)
  it.close()


def test_batch_path_resumes_bitwise_from_a_json_state(corpus):
  config = _config("webdataset:" + corpus.pattern)
  fail = set()
  probe = _flat(_take_and_close(D.make_train_iterator(
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


# Worker processes: the full suite (slow: 24 s of the quick mode's 5 min).
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_read_ahead_keeps_the_stream_the_state_and_resume(corpus, workers):
  # gpu_decoder_read_ahead: chunks taken out of grain on a thread of their
  # own; the micro-batches (a failed decode's top-ups among them), the
  # states between them and a resume are those without it, and close stops
  # the thread.
  import threading  # pylint: disable=import-outside-toplevel
  config = _config("webdataset:" + corpus.pattern, num_workers=workers,
                   **({"cache_max_mb": 0} if workers else {}))
  probe = _flat(_take_and_close(D.make_train_iterator(
      config, batch_size=8, seed=2, batch_decoder=_Failing()), 4))
  fail = {probe[5][0], probe[20][0]}

  def run(ahead, state=None, n=7):
    config.data.gpu_decoder_read_ahead = ahead
    it = D.make_train_iterator(config, batch_size=8, seed=2,
                               batch_decoder=_Failing(fail))
    if state is not None:
      it.set_state(state)
    out = []
    for _ in range(n):
      out.append(next(it))
      out.append(json.loads(json.dumps(it.get_state())))
    running = [t for t in threading.enumerate()
               if t.name == "decode-read-ahead"]
    it.close()
    return out, running
  plain, none = run(0)
  ahead, running = run(2)
  assert not none and running
  assert _same([x for x in plain if "image" in x],
               [x for x in ahead if "image" in x])
  assert [x for x in plain if "image" not in x] == [
      x for x in ahead if "image" not in x]
  assert plain[-1]["bad_data"] != plain[1]["bad_data"]  # it failed some
  assert not any(t.is_alive() for t in running)
  again, _ = run(2, state=plain[5], n=4)
  assert _same([x for x in plain[6:] if "image" in x],
               [x for x in again if "image" in x])


def test_too_much_bad_data_stops_the_batch_path(corpus):
  config = _config("webdataset:" + corpus.pattern, max_bad_fraction=0.05)
  it = D.make_train_iterator(config, batch_size=8, seed=0,
                             batch_decoder=_Failing())
  with pytest.raises(TooMuchBadData, match="config.data.max_bad_fraction"):
    _take_and_close(it, 20)


def test_decoder_config_errors_are_one_line(corpus):
  config = _config("webdataset:" + corpus.pattern, decoder="cpu")
  with pytest.raises(ValueError, match=r"config.data.decoder='cpu' must be "
                     "one of host, gpu, auto"):
    D.check_data_config(config)
  why = choice.gpu_unavailable()
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
      choice.make_batch_decoder(config.data, Decoded())
  config.data.decoder = "auto"
  assert choice.make_batch_decoder(config.data, Decoded()) is None


def test_auto_picks_by_tower_and_cores_per_gpu_and_says_so(monkeypatch):
  # decoder="auto": the host path while it keeps pace with the tower, else
  # the faster decoder, from BENCHMARKS' H200 figures; one line says which
  # and why.
  import ml_collections  # pylint: disable=import-outside-toplevel
  # The FLOP model against the rates measured on the H200: ViT-B/16 in the
  # streamed step (8,151-8,508 img/s), ViT-B/32 from outside (36,576).
  flops = lambda patch, w=768, d=12, mlp=3072: choice.vit_flops(
      224, patch, w, d, mlp)
  assert 8151 <= choice.VIT_FLOP_S / flops(16) <= 8508
  assert 0.8 < choice.VIT_FLOP_S / flops(32) / 36576 < 1.1
  assert choice.host_img_s(12, 16, 1) == 12 * 860  # 10,312 measured
  assert choice.host_img_s(16, 16, 1) == 12 * 860  # capped: cores - 4
  assert choice.host_img_s(12, 16, 2) == 12 * 860 / 2
  assert choice.host_img_s(0, 16, 1) == 1687  # threads alone

  def model(patch, kind="vit"):
    m = ml_collections.ConfigDict()
    m.image = dict(kind=kind, patch_size=patch, width=768, depth=12,
                   mlp_dim=3072)
    return m

  class Encoded:
    spec, encoded_images, bad_at_open = "webdataset:x", True, []
  data = _config("synthetic_shapes", decoder="auto", eval_split="test",
                 num_workers=12, image_size=224).data
  monkeypatch.setattr(choice, "gpu_unavailable", lambda: "")

  def pick(m, cores, gpus=1):
    lines = []
    got = choice.pick(data, Encoded(), m, cores=cores, gpus=gpus,
                        log=lines.append)
    assert len(lines) == 1 and lines[0].startswith(
        f"[data] decoder='auto': {got}: "), lines
    return got, lines[0]

  # ViT-B/16 on 16 cores per GPU: the host keeps pace (measured: 99-101%
  # of the device alone at 1M).
  got, line = pick(model(16), 16)
  assert got == "host" and "keeps pace" in line and "16 cores per GPU" in line
  # ViT-B/32: the host cannot keep pace, and today's GPU decoder in the
  # step (~6k img/s) is slower than the host path (~10.3k): the host.
  got, line = pick(model(32), 16)
  assert got == "host" and "no faster" in line
  # Fewer cores per GPU (two GPUs on 16 cores: ~5.2k each): the GPU.
  assert pick(model(16), 16, gpus=2)[0] == "gpu"
  # A GPU decoder at its ceiling (the goal: 18k in the step) takes B/32.
  monkeypatch.setattr(choice, "GPU_IMG_S", 18000)
  assert pick(model(16), 16)[0] == "host"
  got, line = pick(model(32), 16)
  assert got == "gpu" and "cannot keep pace" in line
  # An unknown tower: the faster decoder; no GPU decoder: the host.
  assert pick(model(16, kind="cnn"), 16)[0] == "gpu"
  monkeypatch.setattr(choice, "gpu_unavailable", lambda: "no GPU here")
  got, line = pick(model(32), 16)
  assert got == "host" and "no GPU here" in line
  # make_batch_decoder: "auto" -> host is no batch decoder.
  lines = []
  assert choice.make_batch_decoder(data, Encoded(), model(16),
                                     log=lines.append) is None
  assert len(lines) == 1


# ------------------- GpuBatchDecoder itself, nvImageCodec's call on the host

def _fake_nvimgcodec(made):
  """A host stand-in for the few names of ``nvidia.nvimgcodec`` that
  GpuBatchDecoder uses: its Decoder decodes baseline JPEGs fully with
  Pillow (no DCT scaling) into numpy arrays, which jax takes by DLPack as
  it takes nvImageCodec's images, and answers None for anything else
  (a progressive JPEG, as the hardware engines do; a PNG; no image).
  ``made`` collects the device_id of each Decoder made."""
  import types  # pylint: disable=import-outside-toplevel

  def one(data):
    data = bytes(data)
    if host_lib.jpeg_problem(data) or not host_lib.is_jpeg(data) or (
        b"\xff\xc2" in data[:data.find(b"\xff\xda")]):
      return None
    with Image.open(io.BytesIO(data)) as im:
      # A writable copy: numpy exports no read-only array by DLPack.
      return np.array(im.convert("RGB"), np.uint8)

  class Decoder:
    def __init__(self, device_id=0, **kwargs):
      made.append(device_id)
      self.kwargs = kwargs  # backends, options, max_num_cpu_threads
      self.calls = []  # the images of each call

    def decode(self, src, params=None):
      del params
      self.calls.append(len(src) if isinstance(src, list) else 1)
      return [one(d) for d in src] if isinstance(src, list) else one(src)

  return types.SimpleNamespace(
      Decoder=Decoder, DecodeParams=lambda **kw: kw,
      ColorSpec=types.SimpleNamespace(SRGB="srgb"),
      Backend=lambda kind, load_hint=None: (kind, load_hint),
      BackendKind=types.SimpleNamespace(HW_GPU_ONLY="hw", GPU_ONLY="cuda",
                                        HYBRID_CPU_GPU="hybrid"))


@pytest.fixture
def fake_nvimgcodec(monkeypatch):
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  made = []
  module = _fake_nvimgcodec(made)
  monkeypatch.setitem(sys.modules, "nvidia",
                      types.SimpleNamespace(nvimgcodec=module))
  monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", module)
  return made


def test_gpu_decoder_groups_falls_back_and_keeps_order_on_its_device(
    fake_nvimgcodec):
  # GpuBatchDecoder's own code (DLPack, grouping by shape, the device
  # resize, the host fallback, the order, the device it answers on) on CPU
  # devices, nvImageCodec's call made by the stand-in above.
  import jax  # pylint: disable=import-outside-toplevel
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  png = io.BytesIO()
  Image.fromarray(np.full((20, 24, 3), 90, np.uint8)).save(png, "PNG")
  jpgs = _images()
  items = [jpgs[0], b"<html>404</html>", jpgs[2], jpgs[1], png.getvalue(),
           jpgs[4], jpgs[3], jpgs[0][:-2], jpgs[1]]
  where = [f"k{i}" for i in range(len(items))]
  first = gpu_decode.GpuBatchDecoder(device=devices[0])
  dec = first.for_device(devices[-1])
  assert first.for_device(devices[0]) is first and dec.device == devices[-1]
  assert fake_nvimgcodec == [devices[0].local_hardware_id,
                             devices[-1].local_hardware_id]
  for size in (16, 40):
    g, ok, bad = dec.decode(items, where, size)
    h, hok, hbad = host_decoder.HostBatchDecoder().decode(items, where, size)
    assert g.devices() == {devices[-1]} and g.dtype == np.uint8
    assert np.array_equal(ok, hok) and [b[:2] for b in bad] == [
        b[:2] for b in hbad] == [(1, "k1"), (7, "k7")]
    g, paths = np.asarray(g), set()
    for row, i in enumerate(np.flatnonzero(ok)):
      full = dec._usable(  # pylint: disable=protected-access
          dec._decode_all([items[i]])[0])  # pylint: disable=protected-access
      paths.add(full is None)
      if full is None:  # handed back: the host path's pixels
        assert np.array_equal(g[row], h[row]), (size, i)
      else:  # decoded "on the device", resized there
        assert full.devices() == {devices[-1]}
        ref = gpu_decode.resize_crop_batch([full], size)[0]
        assert np.array_equal(g[row], np.asarray(ref)), (size, i)
    assert paths == {True, False}
  # Nothing decodes: an empty batch, still on the decoder's device.
  g, ok, bad = dec.decode([b"<html>", b""], ["a", "b"], 16)
  assert g.shape == (0, 16, 16, 3) and g.devices() == {devices[-1]}
  assert not ok.any() and [b[1] for b in bad] == ["a", "b"]


def test_gpu_decoder_settings_reach_nvimgcodec(fake_nvimgcodec,
                                              monkeypatch):
  # config.data.gpu_decoder_* -> nvImageCodec's Decoder(...) of every
  # device's decoder, through the trainer's make_batch_decoder.
  import jax  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(choice, "gpu_unavailable", lambda: "")

  class Encoded:
    spec, encoded_images, bad_at_open = "webdataset:x", True, []
  config = _config("synthetic_shapes", decoder="gpu", eval_split="test")
  dec = choice.make_batch_decoder(config.data, Encoded())
  assert dec._decoder.kwargs == {"options": ":fancy_upsampling=1"}  # pylint: disable=protected-access
  config.data.gpu_decoder_backend = "hw:0.7, hybrid"
  config.data.gpu_decoder_options = (
      " :num_cuda_streams=2   nvjpeg_cuda_decoder:hybrid_huffman_threshold=0")
  config.data.gpu_decoder_cpu_threads = 3
  D.check_data_config(config)
  del fake_nvimgcodec[:]
  dec = choice.make_batch_decoder(config.data, Encoded())
  other = dec.for_device(jax.devices()[-1])
  want = {"backends": [("hw", 0.7), ("hybrid", None)],
          "max_num_cpu_threads": 3,
          "options": ":fancy_upsampling=1 :num_cuda_streams=2 "
                     "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"}
  for d in (dec, other):
    assert d._decoder.kwargs == want  # pylint: disable=protected-access
  assert fake_nvimgcodec == [jax.devices()[0].local_hardware_id,
                             jax.devices()[-1].local_hardware_id]
  assert "options ':num_cuda_streams=2 nvjpeg" in other.describe()
  assert "3 CPU threads" in other.describe()


def test_several_gpu_decoders_split_a_shard_and_keep_its_order(
    fake_nvimgcodec):
  # gpu_decoder_threads: the shard in contiguous parts, each by its own
  # nvImageCodec decoder on its own thread; the images, ok and bad members
  # are one decoder's, bitwise, and the parts cover the shard once.
  import threading  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  device = jax.devices()[-1]
  png = io.BytesIO()
  Image.fromarray(np.full((20, 24, 3), 90, np.uint8)).save(png, "PNG")
  jpgs = _images()
  items = ([jpgs[0], b"<html>", jpgs[2], jpgs[1], png.getvalue(), jpgs[4],
            jpgs[3], jpgs[0][:-2], jpgs[1]] * 3)[:23]
  where = [f"k{i}" for i in range(len(items))]
  one = gpu_decode.GpuBatchDecoder(device=device)
  del fake_nvimgcodec[:]
  four = gpu_decode.GpuBatchDecoder(device=device, threads=4)
  assert fake_nvimgcodec == [device.local_hardware_id] * 4
  assert "4 decoders on threads" in four.describe()
  names = set()
  for d in four._decoders:  # pylint: disable=protected-access
    real = d.decode

    def decode(src, params=None, real=real):
      names.add(threading.current_thread().name)
      return real(src, params=params)
    d.decode = decode
  for size in (16, 40):
    g1, ok1, bad1 = one.decode(items, where, size)
    g4, ok4, bad4 = four.decode(items, where, size)
    assert g4.devices() == {device}
    assert np.array_equal(np.asarray(g1), np.asarray(g4))
    assert np.array_equal(ok1, ok4) and bad1 == bad4 and len(bad4) == 5
  calls = [d.calls for d in four._decoders]  # pylint: disable=protected-access
  assert [sum(c) for c in zip(*calls)] == [23, 23]  # each call's parts
  assert all(len(c) == 2 and min(c) >= 5 for c in calls), calls
  assert len(names) == 4 and all(n.startswith("decode-gpu") for n in names)
  t = four.clock.add_to({})
  assert {"nvimgcodec", "to_jax", "parts", "resize"} <= set(t)
  # A shard smaller than the decoders: one part each, no empty call.
  g, ok, _ = four.decode(items[:2], where[:2], 16)
  assert g.shape[0] == 1 and list(ok) == [True, False]
  four.close()
  assert four._pool is None  # pylint: disable=protected-access


@pytest.mark.parametrize("key,value,says", [
    ("gpu_decoder_backend", "nvjpeg", "'nvjpeg' is not one of auto, hw"),
    ("gpu_decoder_backend", "", "must be 'auto' or comma-separated kinds"),
    ("gpu_decoder_backend", "auto,hw", "'auto' is not one of"),
    ("gpu_decoder_backend", "hw,hybrid,hw", "names 'hw' twice"),
    ("gpu_decoder_backend", "hw:1.5", "load hint '1.5' of 'hw' must be"),
    ("gpu_decoder_backend", "hw:x", "load hint 'x' of 'hw' must be"),
    ("gpu_decoder_options", "hybrid_huffman_threshold=0",
     "'hybrid_huffman_threshold=0' is not [decoder_id]:option=value"),
    ("gpu_decoder_options", ":fancy_upsampling", "is not [decoder_id]"),
    ("gpu_decoder_options", "nvjpeg_cuda_decoder:=1", "is not [decoder_id]"),
    ("gpu_decoder_cpu_threads", -1, "must be an int >= 0"),
    ("gpu_decoder_cpu_threads", True, "must be an int >= 0"),
])
def test_gpu_decoder_settings_errors_are_one_line(key, value, says):
  # Checked on any machine and for any decoder: "auto" picks the GPU where
  # the extra is, and nvImageCodec itself ignores an option it cannot read.
  config = _config("synthetic_shapes", decoder="host", eval_split="test")
  with config.data.ignore_type():
    config.data[key] = value
  with pytest.raises(ValueError) as e:
    D.check_data_config(config)
  msg = str(e.value)
  assert "\n" not in msg and f"config.data.{key}=" in msg and says in msg, msg


def test_gpu_decoder_bad_members_anywhere_keep_the_host_rows(
    fake_nvimgcodec):
  # Bad members first, in the middle and last: one nvImageCodec call per
  # shard, the host decoder's ok, bad and rows (the rows after a bad one
  # move up; the tail the bad ones leave is cut off).
  import jax  # pylint: disable=import-outside-toplevel
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  del fake_nvimgcodec
  device = jax.devices()[-1]
  jpgs = _images()
  items = [b"", jpgs[0], jpgs[2], b"<html>", jpgs[1], jpgs[4], jpgs[3],
           jpgs[0][:-2], jpgs[1], jpgs[2], b"GIF89a"]
  where = [f"k{i}" for i in range(len(items))]
  dec = gpu_decode.GpuBatchDecoder(device=device)
  for size in (16, 40):
    g, ok, bad = dec.decode(items, where, size)
    h, hok, hbad = host_decoder.HostBatchDecoder().decode(items, where, size)
    assert g.devices() == {device} and g.shape == h.shape
    assert np.array_equal(ok, hok) and bad == hbad
    assert [b[1] for b in bad] == ["k0", "k3", "k7", "k10"]
  assert dec._decoder.calls == [len(items)] * 2  # pylint: disable=protected-access
  assert dec.decode([], [], 16)[0].shape == (0, 16, 16, 3)
  g, ok, _ = dec.decode([b"x"] * 5, list("abcde"), 16)
  assert g.shape == (0, 16, 16, 3) and not ok.any()


def test_gpu_path_on_cpu_devices_gives_the_host_stream(
    corpus, monkeypatch, fake_nvimgcodec):
  # config.data.decoder="gpu" end to end on the 8 CPU devices, only
  # nvImageCodec's call on the host: one GpuBatchDecoder per device, each
  # decoding its own shard. The corpus's 16 px JPEGs need no resize, and
  # Pillow's full decode is the host path's, so the stream is the host
  # path's bitwise.
  import jax  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(choice, "gpu_unavailable", lambda: "")
  name = "webdataset:" + corpus.pattern
  host = D.make_train_iterator(_config(name), batch_size=16, seed=8)
  gpu = D.make_train_iterator(_config(name, decoder="gpu"), batch_size=16,
                              seed=8)
  a, b = _take(host, 6), _take(gpu, 6)
  assert _same(a, b)
  for x in b:
    _check_shards(x, batching.data_sharding())
  assert gpu.bad == host.bad and gpu.ledger.by_reason == host.ledger.by_reason
  assert gpu.get_state() == host.get_state()
  inner = gpu.iterator
  assert [inner.decoder_for(d).device for d in inner.devices] == jax.devices()
  assert "one per local device (8)" in inner.describe()
  # The decode thread's time per stage (bench_train's stream rows): the
  # iterator's, the Prefetch's and the 8 decoders'.
  t = gpu.timing()
  assert set(t) == {"read", "decode", "assemble", "queue_full",
                    "nvimgcodec", "to_jax", "resize"}
  assert all(v["wall_s"] > 0 and 0 <= v["cpu_s"] <= v["wall_s"] + 1e-3
             for v in t.values()), t
  gpu.close()


def test_stopwatch_tells_waiting_from_working():
  import time  # pylint: disable=import-outside-toplevel
  clock = stopwatch.Stopwatch()
  for _ in range(2):
    with clock("wait"):
      time.sleep(0.05)
  with clock("work"):
    sum(range(200_000))
  t = clock.add_to({"work": {"wall_s": 1.0, "cpu_s": 1.0}})
  assert t["wait"]["wall_s"] >= 0.1 and t["wait"]["cpu_s"] < 0.02
  assert t["work"]["wall_s"] > 1.0 and t["work"]["cpu_s"] > 1.0
  # Read from another thread while a stage runs: its wall time so far.
  import threading  # pylint: disable=import-outside-toplevel
  started, release = threading.Event(), threading.Event()

  def hold():
    with clock("held"):
      started.set()
      release.wait(5)
  worker = threading.Thread(target=hold)
  worker.start()
  started.wait(5)
  time.sleep(0.05)
  during = clock.add_to({})["held"]["wall_s"]
  release.set()
  worker.join()
  assert 0.05 <= during <= clock.add_to({})["held"]["wall_s"]


# ------------------------------------------------------------------- GPU

GPU_WHY = choice.gpu_unavailable()
# Measured on an H200 (nvImageCodec 0.9.0.20 with nvJPEG 13.2, fancy
# upsampling, 256 px JPEGs at quality 90): the GPU's pixels against the
# host path's (libjpeg-turbo): max |diff| 1 level and 0.01% of the pixels
# at 256 px (decode only), max 2 and 0.2% (mean 0.002) after the resize to
# 224. The bound: that max, a mean of 0.01.
PIXEL_MAX, PIXEL_MEAN = 2, 0.01


def _pool(n=256, size=256):
  from train.data.sources import synthetic  # pylint: disable=import-outside-toplevel
  pool = synthetic.JpegPool(n, size=size, pool=n)
  return [pool[i]["image"] for i in range(n)]


def _rgb(image):
  """uint8 [h, w(, c)] -> [h, w, 3] as host.resize_crop takes it."""
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  return np.ascontiguousarray(image[..., :3])


def _gpu_vs_host(jpgs, size, **kw):
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  where = [f"k{i}" for i in range(len(jpgs))]
  dec = gpu_decode.GpuBatchDecoder(**kw)
  try:
    g, gok, gbad = dec.decode(jpgs, where, size)
  finally:
    dec.close()
  h, hok, hbad = host_decoder.HostBatchDecoder().decode(jpgs, where, size)
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

  @pytest.mark.parametrize("backend,options,cpu_threads,threads", [
      ("hybrid", "nvjpeg_cuda_decoder:hybrid_huffman_threshold=0", 0, 1),
      ("hw:0.5,hybrid", ":num_cuda_streams=2", 4, 1),
      ("auto", "", 0, 4),
      ("hw", "", 2, 2),
  ])
  def test_gpu_decoder_settings_keep_the_pixels(self, backend, options,
                                                cpu_threads, threads):
    # The settings bench_train --gpu_variants tries (config.data.
    # gpu_decoder_*) are taken by nvImageCodec itself and decode the same
    # pixels within the bound: the Huffman stage on the GPU, a batch split
    # between the engines and the CUDA decoder, fewer CPU threads, several
    # decoders on their threads.
    for size in (256, 224):
      d = _gpu_vs_host(_pool(), size, backend=backend, options=options,
                       cpu_threads=cpu_threads, threads=threads)
      print(f"{backend} {options!r} {cpu_threads} x{threads} -> {size}: "
            "max |diff| "
            f"{d.max()}, mean {d.mean():.4f}")
      assert d.max() <= PIXEL_MAX and d.mean() <= PIXEL_MEAN

  def test_gpu_pixels_of_every_kind_of_jpeg(self):
    # The kinds of _images (4:4:4, progressive, grayscale, non-square, one
    # large enough for the host's DCT-scaled decode), in one batch, per
    # backend. Each image the GPU decoded is checked against the host's
    # full decode put through the same device resize: only the decoding
    # differs, and a wrong colour space, channel order or chroma upsampling
    # costs tens of levels (a sanity bound: the measured one is for 256 px
    # baseline JPEGs). Each image it handed back (nvImageCodec answered
    # None, e.g. the hardware engines on a progressive JPEG) must be the
    # host path's, bitwise. Against the host path as a whole (its draft
    # decode and Pillow's box reduction, not a full decode and one
    # antialiased resize): reported, with the bound of the same comparison
    # made on the CPU with the host's full decode in the GPU's place
    # (there: mean 3.2 levels at 16 px, 0.06 at 40).
    import jax  # pylint: disable=import-outside-toplevel
    from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
    jpgs = _images()
    where = [f"k{i}" for i in range(len(jpgs))]
    for backend in ("auto", "hw"):
      dec = gpu_decode.GpuBatchDecoder(backend)
      on_gpu = [dec._usable(dec._decode_all([j])[0]) is not None  # pylint: disable=protected-access
                for j in jpgs]
      for size in (16, 40):
        g, ok, bad = dec.decode(jpgs, where, size)
        assert ok.all() and not bad and g.devices() == {dec.device}
        g = np.asarray(g)
        h = host_decoder.HostBatchDecoder().decode(jpgs, where, size)[0]
        for i, data in enumerate(jpgs):
          if not on_gpu[i]:
            assert np.array_equal(g[i], h[i]), (backend, size, i)
            continue
          full = _rgb(host_lib.decode_host(data, "", 0))
          ref = np.asarray(gpu_decode.resize_crop_batch(
              [jax.device_put(full, dec.device)], size))[0]
          d = np.abs(g[i].astype(np.int16) - ref)
          print(f"{backend}: JPEG {i} {full.shape[:2]} -> {size}, vs the "
                f"host's full decode: max |diff| {d.max()}, mean "
                f"{d.mean():.4f}")
          assert d.max() <= 8 and d.mean() <= 1, (backend, size, i)
        d = np.abs(g.astype(np.int16) - h)
        print(f"{backend}: mixed JPEGs -> {size}, on the GPU "
              f"{sum(on_gpu)}/{len(jpgs)}, vs the host path: max |diff| "
              f"{d.max()}, mean {d.mean():.4f}")
        assert d.mean() <= 4

  def test_gpu_path_gives_the_host_stream_with_every_kind_of_bad_member(
      self, corpus, tmp_path):
    import tarfile  # pylint: disable=import-outside-toplevel
    # Beside the corpus's (a JPEG cut to a third, empty and blank captions,
    # orphans, a cut shard): a file that is no image, a JPEG whose header
    # is garbage, a JPEG cut just before its end marker, and a PNG (lossless:
    # the same pixels whether nvImageCodec's CPU codecs decode it or it
    # answers None and the host does).
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
    assert isinstance(gpu, batching.Prefetch)
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

  def test_gpu_path_decodes_each_shard_on_its_gpu(self, corpus):
    # Each local GPU (two when two are lent; one: its single shard) decodes
    # its own rows with its own decoder, and holds them: the rows the host
    # path gives that device, within the pixel bound of the stream test.
    import jax  # pylint: disable=import-outside-toplevel
    from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
    n = len(jax.local_devices())
    name = "webdataset:" + corpus.pattern
    host = D.make_train_iterator(_config(name), batch_size=8 * n, seed=7)
    gpu = D.make_train_iterator(_config(name, decoder="gpu"),
                                batch_size=8 * n, seed=7)
    for x, y in zip(_take(host, 4), _take(gpu, 4)):
      assert np.array_equal(x["text"], y["text"])
      _check_shards(y, batching.data_sharding())
      for shard in y["image"].addressable_shards:
        d = np.abs(np.asarray(shard.data).astype(np.int16)
                   - x["image"][shard.index[0]])
        assert d.mean() <= 4, (shard.device, d.mean())
    inner = gpu.iterator
    assert inner.devices == jax.local_devices()
    for device in inner.devices:
      dec = inner.decoder_for(device)
      assert isinstance(dec, gpu_decode.GpuBatchDecoder)
      assert dec.device == device
    print(f"{n} GPU(s): {inner.describe()}")
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
  monkeypatch.setattr(choice, "gpu_unavailable", lambda: "")
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  calls = []

  class Counted(host_decoder.HostBatchDecoder):
    def __init__(self, backend, options, cpu_threads, threads):
      # make_batch_decoder's call, the config's defaults.
      assert (backend, options, cpu_threads, threads) == ("auto", "", 0, 1)
      super().__init__()

    def decode(self, encoded, wheres, size):
      calls.append((self.device, len(encoded)))
      return super().decode(encoded, wheres, size)
  monkeypatch.setattr(gpu_decode, "GpuBatchDecoder", Counted)
  batch = _step_one_loss(tmp_path / "batch", "gpu")
  # Every device decoded its own shards of the micro-batches of 8.
  import jax  # pylint: disable=import-outside-toplevel
  n_dev = len(jax.devices())
  assert {d for d, _ in calls} == set(jax.devices())
  assert {size for _, size in calls} == {8 // n_dev}
  assert batch == host


def test_precompute_on_the_batch_path_writes_the_host_paths_shards(
    corpus, tmp_path, monkeypatch, capsys):
  # train.precompute with a batch decoder (the GPU's contract; here the
  # host's decoder, so the pixels are the host path's): each local device
  # decodes its rows of each batch; the shards (embeddings, keys, bad rows,
  # content hashes) are the host path's, bitwise.
  import jax  # pylint: disable=import-outside-toplevel
  from tests import test_stream  # pylint: disable=import-outside-toplevel
  from train import precompute as precompute_lib  # pylint: disable=import-outside-toplevel
  from train import train as train_lib  # pylint: disable=import-outside-toplevel
  from train.data.sources import embeddings as emb_lib  # pylint: disable=import-outside-toplevel
  config = test_stream._tiny(  # pylint: disable=protected-access
      "webdataset:" + corpus.pattern, "", tmp_path / "tfds",
      precompute_image_embeddings=False)
  tower = train_lib.make_locked_tower(
      config, train_lib.data_lib.make_tokenizer(config))
  n_dev = len(jax.devices())
  kw = dict(rows_per_shard=40, batch_size=2 * n_dev)
  precompute_lib.precompute(config, str(tmp_path / "host"), tower, **kw)
  calls = []

  class Counted(host_decoder.HostBatchDecoder):
    def decode(self, encoded, wheres, size):
      calls.append((self.device, len(encoded)))
      return super().decode(encoded, wheres, size)
  made = []
  monkeypatch.setattr(choice, "make_batch_decoder",
                      lambda *a, **k: made.append(a) or Counted())
  capsys.readouterr()
  precompute_lib.precompute(config, str(tmp_path / "batch"), tower, **kw)
  assert made and "images decoded by host" in capsys.readouterr().out
  meta = emb_lib.read_meta(str(tmp_path / "batch"), "x")
  assert meta["decoder"] == "host" and meta["num_shards"] >= 2
  n_bad = 0
  for k in range(meta["num_shards"]):
    a, b = (emb_lib.shard_paths(str(tmp_path / d), k)
            for d in ("host", "batch"))
    assert open(a[0], "rb").read() == open(b[0], "rb").read(), k
    ja, jb = (json.load(open(x[1])) for x in (a, b))
    assert ja == jb, k
    n_bad += len(ja["bad"])
  assert n_bad > 0  # the corrupt JPEG and the empty captions among them
  # Every device decoded its own rows, at most 2 a call (bad reads left out).
  assert {d for d, _ in calls} == set(jax.devices())
  assert max(n for _, n in calls) == 2


def test_prefetch_closed_midway_continues_where_the_consumer_was(corpus):
  # The thread runs ahead; closing (as set_state and a checkpoint restore
  # do) must not lose or repeat the micro-batches it held.
  config = _config("webdataset:" + corpus.pattern)
  whole = _take_and_close(D.make_train_iterator(
      config, batch_size=8, seed=4, batch_decoder=_Failing()), 9)
  it = D.make_train_iterator(config, batch_size=8, seed=4,
                             batch_decoder=_Failing())
  got = _take(it, 3)
  it.close()
  got += _take(it, 3)
  it.close()
  got += _take(it, 3)
  assert _same(whole, got)
  it.close()


def test_shard_batch_keeps_arrays_decoded_on_their_devices():
  """The GPU decoder's images arrive as a global array in the batch's
  sharding: ``step.shard_batch`` keeps it (treating it as process-local
  data would be wrong with several processes) and still shards the host
  values; an array in another sharding is resharded, not kept."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from train import step  # pylint: disable=import-outside-toplevel
  mesh = Mesh(np.array(jax.devices()), (step.AXIS,))
  n = 2 * len(jax.devices())
  images = jax.device_put(np.arange(n * 3, dtype=np.uint8).reshape(n, 3),
                          NamedSharding(mesh, P(step.AXIS)))
  text = np.arange(n * 2, dtype=np.int32).reshape(n, 2)
  out = step.shard_batch(mesh, {"image": images, "text": text})
  assert out["image"] is images
  assert out["text"].sharding.is_equivalent_to(images.sharding, 2)
  np.testing.assert_array_equal(np.asarray(out["text"]), text)
  replicated = jax.device_put(np.asarray(images), NamedSharding(mesh, P()))
  out = step.shard_batch(mesh, {"image": replicated})
  assert out["image"] is not replicated
  assert out["image"].sharding.is_equivalent_to(images.sharding, 2)
  np.testing.assert_array_equal(np.asarray(out["image"]), np.asarray(images))
