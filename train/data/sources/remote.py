"""Files on object storage: fsspec URLs read by byte range, with retries.

    config.data.name = "webdataset:s3://bucket/cc3m/{00000..00331}.tar"
    config.data.name = "webdataset:https://host/cc3m/{00000..00331}.tar"
    config.data.name = "csv:gs://bucket/pairs.csv"   # image paths may be URLs

A path with a scheme (``s3://``, ``gs://``, ``http(s)://``, any protocol
fsspec knows) is read through fsspec (s3fs, gcsfs, aiohttp: the ``cloud``
extra); a plain path (or ``file://``) stays on the local ``os.pread`` path.
Credentials come from each store's standard environment (``AWS_*`` and
``~/.aws``, ``GOOGLE_APPLICATION_CREDENTIALS``, fsspec's config files) and
are never logged: a URL is printed without its user info and query string
(``scrub``). ``config.data.storage_options`` (JSON, per protocol) is passed
to the filesystem, e.g. ``{"s3": {"endpoint_url": "http://minio:9000"}}``;
botocore also honours ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``, gcsfs
``STORAGE_EMULATOR_HOST`` (``{"gs": {"endpoint_url": ...}}``).

Every request goes through ``Store.call``: a transient failure (5xx, 408,
429, a timeout, a refused or reset connection, a truncated body) is
retried with exponential backoff and jitter for as long as the store's
outage budget allows (``outage_s``, config.data.remote_outage_s: measured
from the request's first failure), and counted by the store
(``Store.take_retries``: the pipeline of the store's source carries the
count to the trainer's ``data/retries``; another pipeline's reads, an eval
split's or a closed one's, never mix in). Retries are said in one line per
burst of the store's retries (``notice``: then at most one every
``NOTICE_EVERY_S`` while it lasts) naming the store, the URL, the attempt
and the error. A request still failing when the budget is spent raises
``Outage`` (the trainer saves the
step reached and exits 75: the scheduler requeues the job); a permanent
failure (403, 404, 400, a Range the server ignores) is raised at once as
one line naming the URL (``RemoteError``, a ValueError: exit 2). The
stores' own hidden retries are turned off where they can be (s3fs,
botocore, gcsfs), so that what is retried is counted.

The examples of a chunk are read together (``parallel_map``): at most
``config.data.remote_parallelism`` requests in flight per process, on a
thread pool the process's readers share, so a chunk of n examples from a
store with round trip t takes about ceil(n / parallelism) * t, not n * t.

A remote shard's tar headers are scanned once and the result (the members'
names, offsets and sizes) is kept in ``index_cache`` (a local directory or a
URL), keyed by the URL and the object's size and ETag / modification time:
a rerun, and any host sharing the directory, reads the index instead.
"""
from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.parse

from absl import logging

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# How long a store may keep failing (transient failures only) before a read
# gives up: config.data.remote_outage_s.
DEFAULT_OUTAGE_S = 900.0
# Backoff before retry i (0-based): BACKOFF_S * 2**i, at most MAX_BACKOFF_S,
# times a random factor in [0.5, 1] (jitter: many readers do not retry in
# step); the last wait ends at the budget, for one more attempt.
BACKOFF_S = 0.1
MAX_BACKOFF_S = 10.0
# Retry lines: one when a burst of retries begins (a retry more than
# BURST_GAP_S after the store's previous one), however many readers it
# hits, then at most one every NOTICE_EVERY_S while it lasts.
BURST_GAP_S = 5.0
NOTICE_EVERY_S = 30.0
# A process that does not own the run's console (a data worker process)
# appends its retry lines to the file this names too (the run's train.log).
LOG_ENV = "INFCL_RUN_LOG"
# A request that sends nothing for this long is a transient failure.
TIMEOUT_S = 60.0
# Block size of the sequential reads that scan a remote shard's headers.
SCAN_BLOCK = 8 << 20
INDEX_VERSION = 1
# Requests in flight per process (config.data.remote_parallelism), and the
# most it may be (also the S3 client's connection pool: botocore's default
# of 10 would cap it).
DEFAULT_PARALLELISM = 32
MAX_PARALLELISM = 256

def is_url(path: str) -> bool:
  """True for a path with a scheme other than file://."""
  m = _SCHEME.match(path)
  return bool(m) and m.group(1).lower() != "file"


def local_path(path: str) -> str:
  """A local path without a file:// scheme, ~ expanded."""
  if path.lower().startswith("file://"):
    path = path[len("file://"):]
  return os.path.expanduser(path)


def protocol(url: str) -> str:
  p = _SCHEME.match(url).group(1).lower()
  return {"gcs": "gs", "s3a": "s3", "https": "http"}.get(p, p)


def scrub(url: str) -> str:
  """``url`` as it may be printed: no user info, query or fragment (where
  signed URLs and basic-auth keep their secrets)."""
  if not is_url(url):
    return url
  parts = urllib.parse.urlsplit(url)
  netloc = parts.netloc.rpartition("@")[2]
  return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def scrub_pattern(pattern: str) -> str:
  """A shard pattern ("a-{0..9}.tar::b-{0..3}.tar") with each URL
  scrubbed: what a source's ``spec`` (logs, checkpoint fingerprints) holds."""
  return "::".join(scrub(p) for p in pattern.split("::"))


def basename(path: str) -> str:
  """The file name of a path or URL (a URL's query left out)."""
  return os.path.basename(scrub(path).rstrip("/") if is_url(path) else path)


def dirname(path: str) -> str:
  if not is_url(path):
    return os.path.dirname(path)
  parts = urllib.parse.urlsplit(path)
  return urllib.parse.urlunsplit(
      (parts.scheme, parts.netloc, parts.path.rpartition("/")[0], "", ""))


def join(root: str, path: str) -> str:
  """``path`` relative to the directory ``root`` (a URL or a local path);
  an absolute path or a URL as it is."""
  if is_url(path) or os.path.isabs(local_path(path)) or not root:
    return path if is_url(path) else local_path(path)
  if is_url(root):
    return f"{root.rstrip('/')}/{path}"
  return os.path.join(root, os.path.expanduser(path))


class RemoteError(ValueError):
  """A remote file that cannot be read: one line naming it (scrubbed)."""


class Outage(Exception):
  """A store that kept failing (transient failures: refused connections,
  timeouts, 5xx) for longer than its outage budget. Not a usage error: the
  trainer saves the step reached and exits 75 (``train/main.py``) so that
  the scheduler requeues the job. Neither a ValueError nor an OSError, so
  that no reader turns it into a bad example or a one-line usage error."""

  def __init__(self, url: str, budget_s: float, attempts: int, last: str,
               what: str = "read"):
    super().__init__(url, budget_s, attempts, last, what)
    self.url, self.budget_s, self.attempts, self.last = (url, budget_s,
                                                         attempts, last)
    self.what = what

  def __str__(self):
    return (f"cannot {self.what} {self.url}: the store kept failing for "
            f"config.data.remote_outage_s={self.budget_s:g} s ({self.attempts}"
            f" attempts, the last with {self.last})")


def notice(line: str) -> None:
  """A store's retry line: on stderr (the run's console and train.log) and,
  in a process that does not own them (a data worker), appended to the
  file ``$INFCL_RUN_LOG`` names too. Above a progress bar, where one is
  drawn (tqdm's write)."""
  tqdm = sys.modules.get("tqdm")
  if tqdm is not None and getattr(tqdm, "tqdm", None) is not None:
    tqdm.tqdm.write(line, file=sys.stderr)
  else:
    print(line, file=sys.stderr, flush=True)
  path = os.environ.get(LOG_ENV, "")
  owner = os.environ.get(LOG_ENV + "_PID", "")
  if path and owner and owner != str(os.getpid()):
    try:
      fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      try:
        os.write(fd, f"[worker {os.getpid()}] {line}\n".encode(
            "utf-8", "replace"))
      finally:
        os.close(fd)
    except OSError:
      pass


class NotFound(RemoteError):
  pass


class _ShortRead(OSError):
  """A body shorter than asked for (a truncated response): transient."""


_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _status(e: BaseException):
  """The HTTP status an exception carries (aiohttp, botocore), or None."""
  for attr in ("status", "code"):
    v = getattr(e, attr, None)
    if isinstance(v, int) and 100 <= v < 600:
      return v
  resp = getattr(e, "response", None)
  if isinstance(resp, dict):
    return resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
  return None


def _chain(e: BaseException):
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    yield e
    e = e.__cause__ or e.__context__


def classify(e: BaseException) -> str:
  """"transient", "missing" or "permanent"."""
  if isinstance(e, _ShortRead):
    return "transient"
  names = {type(c).__name__ for c in _chain(e)}
  # Timeouts, resets and truncated bodies, as aiohttp, botocore, urllib3
  # and fsspec name them (not imported: each is optional; a truncated body's
  # aiohttp error carries a 400 of its own, so these come first).
  if names & {"ClientPayloadError", "ServerDisconnectedError", "ClientOSError",
              "ClientConnectionError", "ServerTimeoutError",
              "ClientConnectorError", "EndpointConnectionError",
              "ConnectionClosedError", "ReadTimeoutError",
              "ConnectTimeoutError", "IncompleteRead", "ResponseStreamingError",
              "FSTimeoutError", "ProtocolError", "HTTPClientError",
              "TransferEncodingError", "ContentLengthError",
              "ProxyError"}:  # gcsfs's name for a 502.
    return "transient"
  for c in _chain(e):
    status = _status(c)
    if status is not None:
      if status in _TRANSIENT_STATUS:
        return "transient"
      return "missing" if status in (404, 410) else "permanent"
  if isinstance(e, FileNotFoundError):
    return "missing"
  if isinstance(e, PermissionError):
    return "permanent"
  if isinstance(e, (TimeoutError, ConnectionError)):
    return "transient"
  if isinstance(e, OSError) and e.errno in (errno.EBUSY, errno.EAGAIN,
                                            errno.ETIMEDOUT, errno.EREMOTEIO,
                                            errno.ECONNRESET, errno.EPIPE):
    return "transient"
  return "permanent"


def _reason(e: BaseException) -> str:
  status = next((_status(c) for c in _chain(e) if _status(c)), None)
  if classify(e) == "transient" and status not in _TRANSIENT_STATUS:
    status = None
  text = str(e).splitlines()[0] if str(e) else ""
  text = re.sub(r"\w+://\S+", lambda m: scrub(m.group(0)), text)
  return (f"HTTP {status}: " if status else "") + (
      f"{type(e).__name__}: {text}" if text else type(e).__name__)


def _defaults(proto: str) -> dict:
  """Options under the user's: the stores' own retries off (ours count),
  timeouts set."""
  if proto == "s3":
    return {"config_kwargs": {"retries": {"total_max_attempts": 1},
                              "max_pool_connections": MAX_PARALLELISM,
                              "connect_timeout": TIMEOUT_S,
                              "read_timeout": TIMEOUT_S}}
  if proto == "http":
    # Lazy: each store's client (the cloud extra) only for its URLs.
    import aiohttp  # pylint: disable=import-outside-toplevel
    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(
        total=None, connect=TIMEOUT_S, sock_read=TIMEOUT_S)}}
  if proto == "gs":
    # Lazy: as above.
    import aiohttp  # pylint: disable=import-outside-toplevel
    return {"requests_timeout": aiohttp.ClientTimeout(
        total=None, connect=TIMEOUT_S, sock_read=TIMEOUT_S)}
  return {}


def _gcs_endpoint(options: dict) -> str:
  """The GCS endpoint other than Google's that gcsfs will use, or ""."""
  url = options.get("endpoint_url") or os.environ.get(
      "STORAGE_EMULATOR_HOST", "")
  return "" if url in ("", "default") else url


def _gcs_class(default, options: dict):
  """gcsfs's filesystem class for ``options``. gcsfs's default class asks
  each bucket's layout (zonal, hierarchical) over gRPC at the JSON API's
  host, and again on every call while it gets no answer (60 s of retries
  each): a custom endpoint (an emulator, a GCS-compatible store) serves the
  JSON API only, so there it is gcsfs's JSON API class."""
  if not _gcs_endpoint(options):
    return default
  # Lazy: the cloud extra, needed only for gs:// URLs.
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  return gcsfs.core.GCSFileSystem


def _gcs_one_attempt(fs) -> None:
  """gcsfs's own retry loop (6 attempts, 1-17 s apart, fixed when its class
  is defined) off for ``fs``: each request is made once (ours count)."""
  request = getattr(type(fs)._request, "__wrapped__", None)  # pylint: disable=protected-access
  if request is not None:
    fs._request = request.__get__(fs)  # pylint: disable=protected-access


def _merge(base: dict, over: dict) -> dict:
  out = dict(base)
  for k, v in over.items():
    out[k] = (_merge(out[k], v) if isinstance(v, dict)
              and isinstance(out.get(k), dict) else v)
  return out


def parse_storage_options(value, what: str = "config.data.storage_options"
                          ) -> dict:
  """config.data.storage_options (JSON text or a mapping) -> {protocol:
  {option: value}}; ValueError in one line if it is not that."""
  if not value:
    return {}
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except ValueError as e:
      raise ValueError(f"{what}: not JSON ({e})") from None
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if not isinstance(value, dict) or not all(
      isinstance(v, dict) for v in value.values()):
    raise ValueError(f"{what} must map a protocol to its options, e.g. "
                     '{"s3": {"endpoint_url": "http://host:9000"}}')
  return {({"gcs": "gs", "https": "http"}.get(k, k)): v
          for k, v in value.items()}


class Cancelled(Exception):
  """A request whose retries were stopped (``Store.cancel``): its reader is
  being closed. Neither a bad example nor an outage."""


class Store:
  """fsspec filesystems by protocol (one per process, made on first use)
  and the retrying calls every remote read goes through.

  Args:
    storage_options: config.data.storage_options.
    outage_s: how long a request may keep failing (transient failures)
      before it raises ``Outage``: config.data.remote_outage_s.
    backoff_s: the first wait between attempts (doubling, jittered, at most
      MAX_BACKOFF_S).

  Picklable (grain's worker processes): the filesystems are made again in
  each process.
  """

  def __init__(self, storage_options=None, *,
               outage_s: float = DEFAULT_OUTAGE_S,
               backoff_s: float = BACKOFF_S):
    self.options = parse_storage_options(storage_options)
    self.outage_s, self.backoff_s = float(outage_s), backoff_s
    self._fs, self._pid = {}, None
    self._lock = threading.Lock()
    self._cancels = threading.Condition(self._lock)
    self._cancelled = False  # cancel() ... resume().
    self.retries_made = 0  # By this store, in this process.
    self._retries_taken = 0
    self._last_notice = self._last_retry = -float("inf")

  def take_retries(self) -> int:
    """The retries this store made in this process since the last call."""
    with self._lock:
      n = self.retries_made - self._retries_taken
      self._retries_taken = self.retries_made
    return n

  def __getstate__(self):
    return {"options": self.options, "outage_s": self.outage_s,
            "backoff_s": self.backoff_s}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._fs, self._pid = {}, None
    self._lock = threading.Lock()
    self._cancels = threading.Condition(self._lock)
    self._cancelled = False
    self.retries_made = self._retries_taken = 0
    self._last_notice = self._last_retry = -float("inf")

  def filesystem(self, url: str):
    """(fsspec filesystem, its path of ``url``)."""
    proto = protocol(url)
    with self._lock:
      if self._pid != os.getpid():
        self._fs, self._pid = {}, os.getpid()
      fs = self._fs.get(proto)
      if fs is None:
        try:
          # Lazy: the cloud extra, needed only for URLs (or said below).
          import fsspec  # pylint: disable=import-outside-toplevel
          cls = fsspec.get_filesystem_class(proto)
        except (ImportError, ValueError) as e:
          raise ValueError(
              f"cannot read {scrub(url)}: {e} (pip install "
              "'infcl-jax[cloud]' for s3://, gs:// and http(s)://)") from None
        options = _merge(_defaults(proto), self.options.get(proto, {}))
        if proto == "gs":
          cls = _gcs_class(cls, options)
        fs = cls(skip_instance_cache=True, **options)
        if proto == "s3":
          fs.retries = 1  # s3fs's own retry loop: one attempt (ours count).
        if proto == "gs":
          _gcs_one_attempt(fs)
        self._fs[proto] = fs
    if proto == "http":
      return fs, url
    return fs, fs._strip_protocol(url)  # pylint: disable=protected-access

  def cancel(self) -> None:
    """Stops this store's requests until ``resume``: those in flight raise
    ``Cancelled`` at their next failure or in their wait, new ones at once.
    A reader that closes calls it, so that its reads (a read-ahead's, a
    pool's) do not go on retrying, and saying so, for the rest of the
    outage budget, nor keep the process from exiting meanwhile."""
    with self._cancels:
      self._cancelled = True
      self._cancels.notify_all()

  def resume(self) -> None:
    """Requests run again (a reader restarted after ``cancel``)."""
    with self._lock:
      self._cancelled = False

  def _retrying(self, url: str, attempt: int, elapsed: float, e) -> None:
    """Counts a retry and says so: at the start of a burst, then at most
    once every NOTICE_EVERY_S."""
    now = time.monotonic()
    with self._lock:
      self.retries_made += 1
      new_burst = now - self._last_retry >= BURST_GAP_S
      self._last_retry = now
      say = new_burst or now - self._last_notice >= NOTICE_EVERY_S
      if say:
        self._last_notice = now
    if say:
      notice(f"[data] {protocol(url)}: retrying {scrub(url)} (attempt "
             f"{attempt + 1}, {elapsed:.1f} s into the outage budget "
             f"config.data.remote_outage_s={self.outage_s:g}): {_reason(e)}")

  def call(self, url: str, fn, what: str = "read"):
    """``fn(fs, path)``, retried on transient failures (counted) until it
    succeeds or ``outage_s`` has passed since its first failure (then
    ``Outage``); a permanent failure raises RemoteError (NotFound for 404)
    naming the URL."""
    fs, path = self.filesystem(url)
    attempt, first_failure = 0, None
    while True:
      if self._cancelled:
        raise Cancelled(scrub(url))
      try:
        return fn(fs, path)
      except Exception as e:  # pylint: disable=broad-except
        kind = classify(e)
        if kind == "missing":
          raise NotFound(f"{scrub(url)} does not exist ({what}: "
                         f"{_reason(e)})") from None
        if kind == "permanent":
          raise RemoteError(f"cannot {what} {scrub(url)}: {_reason(e)}"
                            ) from None
        now = time.monotonic()
        first_failure = now if first_failure is None else first_failure
        attempt += 1
        elapsed = now - first_failure
        if elapsed >= self.outage_s:
          raise Outage(scrub(url), self.outage_s, attempt, _reason(e),
                       what) from None
        if self._cancelled:
          raise Cancelled(scrub(url)) from None
        self._retrying(url, attempt, elapsed, e)
        wait = (min(MAX_BACKOFF_S, self.backoff_s * 2**min(attempt - 1, 30))
                * random.uniform(0.5, 1.0))
        with self._cancels:
          if self._cancels.wait_for(lambda: self._cancelled,
                                    min(wait, self.outage_s - elapsed)):
            raise Cancelled(scrub(url)) from None

  def info(self, url: str) -> dict:
    """{"size": int, "validator": str}: the size and what identifies this
    version of the object (ETag, generation or modification time; "" when
    the store gives none)."""
    def get(fs, path):
      try:
        return fs.info(path)
      except FileNotFoundError as e:
        # fsspec's HTTP info turns every failure into FileNotFoundError:
        # its cause has the status.
        if e.__cause__ is not None and classify(e.__cause__) != "missing":
          raise e.__cause__ from None
        raise
    return _summary(self.call(url, get, "stat"))

  def read(self, url: str, start: int | None = None,
           end: int | None = None) -> bytes:
    """Bytes [start, end) of ``url`` (the whole object without a range)."""
    def get(fs, path):
      data = fs.cat_file(path, start=start, end=end)
      if start is not None and end is not None and len(data) != end - start:
        if len(data) > end - start:
          raise PermissionError(f"the server ignores Range requests "
                                f"(asked for {end - start} bytes, got "
                                f"{len(data)})")
        raise _ShortRead(f"short body: {len(data)} of {end - start} bytes "
                         f"at offset {start}")
      return data
    return self.call(url, get)

  def exists(self, url: str) -> bool:
    try:
      self.info(url)
      return True
    except NotFound:
      return False

  def write(self, url: str, data: bytes) -> None:
    self.call(url, lambda fs, path: fs.pipe_file(path, data), "write")


_pools: dict = {}
_pools_lock = threading.Lock()


def make_store(data) -> Store:
  """The reader of remote files config.data asks for: its storage_options
  and remote_outage_s."""
  return Store(data.get("storage_options", ""),
               outage_s=data.get("remote_outage_s", DEFAULT_OUTAGE_S))


def _pool(parallelism: int):
  """This process's thread pool of ``parallelism`` readers (made on first
  use, again in a forked child)."""
  key = (os.getpid(), parallelism)
  with _pools_lock:
    pool = _pools.get(key)
    if pool is None:
      for k in [k for k in _pools if k[0] != os.getpid()]:
        del _pools[k]  # A parent's pool: its threads are not in this child.
      pool = _pools[key] = concurrent.futures.ThreadPoolExecutor(
          parallelism, thread_name_prefix=f"remote-read-{parallelism}")
  return pool


def parallel_map(fn, items, parallelism: int) -> list:
  """``[fn(x) for x in items]``, at most ``parallelism`` at a time on a
  thread pool shared by this process's callers (every reader thread's
  chunk: the requests in flight per process stay bounded). The results are
  in the order of ``items``; the first item's exception (in that order) is
  raised, and the items not yet started are cancelled. Retries inside
  ``fn`` (``Store.call``) are counted as anywhere else."""
  items = list(items)
  if parallelism <= 1 or len(items) <= 1:
    return [fn(x) for x in items]
  pool = _pool(min(int(parallelism), MAX_PARALLELISM))
  futures = [pool.submit(fn, x) for x in items]
  try:
    return [f.result() for f in futures]
  finally:
    for f in futures:
      f.cancel()  # Those not started, after an exception.


def _summary(info: dict) -> dict:
  size = info.get("size")
  validator = ""
  for k in ("ETag", "etag", "generation", "md5Hash", "LastModified",
            "Last-Modified", "mtime", "updated"):
    if info.get(k):
      validator = f"{k}={info[k]}"
      break
  return {"size": None if size is None else int(size),
          "validator": validator}


class RangeFile:
  """A read-only, seekable file over ``store.read`` of one URL, read in
  ``block``-sized ranges (one cached): what tarfile needs to scan headers
  (a forward seek within the block costs no request)."""

  def __init__(self, store: Store, url: str, size: int,
               block: int = SCAN_BLOCK):
    self.store, self.url, self.size, self.block = store, url, size, block
    self.name = basename(url)
    self.mode = "rb"
    self._pos, self._start, self._data = 0, 0, b""

  def seekable(self):
    return True

  def readable(self):
    return True

  def tell(self):
    return self._pos

  def seek(self, pos: int, whence: int = 0):
    self._pos = {0: pos, 1: self._pos + pos, 2: self.size + pos}[whence]
    return self._pos

  def read(self, n: int = -1) -> bytes:
    end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
    out = []
    while self._pos < end:
      rel = self._pos - self._start
      if not 0 <= rel < len(self._data):
        self._start = self._pos
        self._data = self.store.read(self.url, self._pos,
                                     min(self.size, self._pos + self.block))
        rel = 0
      piece = self._data[rel:rel + end - self._pos]
      out.append(piece)
      self._pos += len(piece)
    return b"".join(out)

  def close(self):
    self._data = b""


def default_index_cache() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "infcl_jax",
                      "shard_index")


def _cache_name(url: str, info: dict) -> str:
  key = json.dumps([INDEX_VERSION, scrub(url), info["size"],
                    info["validator"]])
  return f"{basename(url)}.{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def cached(store: Store, cache_dir: str, url: str, info: dict, compute):
  """``compute()`` (a JSON-able value: a shard's index), kept in
  ``cache_dir`` under a name made of the URL, size and validator. An object
  without a validator is not cached (a new version could not be told
  from the old); a cache that cannot be read or written is skipped with a
  warning, never fatal."""
  if not cache_dir or not info.get("validator") or info.get("size") is None:
    return compute()
  name = _cache_name(url, info)
  target = join(cache_dir, name)
  try:
    if is_url(target):
      text = store.read(target).decode()
    else:
      with open(target, encoding="utf-8") as f:
        text = f.read()
    return json.loads(text)["value"]
  except (OSError, ValueError, KeyError):
    pass  # Not there yet (or unreadable: written again below).
  value = compute()
  text = json.dumps({"url": scrub(url), **info, "value": value})
  try:
    if is_url(target):
      store.write(target, text.encode())
    else:
      os.makedirs(cache_dir, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".tmp-")
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
      os.replace(tmp, target)  # Atomic: readers see all of it or none.
  except (OSError, ValueError) as e:
    logging.warning("shard index cache %s not written: %s", scrub(cache_dir),
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
  return value


def default_files_cache() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "infcl_jax",
                      "remote_files")


def _atomic_write_bytes(path: str, data: bytes) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


def local_copy(store: Store, url: str, cache_dir: str = "") -> str:
  """A local copy of the object ``url``, or of the objects under it when
  it is a prefix (a "directory": a model's files), for readers that take
  local paths only. Fetched through ``store`` (retried, an outage raises
  ``Outage``) into ``cache_dir`` (default ``default_files_cache()``), under
  a name made of the URL and each object's size and version: a rerun, or
  another process of the host, reads the listing only; a new version is
  fetched again (an object without a version, every time). NotFound or
  RemoteError in one line naming the URL."""
  cache_dir = cache_dir or default_files_cache()

  def listing(fs, path):
    info = fs.info(path)
    if info.get("type") != "directory":
      return None
    base = path.rstrip("/") + "/"
    return {k[len(base):]: _summary(v) for k, v in
            fs.find(path, detail=True).items()
            if v.get("type") != "directory" and k.startswith(base)}

  files = store.call(url, listing, "list")
  if files is None:  # One object.
    info = store.info(url)
    key = json.dumps([scrub(url), info["size"], info["validator"]])
    target = os.path.join(cache_dir, hashlib.sha256(
        key.encode()).hexdigest()[:24], basename(url))
    if not (info["validator"] and os.path.isfile(target)):
      _atomic_write_bytes(target, store.read(url))
    return target
  if not files:
    raise NotFound(f"{scrub(url)} does not exist (nothing under it)")
  key = json.dumps([scrub(url), sorted((k, v["size"], v["validator"])
                                       for k, v in files.items())])
  target = os.path.join(cache_dir, hashlib.sha256(
      key.encode()).hexdigest()[:24], basename(url))
  done = os.path.join(target, ".complete")
  if all(v["validator"] for v in files.values()) and os.path.exists(done):
    return target
  root = url.rstrip("/")
  for rel in sorted(files):
    _atomic_write_bytes(os.path.join(target, *rel.split("/")),
                        store.read(f"{root}/{rel}"))
  _atomic_write_bytes(done, b"")
  return target
