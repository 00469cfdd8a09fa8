"""Shards and tables on object storage read like the same files on disk.

The same webdataset shards (with planted bad members, and a caption that is
not UTF-8) are served by a local S3 server (moto), a local GCS server
(gcp-storage-emulator) and over HTTP with Range (tests/netservers.py,
127.0.0.1 only): the training stream read from any of them equals the
local-disk stream bitwise, with the same bad examples named; with
faults injected between the reader and the server (503s, resets mid-body,
slow answers; seeded, bounded) it still does, and the retries are counted. A
shard that is missing, or deleted mid-run, gives one line naming its URL;
the tar index is scanned once per shard version (cached); secrets in a URL
are never printed. An outage shorter than config.data.remote_outage_s is
ridden through, a longer one raises Outage (a whole run through faults and
outages on S3: tests/test_outage.py).
"""
import io
import json
import os
import threading
import shutil
import sys
import tarfile

import numpy as np
import pytest

from tests import corpus as corpus_lib
from tests import lit_fixtures
from tests.netservers import FaultProxy
from tests.netservers import gcs  # noqa: F401  (fixture)
from tests.netservers import gcs_server  # noqa: F401  (fixture)
from tests.netservers import http_dir  # noqa: F401  (fixture)
from tests.netservers import moto_endpoint  # noqa: F401  (fixture)
from tests.netservers import s3  # noqa: F401  (fixture)
from train import data as D
from train.data.sources import remote
from train.data.sources import webdataset
from train.data.sources.contract import BadExample

pytest.importorskip("s3fs", reason="the cloud extra")
pytest.importorskip("moto", reason="the dev extra")

PLANTED = ("corrupt_jpeg", "empty_caption", "orphan")
NUM_GOOD = 40
NOT_UTF8 = b"a photo of a \xff\xfe ring"   # latin-1 bytes in a .txt
MICROBATCHES = 14                           # over 2 epochs of the stream


def _add(tar, name, data):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
  """Shards on disk: train-{000000..000005}.tar (40 good, 3 planted bad)
  and extra-000000.tar (2 good, one caption not UTF-8)."""
  root = tmp_path_factory.mktemp("remote") / "shards"
  sh = lit_fixtures.shards(root, "train", num=NUM_GOOD, per_shard=8,
                           planted=PLANTED)
  good = lit_fixtures.shards(root / "x", "x", num=3, per_shard=8)
  with tarfile.open(good.pattern) as src, tarfile.open(
      root / "extra-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
    for m in src.getmembers():
      data = src.extractfile(m).read()
      if m.name == "000001.txt":
        data = NOT_UTF8
      _add(tar, m.name, data)
  shutil.rmtree(root / "x")
  files = sorted(os.listdir(root))
  bad = dict(sh.bad, **{"extra-000000.tar:000001": "caption"})
  return {"root": str(root), "files": files, "bad": bad,
          "pattern": "train-{000000..000005}.tar::extra-000000.tar"}


def _name(base: str, shards) -> str:
  """config.data.name of the shards under ``base`` (a dir or a URL)."""
  return "webdataset:" + "::".join(
      remote.join(base, p) for p in shards["pattern"].split("::"))


def _config(name, tmp_path, **data):
  return corpus_lib.data_config(
      name, cache_max_mb=0, shard_index_cache=str(tmp_path / "index"),
      **data)


def _retries(it):
  """The ledger's retries and those of the training process's reads not
  yet taken by a chunk (pylint: disable=protected-access)."""
  return it.ledger.retries + (it._store.take_retries() if it._store else 0)


def _stream(config, n=MICROBATCHES):
  it = D.make_train_iterator(config, batch_size=8, seed=3)
  try:
    batches = [next(it) for _ in range(n)]
    return batches, it.get_state(), _retries(it)
  finally:
    it.close()


def _same_stream(a, b):
  (batches_a, state_a, _), (batches_b, state_b, _) = a, b
  assert len(batches_a) == len(batches_b)
  for x, y in zip(batches_a, batches_b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
  bad_a, bad_b = dict(state_a["bad_data"]), dict(state_b["bad_data"])
  bad_a.pop("retries"), bad_b.pop("retries")
  assert bad_a == bad_b
  assert state_a["next_position"] == state_b["next_position"]


@pytest.fixture(scope="module")
def local_stream(shards, tmp_path_factory):
  config = _config(_name(shards["root"], shards),
                   tmp_path_factory.mktemp("local"))
  out = _stream(config)
  counted = set(out[1]["bad_data"]["counted"])
  # Every planted bad example is skipped and named with shard:key.
  assert counted == set(shards["bad"]), (counted, shards["bad"])
  assert out[1]["bad_data"]["by_reason"]["caption is not valid UTF-8"] == 1
  return out


def _server(request, kind):
  """The server of ``kind`` ("s3", "gs", "http"): its fixture, started for
  this test (only the one a case needs)."""
  return request.getfixturevalue({"s3": "s3", "gs": "gcs",
                                  "http": "http_dir"}[kind])


def _serve(kind, shards, server):
  """The shards on ``server`` (of ``kind``): their base URL."""
  if kind in ("s3", "gs"):
    return server.put_dir(shards["root"], "cc/shards")
  for f in shards["files"]:
    shutil.copy(os.path.join(shards["root"], f), server.root)
  return server.base


def _upstream(kind, server):
  return ("127.0.0.1", server.port) if kind == "http" else server.host_port


def _via(kind, proxy_url, name, base):
  """(storage options, ``name``): ``name`` read through the proxy at
  ``proxy_url``: an object store's endpoint in the storage options (not the
  environment), an HTTP URL rewritten."""
  if kind == "http":
    return {}, name.replace(base, proxy_url)
  return {kind: {"endpoint_url": proxy_url}}, name


def _exact(kind):
  """FaultProxy options under which each fault costs exactly one retry.
  gcsfs's stat sends the object's GET twice at once (its own, and its
  directory check's when a listing comes back empty) and uses one answer:
  which of the two a fault hits is a race. On gs:// only the objects'
  contents are faulted there (a stat's faults: the other fault tests)."""
  return {"paths": r"alt=media"} if kind == "gs" else {}


def _retried(kind, faults):
  """The faults a reader retries: each one, except a failed HEAD (fsspec's
  HTTP stat answers it with a GET of its own)."""
  return [f for f in faults if kind != "http" or f[1] == "GET"]


@pytest.mark.parametrize("kind", ["s3", "gs", "http"])
def test_remote_stream_equals_the_local_disk_stream(
    kind, shards, local_stream, tmp_path, request):
  server = _server(request, kind)
  base = _serve(kind, shards, server)
  # Another store's retries in this process (an eval split's, a closed
  # pipeline's readers) are not this pipeline's.
  other, calls = remote.Store(backoff_s=0.0), []
  def flaky(fs, path):
    calls.append(path)
    if len(calls) == 1:
      raise TimeoutError("a transient failure")
    return b"ok"
  assert other.call(base + "/other", flaky) == b"ok" and other.retries_made == 1
  got = _stream(_config(_name(base, shards), tmp_path))
  if kind == "http":
    server.settle()
  _same_stream(got, local_stream)
  assert got[2] == 0  # No retries without faults.
  assert other.take_retries() == 1 and other.take_retries() == 0


@pytest.mark.parametrize("kind", ["s3", "gs", "http"])
def test_faults_are_retried_counted_and_change_nothing(
    kind, shards, local_stream, tmp_path, request):
  server = _server(request, kind)
  base = _serve(kind, shards, server)
  with FaultProxy(_upstream(kind, server), seed=7, fraction=0.2,
                  max_faults=12, delay_s=0.3) as proxy:
    options, name = _via(kind, proxy.url, _name(base, shards), base)
    got = _stream(_config(name, tmp_path,
                          storage_options=json.dumps(options)))
    proxy.settle()
  _same_stream(got, local_stream)
  assert [f for f in proxy.faults if f[0] != "slow"], proxy.faults
  # Retries are counted where the examples are taken (a request failed for
  # an example read ahead and not yet taken is counted later).
  failed = [f for f in proxy.faults if f[0] != "slow"]
  assert 1 <= got[2] <= len(failed), (got[2], proxy.faults)


def _example(source, i):
  try:
    return source[i]
  except BadExample as e:
    return (e.where, e.reason)


@pytest.mark.parametrize("kind", ["s3", "gs", "http"])
def test_every_failed_request_is_retried_once_and_counted(
    kind, shards, tmp_path, request):
  server = _server(request, kind)
  base = _serve(kind, shards, server)
  local = webdataset.WebDatasetSource(
      _name(shards["root"], shards)[len("webdataset:"):])
  with FaultProxy(_upstream(kind, server), seed=3, fraction=0.3,
                  max_faults=12, kinds=("503", "reset"),
                  **_exact(kind)) as proxy:
    options, pattern = _via(kind, proxy.url,
                            _name(base, shards)[len("webdataset:"):], base)
    store = remote.Store(options, backoff_s=0.01)
    source = webdataset.WebDatasetSource(pattern, store=store,
                                         index_cache="")
    for i in range(len(local)):
      assert _example(source, i) == _example(local, i)
  assert source.bad_at_open == local.bad_at_open
  # Each fault costs exactly one retry.
  assert len(_retried(kind, proxy.faults)) >= 6, proxy.faults
  assert store.retries_made == len(_retried(kind, proxy.faults)), proxy.faults


@pytest.mark.slow
def test_retries_in_worker_processes_reach_the_ledger(
    shards, local_stream, tmp_path, s3):
  base = _serve("s3", shards, s3)
  # The indexes scanned beforehand: with faults on GETs only, every retry
  # is of a member read in the worker process.
  webdataset.WebDatasetSource(_name(base, shards)[len("webdataset:"):],
                              index_cache=str(tmp_path / "index"))
  with FaultProxy(s3.host_port, seed=11, fraction=0.3, max_faults=10,
                  kinds=("503",), methods=("GET",)) as proxy:
    config = _config(_name(base, shards), tmp_path, num_workers=1,
                     storage_options=json.dumps(
                         {"s3": {"endpoint_url": proxy.url}}))
    got = _stream(config)
    proxy.settle()
  _same_stream(got, local_stream)
  assert proxy.faults
  assert 1 <= got[1]["bad_data"]["retries"] <= len(proxy.faults)


def _through_slow_proxy(kind, shards, server, delay_s, **proxy):
  """(proxy, pattern, store): the shards served by ``server`` through a
  FaultProxy that answers every GET ``delay_s`` late (a remote store's
  round trip), or with the faults of ``proxy``."""
  base = _serve(kind, shards, server)
  plan = proxy or dict(fraction=1.0, kinds=("slow",), max_faults=10**6)
  p = FaultProxy(_upstream(kind, server), delay_s=delay_s, methods=("GET",),
                 **plan)
  options, pattern = _via(kind, p.url,
                          _name(base, shards)[len("webdataset:"):], base)
  return p, pattern, remote.Store(options, backoff_s=0.01)


@pytest.mark.parametrize("kind", ["s3", "gs", "http"])
def test_a_chunk_takes_about_n_over_parallelism_round_trips(
    kind, shards, request):
  """Every GET answered 0.25 s late: a chunk of n examples read together
  takes >= ceil(n / parallelism) round trips (at most parallelism in
  flight) and far less than n (one after another), with the examples, bad
  ones included, those of the local shards."""
  import math  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  delay, parallelism = 0.25, 8
  local = webdataset.WebDatasetSource(
      _name(shards["root"], shards)[len("webdataset:"):])
  proxy, pattern, store = _through_slow_proxy(
      kind, shards, _server(request, kind), delay)
  with proxy:
    source = webdataset.WebDatasetSource(pattern, store=store,
                                         index_cache="")
    assert source.is_remote and not local.is_remote
    indices = np.random.default_rng(5).permutation(len(local)).tolist()
    del proxy.requests[:]
    t0 = time.perf_counter()
    got = source.read_many(indices, parallelism)
    elapsed = time.perf_counter() - t0
    gets = [r for r in proxy.requests if r[0] == "GET"]
  n = len(indices)
  assert len(gets) == n  # One ranged GET per example, none retried.
  assert [_as_tuple(x) for x in got] == [_example(local, i) for i in indices]
  trips = math.ceil(n / parallelism)
  assert elapsed >= 0.9 * trips * delay, (elapsed, trips)
  assert elapsed < 0.4 * n * delay, (elapsed, n)  # Serial: n * delay.


@pytest.mark.parametrize("kind", ["s3", "gs", "http"])
def test_a_stalled_request_times_out_and_is_retried(kind, shards, request,
                                                    monkeypatch):
  """A request the server sits on for longer than the read timeout fails
  as transient and is retried (once, counted), instead of waiting: the
  stores' clients take our timeouts."""
  import time  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(remote, "TIMEOUT_S", 1.0)
  server = _server(request, kind)
  base = _serve(kind, shards, server)
  with FaultProxy(_upstream(kind, server), fraction=1.0, kinds=("slow",),
                  max_faults=1, delay_s=5.0, methods=("GET",)) as proxy:
    options, url = _via(kind, proxy.url, f"{base}/train-000001.tar", base)
    store = remote.Store(options, backoff_s=0.01)
    t0 = time.perf_counter()
    got = store.read(url, 512, 4096)
    elapsed = time.perf_counter() - t0
  with open(os.path.join(shards["root"], "train-000001.tar"), "rb") as f:
    assert got == f.read()[512:4096]
  assert [f[0] for f in proxy.faults] == ["slow"]
  assert store.retries_made == 1
  assert elapsed < 4.0, elapsed  # Not the 5 s stall.


def _as_tuple(x):
  return (x.where, x.reason) if isinstance(x, BadExample) else x


@pytest.mark.parametrize("kind", ["s3", "gs", "http"])
def test_read_many_retries_each_failed_request_once(kind, shards, request):
  """Faults (503, reset mid-body) on a chunk's concurrent reads: each is
  retried once and counted, and no example is dropped or repeated."""
  local = webdataset.WebDatasetSource(
      _name(shards["root"], shards)[len("webdataset:"):])
  proxy, pattern, store = _through_slow_proxy(
      kind, shards, _server(request, kind), 0.0, seed=4, fraction=0.3,
      max_faults=10, kinds=("503", "reset"), **_exact(kind))
  with proxy:
    source = webdataset.WebDatasetSource(pattern, store=store,
                                         index_cache="")
    indices = list(range(len(local))) * 2  # Each index in two places.
    got = source.read_many(indices, 6)
  assert [_as_tuple(x) for x in got] == [_example(local, i) for i in indices]
  assert len(_retried(kind, proxy.faults)) >= 5, proxy.faults
  assert store.retries_made == len(_retried(kind, proxy.faults)), proxy.faults


@pytest.mark.parametrize("kind,parallelism,k", [("http", 1, 1), ("s3", 5, 2),
                                                ("gs", 7, 2), ("http", 64, 3)])
def test_the_stream_is_the_local_one_at_any_parallelism(
    kind, parallelism, k, shards, tmp_path, request):
  """The pipeline's stream from a remote source (chunks read together, an
  image of captions_per_image k read once for its k copies) equals the
  local-disk stream, bad examples and state included."""
  def stream(name, **data):
    it = D.make_train_iterator(_config(name, tmp_path, **data), batch_size=8,
                               seed=3, captions_per_image=k)
    # A remote source's chunks are read together (pylint: disable=protected-access).
    assert (it._read_chunk is not None) == remote.is_url(name.split(":", 1)[1])
    try:
      return [next(it) for _ in range(10)], it.get_state(), _retries(it)
    finally:
      it.close()
  want = stream(_name(shards["root"], shards))
  server = _server(request, kind)
  base = _serve(kind, shards, server)
  got = stream(_name(base, shards), remote_parallelism=parallelism)
  if kind == "http":
    server.settle()
  _same_stream(got, want)
  assert got[2] == 0


def test_remote_parallelism_is_checked_in_one_line():
  for bad in (0, -3, 257):
    config = corpus_lib.data_config("synthetic_shapes", remote_parallelism=1)
    config.data.remote_parallelism = bad
    with pytest.raises(ValueError) as e:
      D.check_data_config(config)
    assert "config.data.remote_parallelism" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_missing_shard_is_one_line_naming_its_url(kind, shards, tmp_path,
                                                    request):
  store = _server(request, kind)
  base = _serve(kind, shards, store)
  store.delete("cc/shards/train-000003.tar")
  config = _config(_name(base, shards), tmp_path)
  with pytest.raises(ValueError) as e:
    D.check_data_config(config)
  msg = str(e.value)
  assert "\n" not in msg
  assert (f"shard '{kind}://{store.bucket}/cc/shards/train-000003.tar' does "
          "not exist") in msg, msg


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_shard_deleted_mid_run_stops_it_in_one_line(kind, shards, tmp_path,
                                                      request):
  store = _server(request, kind)
  base = _serve(kind, shards, store)
  it = D.make_train_iterator(_config(_name(base, shards), tmp_path),
                             batch_size=8, seed=3)
  try:
    next(it)
    store.delete("cc/shards/train-000002.tar")
    with pytest.raises(remote.RemoteError) as e:
      for _ in range(100):  # Past what was read ahead before the delete.
        next(it)
  finally:
    it.close()
  msg = str(e.value)
  assert "\n" not in msg
  assert (f"{kind}://{store.bucket}/cc/shards/train-000002.tar does not "
          "exist") in msg, msg
  assert isinstance(e.value, ValueError)  # train.main: one "error:" line


def _gets(server):
  return [r for r in server.requests if r[0] == "GET"]


def test_the_index_is_scanned_once_per_shard_version(shards, tmp_path,
                                                     http_dir):
  base = _serve("http", shards, http_dir)
  pattern = _name(base, shards)[len("webdataset:"):]
  cache = str(tmp_path / "index")
  first = webdataset.WebDatasetSource(pattern, index_cache=cache)
  assert len(_gets(http_dir)) == len(shards["files"])  # One scan each.
  assert len(os.listdir(cache)) == len(shards["files"])
  del http_dir.requests[:]
  second = webdataset.WebDatasetSource(pattern, index_cache=cache)
  assert _gets(http_dir) == []  # Sizes and ETags only (HEAD).
  assert second.keys == first.keys and second.bad_at_open == first.bad_at_open
  np.testing.assert_array_equal(second._table, first._table)  # pylint: disable=protected-access
  # A new version of one shard (its ETag changes) is scanned again.
  path = os.path.join(http_dir.root, "train-000001.tar")
  st = os.stat(path)
  os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
  del http_dir.requests[:]
  webdataset.WebDatasetSource(pattern, index_cache=cache)
  assert [r[1] for r in _gets(http_dir)] == ["/train-000001.tar"]


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_index_cache_on_the_object_store(kind, shards, request):
  store = _server(request, kind)
  base = _serve(kind, shards, store)
  pattern = _name(base, shards)[len("webdataset:"):]
  cache = store.url("index-cache")
  with FaultProxy(store.host_port, fraction=0.0) as proxy:
    first = webdataset.WebDatasetSource(
        pattern, index_cache=cache, store=remote.Store(
            {kind: {"endpoint_url": proxy.url}}))
  scans = [r for r in proxy.requests if r[0] == "GET" and r[2]]  # Ranged.
  assert len(scans) == len(shards["files"])  # One scan each.
  if kind == "s3":
    listed = store.client.list_objects_v2(Bucket=store.bucket,
                                          Prefix="index-cache/")
    assert listed["KeyCount"] == len(shards["files"])
  else:
    assert len(store.list("index-cache/")) == len(shards["files"])
  with FaultProxy(store.host_port, fraction=0.0) as proxy:
    second = webdataset.WebDatasetSource(
        pattern, index_cache=cache, store=remote.Store(
            {kind: {"endpoint_url": proxy.url}}))
  scans = [r for r in proxy.requests if r[0] == "GET" and r[2]]
  assert scans == []  # Sizes, versions and the cached indexes only.
  assert second.keys == first.keys and second.bad_at_open == first.bad_at_open


def test_secrets_in_urls_are_never_printed(shards, tmp_path, http_dir):
  base = _serve("http", shards, http_dir)
  secret = "SEKRET-42"
  host = base.split("//")[1]
  pattern = (f"http://user:{secret}@{host}/train-{{000000..000005}}.tar"
             f"?X-Amz-Signature={secret}")
  cache = tmp_path / "index"
  source = webdataset.WebDatasetSource(pattern, index_cache=str(cache))
  printed = [source.describe(), source.spec, *source.keys,
             *(f"{w}: {r}" for w, r in source.bad_at_open),
             *os.listdir(cache)]
  for name in os.listdir(cache):
    with open(cache / name) as f:
      printed.append(f.read())
  with pytest.raises(ValueError) as e:
    webdataset.WebDatasetSource(pattern.replace("000005", "000009"))
  printed.append(str(e.value))
  assert "train-000006.tar" in str(e.value)
  assert not [p for p in printed if secret in p]
  assert source.keys[0].startswith("train-000000.tar:")


def test_a_forbidden_shard_is_one_line(shards, tmp_path, http_dir):
  base = _serve("http", shards, http_dir)
  http_dir.forbidden.add("/train-000004.tar")
  with pytest.raises(ValueError) as e:
    webdataset.WebDatasetSource(
        _name(base, shards)[len("webdataset:"):], index_cache="")
  msg = str(e.value)
  assert "\n" not in msg
  assert f"{base}/train-000004.tar" in msg and "403" in msg, msg


@pytest.mark.parametrize("kind,fmt", [("s3", "csv"), ("s3", "jsonl"),
                                      ("gs", "csv")])
def test_a_remote_table_with_remote_images_equals_the_local_one(
    kind, fmt, tmp_path, request):
  store = _server(request, kind)
  corpus = corpus_lib.make_corpus(tmp_path / "c", num=32)
  store.put_dir(str(tmp_path / "c"), "t")
  store.put_dir(str(tmp_path / "c" / "images"), "t/images")
  local = D.open_source(corpus_lib.data_config(f"{fmt}:{corpus.tables[fmt]}")
                        .data, "train")
  name = f"{fmt}:{store.url('t/' + os.path.basename(corpus.tables[fmt]))}"
  config = corpus_lib.data_config(name)
  D.check_data_config(config)
  got = D.open_source(config.data, "train")
  assert got.keys == local.keys and got.bad_at_open == local.bad_at_open
  for i in range(len(local)):
    try:
      want = local[i]
    except BadExample as e:
      with pytest.raises(BadExample) as b:
        got[i]  # pylint: disable=pointless-statement
      assert b.value.where == e.where
      assert store.url("t/images/") in b.value.reason
      continue
    assert got[i] == want
  # Read together: the same examples, a missing image bad in its place.
  assert got.is_remote and not local.is_remote
  indices = list(range(len(local)))[::-1]
  assert [_as_tuple(x) for x in got.read_many(indices, 7)] == [
      _as_tuple(x) for x in got.read_many(indices, 1)]
  assert [x["key"] if isinstance(x, dict) else x.where
          for x in got.read_many(indices, 7)] == [local.keys[i]
                                                  for i in indices]


def test_errors_are_classified():
  import aiohttp  # pylint: disable=import-outside-toplevel
  from botocore.exceptions import ClientError  # pylint: disable=import-outside-toplevel

  def http(status):
    return aiohttp.ClientResponseError(None, (), status=status)

  def boto(code, status):
    return ClientError({"Error": {"Code": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "Get")

  cases = [(http(503), "transient"), (http(500), "transient"),
           (http(429), "transient"), (http(403), "permanent"),
           (http(404), "missing"), (http(400), "permanent"),
           (boto("SlowDown", 503), "transient"),
           (boto("AccessDenied", 403), "permanent"),
           (aiohttp.ClientPayloadError("cut"), "transient"),
           (aiohttp.ServerDisconnectedError(), "transient"),
           (TimeoutError(), "transient"), (ConnectionResetError(), "transient"),
           (FileNotFoundError("x"), "missing"),
           (PermissionError("x"), "permanent"), (ValueError("x"), "permanent")]
  for e, want in cases:
    assert remote.classify(e) == want, (e, want)
  wrapped = OSError(16, "busy")
  wrapped.__cause__ = boto("SlowDown", 503)
  assert remote.classify(wrapped) == "transient"
  # What gcsfs raises for a JSON API answer of each status.
  from gcsfs.retry import validate_response  # pylint: disable=import-outside-toplevel
  for status, want in [(500, "transient"), (502, "transient"),
                       (503, "transient"), (504, "transient"),
                       (408, "transient"), (429, "transient"),
                       (404, "missing"), (403, "permanent"),
                       (401, "permanent"), (400, "permanent"),
                       (412, "permanent")]:
    body = json.dumps({"error": {"code": status, "message": "Invalid x"
                                 if status == 400 else "no"}}).encode()
    with pytest.raises(Exception) as e:
      validate_response(status, body, "b/bkt/o/x")
    assert remote.classify(e.value) == want, (status, e.value, want)


def test_scrub_leaves_no_secret():
  for url, want in [
      ("https://u:pw@host/a/b.tar?sig=x#f", "https://host/a/b.tar"),
      ("s3://bucket/k/x.tar", "s3://bucket/k/x.tar"),
      ("/local/path.tar", "/local/path.tar")]:
    assert remote.scrub(url) == want
  assert remote.basename("https://h/a/b.tar?token=x") == "b.tar"
  assert remote.join("s3://b/t", "images/x.jpg") == "s3://b/t/images/x.jpg"
  assert remote.join("s3://b/t", "/abs/x.jpg") == "/abs/x.jpg"


def test_storage_options_are_checked_in_one_line():
  config = corpus_lib.data_config("synthetic_shapes")
  for bad in ("{not json", '["s3"]', '{"s3": 3}'):
    config.data.storage_options = bad
    with pytest.raises(ValueError, match="config.data.storage_options"):
      remote.parse_storage_options(bad)
  assert remote.parse_storage_options('{"gcs": {"token": "anon"}}') == {
      "gs": {"token": "anon"}}
  assert webdataset.index_cache_of(config.data) == remote.default_index_cache()
  config.data.shard_index_cache = "none"
  assert webdataset.index_cache_of(config.data) == ""


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_an_outage_is_ridden_through_within_the_budget_then_given_up(
    kind, shards, request, monkeypatch, capsys):
  """The store behind an OutageProxy refuses connections for a window:
  shorter than config.data.remote_outage_s, a read retries (backoff with
  jitter; counted; one line saying so, rate-limited) and returns the
  bytes; longer, it raises Outage naming the URL and the budget (neither
  a usage error nor a bad example). A missing object stays a one-line
  NotFound at once."""
  import time  # pylint: disable=import-outside-toplevel
  from tests.netservers import OutageProxy  # pylint: disable=import-outside-toplevel
  server = _server(request, kind)
  base = _serve(kind, shards, server)
  with open(os.path.join(shards["root"], "train-000001.tar"), "rb") as f:
    want = f.read()[512:4096]
  with OutageProxy(_upstream(kind, server)) as proxy:
    options, url = _via(kind, proxy.url, f"{base}/train-000001.tar", base)
    store = remote.Store(options, outage_s=2.0, backoff_s=0.05)
    assert store.read(url, 512, 4096) == want  # Connected before.
    proxy.down(0.8)
    t0 = time.monotonic()
    assert store.read(url, 512, 4096) == want
    assert 0.7 <= time.monotonic() - t0 < 2.0
    assert store.retries_made >= 2
    err = capsys.readouterr().err
    # (Only this store's lines: another test's reader may still be retrying
    # in this process.)
    lines = [l for l in err.splitlines() if l.startswith("[data]")
             and remote.scrub(url) in l]
    assert len(lines) == 1, err  # One line for the burst.
    assert lines[0].startswith(f"[data] {kind if kind == 's3' else 'http'}: "
                               f"retrying {remote.scrub(url)} (attempt 2, ")
    assert "config.data.remote_outage_s=2)" in lines[0]
    proxy.down(None)  # Until further notice: past the budget.
    t0 = time.monotonic()
    with pytest.raises(remote.Outage) as e:
      store.read(url, 512, 4096)
    assert 2.0 <= time.monotonic() - t0 < 4.0
    assert not isinstance(e.value, (ValueError, OSError))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"cannot read {remote.scrub(url)}: the store kept failing for "
        "config.data.remote_outage_s=2 s ("), msg
    # A reader that closes cancels its store: a read in flight stops
    # retrying at once (remote.Cancelled), not after the budget, and so do
    # new ones until the store resumes.
    patient = remote.Store(options, outage_s=60.0, backoff_s=0.05)
    threading.Timer(0.5, patient.cancel).start()
    t0 = time.monotonic()
    with pytest.raises(remote.Cancelled):
      patient.read(url, 512, 4096)
    assert 0.4 <= time.monotonic() - t0 < 2.0
    proxy.up()
    with pytest.raises(remote.Cancelled):
      patient.read(url, 512, 4096)
    patient.resume()
    assert patient.read(url, 512, 4096) == want
    with pytest.raises(remote.NotFound):
      store.read(url.replace("train-000001", "train-000099"))
