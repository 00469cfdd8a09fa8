"""Network servers for tests, on 127.0.0.1 only, started and stopped by the
tests: an S3-compatible server (moto's server mode, which s3fs's own tests
run against), a GCS-compatible one (gcp-storage-emulator's JSON API), an
HTTP file server with Range support, and a proxy that puts a bounded,
seeded number of faults between a client and any of them.

Fixtures (import them into a test module, ``from tests.netservers import
s3, http_dir``; pytest finds fixtures imported into a module):

- ``s3``: an ``S3`` (session-wide moto server) with a fresh bucket per
  test, the environment set for boto/s3fs (``AWS_ENDPOINT_URL``, test
  credentials, no ~/.aws files), ``s3.url(key)`` and ``s3.put(key, data)``;
- ``gcs``: a ``GCS`` (session-wide emulator) with a fresh bucket per test,
  the environment set for gcsfs and TensorStore (``gcs_env``: the
  endpoint, anonymous credentials, no metadata-server lookups),
  ``gcs.url(key)``, ``gcs.put(key, data)``, ``gcs.list(prefix)``;
- ``http_dir``: an ``HTTPDir`` serving a fresh temporary directory over
  HTTP with Range (``.url(name)``, ``.root``, ``.requests``);
- ``FaultProxy(upstream, ...)``: a reverse proxy with fault injection
  (``.url``, ``.requests``, ``.faults``), a context manager;
- ``OutageProxy(upstream)``: a TCP proxy that refuses connections for a
  window (an outage of the store behind it: ``.arm(window_s)``,
  ``.down(window_s)``, ``.up()``), a context manager.

Nothing listens on another address, and every fault plan is bounded in
count (``max_faults``) and in time (``delay_s``).
"""
from __future__ import annotations

import email.utils
import http.client
import http.server
import logging
import os
import random
import re
import socket
import struct
import sys
import threading
import time
import urllib.parse
import uuid

import pytest

HOST = "127.0.0.1"


class _Server(http.server.ThreadingHTTPServer):
  """Closing it also ends its open (keep-alive) connections: a client
  still holding one after the test gets a reset, not a late answer."""
  daemon_threads = True
  allow_reuse_address = True

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.open_conns, self.conns_lock = set(), threading.Lock()

  def process_request_thread(self, request, client_address):
    with self.conns_lock:
      self.open_conns.add(request)
    try:
      super().process_request_thread(request, client_address)
    finally:
      with self.conns_lock:
        self.open_conns.discard(request)

  def handle_error(self, request, client_address):
    if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
      return  # The client hung up (gcsfs drops a request it no longer needs).
    super().handle_error(request, client_address)

  def close(self):
    self.shutdown()
    self.server_close()
    with self.conns_lock:
      conns = list(self.open_conns)
    for c in conns:
      try:
        c.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass


def _serve(handler_class, **attrs):
  """A ThreadingHTTPServer on 127.0.0.1 (a free port) in a thread."""
  handler = type(handler_class.__name__, (handler_class,), attrs)
  server = _Server((HOST, 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True,
                            kwargs={"poll_interval": 0.05})
  thread.start()
  return server, thread


class _Quiet(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  # Headers and body leave in separate writes: without TCP_NODELAY the
  # body waits for the client's delayed ACK (40 ms a request).
  disable_nagle_algorithm = True

  def log_message(self, *args):  # pylint: disable=arguments-differ
    pass


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _FileHandler(_Quiet):
  """GET (with a single ``Range: bytes=a-b``) and HEAD of files under
  ``root``; each request is recorded in ``log`` as (method, path, range)."""
  root = ""
  log = None
  forbidden = None

  def _file(self):
    path = os.path.normpath(os.path.join(self.root,
                                         self.path.split("?")[0].lstrip("/")))
    if not path.startswith(self.root) or not os.path.isfile(path):
      return None
    return path

  def _head(self, code, headers):
    self.send_response(code)
    for k, v in headers.items():
      self.send_header(k, v)
    self.end_headers()

  def _reply(self, body: bool):
    self.log.append((self.command, self.path, self.headers.get("Range")))
    if self.path.split("?")[0] in self.forbidden:
      self._head(403, {"Content-Length": "0"})
      return
    path = self._file()
    if path is None:
      self._head(404, {"Content-Length": "0"})
      return
    st = os.stat(path)
    headers = {"Accept-Ranges": "bytes",
               "ETag": f'"{st.st_size:x}-{st.st_mtime_ns:x}"',
               "Last-Modified": email.utils.formatdate(st.st_mtime,
                                                       usegmt=True),
               "Content-Type": "application/octet-stream"}
    start, end, code = 0, st.st_size, 200
    m = _RANGE.match(self.headers.get("Range") or "")
    if m:
      start = int(m.group(1))
      end = min(st.st_size, int(m.group(2)) + 1) if m.group(2) else st.st_size
      if start >= st.st_size:
        self._head(416, {"Content-Range": f"bytes */{st.st_size}",
                         "Content-Length": "0"})
        return
      code = 206
      headers["Content-Range"] = f"bytes {start}-{end - 1}/{st.st_size}"
    headers["Content-Length"] = str(end - start)
    self._head(code, headers)
    if body:
      with open(path, "rb") as f:
        f.seek(start)
        self.wfile.write(f.read(end - start))

  def do_GET(self):  # pylint: disable=invalid-name
    self._reply(True)

  def do_HEAD(self):  # pylint: disable=invalid-name
    self._reply(False)


def _settle(requests: list, quiet_s: float, timeout_s: float) -> None:
  """Returns once no request has arrived for ``quiet_s`` (at most
  ``timeout_s``): readers that were still busy (a closed pipeline's reads
  in flight) are done before their server goes."""
  import time  # pylint: disable=import-outside-toplevel
  t0, n, last = time.monotonic(), -1, time.monotonic()
  while time.monotonic() - t0 < timeout_s:
    if len(requests) != n:
      n, last = len(requests), time.monotonic()
    elif time.monotonic() - last >= quiet_s:
      return
    time.sleep(0.05)


class HTTPDir:
  """A directory served over HTTP on 127.0.0.1 with Range support."""

  def __init__(self, root: str):
    self.root = os.path.realpath(root)
    self.requests = []  # (method, path, Range header), in arrival order.
    self.forbidden = set()  # URL paths answered 403.
    self._server, self._thread = _serve(_FileHandler, root=self.root,
                                        log=self.requests,
                                        forbidden=self.forbidden)
    self.port = self._server.server_address[1]
    self.base = f"http://{HOST}:{self.port}"

  def url(self, name: str) -> str:
    return f"{self.base}/{name}"

  def settle(self, quiet_s: float = 0.5, timeout_s: float = 20.0) -> None:
    _settle(self.requests, quiet_s, timeout_s)

  def close(self):
    self._server.close()
    self._thread.join(5)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


_S3_503 = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown'
           b'</Code><Message>Please reduce your request rate.</Message>'
           b'</Error>')


class _ProxyHandler(_Quiet):
  proxy = None

  def _forward(self):
    p = self.proxy
    length = int(self.headers.get("Content-Length") or 0)
    body = self.rfile.read(length) if length else None
    fault = p.decide(self.command, self.path, self.headers.get("Range"))
    if fault == "503":
      self.send_response(503)
      self.send_header("Content-Type", "application/xml")
      self.send_header("Content-Length", str(len(_S3_503)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(_S3_503)
      return
    if fault == "slow":
      p.slept.wait(p.delay_s)  # Bounded; ends early when the proxy closes.
    conn = http.client.HTTPConnection(*p.upstream, timeout=30)
    try:
      headers = {k: v for k, v in self.headers.items()
                 if k.lower() not in ("connection", "keep-alive")}
      conn.request(self.command, self.path, body=body, headers=headers)
      resp = conn.getresponse()
      data = resp.read()
    except OSError:  # The upstream is gone: a gateway error.
      self.send_response(502)
      self.send_header("Content-Length", "0")
      self.end_headers()
      return
    finally:
      conn.close()
    self.send_response(resp.status, resp.reason)
    for k, v in resp.getheaders():
      if k.lower() not in ("connection", "keep-alive", "transfer-encoding",
                           "content-length", "server", "date"):
        self.send_header(k, v)
    length = (resp.getheader("Content-Length", "0") if self.command == "HEAD"
              else str(len(data)))
    self.send_header("Content-Length", length)
    self.end_headers()
    if self.command == "HEAD":
      return
    if fault == "reset" and len(data) > 1:
      # Half the body, then a TCP reset: a truncated response.
      self.wfile.write(data[:len(data) // 2])
      self.wfile.flush()
      self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                 struct.pack("ii", 1, 0))
      self.close_connection = True
      return
    self.wfile.write(data)

  do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward  # noqa: N815


class FaultProxy:
  """A reverse proxy to ``upstream`` ((host, port) on 127.0.0.1) that
  answers a seeded fraction of the requests of ``methods`` (GET, HEAD)
  with a fault (only those whose path and query match the regex ``paths``,
  if given).

  Whether a request is faulted is a pure function of (seed, method, path,
  Range): the same requests fail on every run, whatever the order they
  arrive in, and a request is faulted at most once (its retry goes
  through). At most ``max_faults`` faults in all. ``kinds`` are drawn from:
  "503" (an S3-style SlowDown error), "reset" (half the body, then a TCP
  reset), "slow" (answered after ``delay_s``). ``requests`` and ``faults``
  record what happened.
  """

  def __init__(self, upstream, *, seed: int = 0, fraction: float = 0.0,
               kinds=("503", "reset", "slow"), max_faults: int = 20,
               delay_s: float = 0.2, methods=("GET", "HEAD"),
               paths: str | None = None):
    host, port = upstream
    assert host in (HOST, "localhost"), "the proxy forwards to 127.0.0.1 only"
    self.upstream = (HOST, port)
    self.seed, self.fraction, self.kinds = seed, fraction, tuple(kinds)
    self.methods = tuple(methods)
    self.paths = re.compile(paths) if paths else None
    self.max_faults, self.delay_s = max_faults, min(delay_s, 5.0)
    self.requests, self.faults = [], []
    self._faulted = set()
    self._lock = threading.Lock()
    self.slept = threading.Event()
    self._server, self._thread = _serve(_ProxyHandler, proxy=self)
    self.port = self._server.server_address[1]
    self.url = f"http://{HOST}:{self.port}"

  def decide(self, method: str, path: str, rng_header):
    request = (method, path, rng_header)
    with self._lock:
      self.requests.append(request)
      if method not in self.methods or request in self._faulted or (
          self.paths and not self.paths.search(path)):
        return None
      if len(self.faults) >= self.max_faults:
        return None
      rng = random.Random(f"{self.seed}|{method}|{path}|{rng_header}")
      if rng.random() >= self.fraction:
        return None
      kinds = [k for k in self.kinds if method == "GET" or k != "reset"]
      if not kinds:
        return None
      kind = kinds[rng.randrange(len(kinds))]
      self._faulted.add(request)
      self.faults.append((kind, *request))
      return kind

  def settle(self, quiet_s: float = 0.5, timeout_s: float = 20.0) -> None:
    _settle(self.requests, quiet_s, timeout_s)

  def close(self):
    self.slept.set()
    self._server.close()
    self._thread.join(5)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class OutageProxy:
  """A TCP proxy on 127.0.0.1 to ``upstream`` (host, port) that can stop
  serving for a window, as a store that goes away and comes back.

  During an outage nothing listens on the proxy's port (a new connection
  is refused) and the connections open when it began are cut (reset).
  ``arm(window_s)``: the outage begins at the next request (the next bytes
  a client sends, on a new connection or a kept-alive one, which is cut),
  so that it meets a read whenever that comes; ``down(window_s)``: it
  begins now. A window of None lasts until
  ``up()``. ``outages`` records [start, end] (time.monotonic(); end None
  while it lasts), ``accepted`` the connections served.
  """

  def __init__(self, upstream):
    host, port = upstream
    assert host in (HOST, "localhost"), "the proxy forwards to 127.0.0.1 only"
    self.upstream = (HOST, port)
    self.outages, self.accepted = [], 0
    self._lock = threading.Lock()
    self._conns = set()
    self._armed, self._until, self._closed = None, None, False
    self._listener = self._listen(0)
    self.port = self._listener.getsockname()[1]
    self.url = f"http://{HOST}:{self.port}"
    self._thread = threading.Thread(target=self._serve, daemon=True)
    self._thread.start()

  @staticmethod
  def _listen(port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, port))
    sock.listen(64)
    sock.settimeout(0.02)
    return sock

  def arm(self, window_s):
    with self._lock:
      self._armed = ("armed", window_s)

  def down(self, window_s):
    with self._lock:
      self._begin(window_s)

  def up(self):
    with self._lock:
      if self._until is not None:
        self._until = time.monotonic()

  @property
  def is_down(self) -> bool:
    return self._until is not None

  def _begin(self, window_s):  # With the lock held.
    if self._until is not None:
      return
    now = time.monotonic()
    self._until = float("inf") if window_s is None else now + window_s
    self.outages.append([now, None])
    self._listener.close()
    for c in list(self._conns):
      _reset(c)
    self._conns.clear()

  def _serve(self):
    while not self._closed:
      with self._lock:
        down = self._until is not None
        if down and time.monotonic() >= self._until:  # The window is over.
          self._until, down = None, False
          self.outages[-1][1] = time.monotonic()
          self._listener = self._listen(self.port)
      if down:
        time.sleep(0.01)
        continue
      try:
        conn, _ = self._listener.accept()
      except (socket.timeout, OSError):
        continue
      with self._lock:
        try:
          far = socket.create_connection(self.upstream, timeout=30)
        except OSError:
          _reset(conn)
          continue
        conn.settimeout(None)
        far.settimeout(None)
        self.accepted += 1
        self._conns.update((conn, far))
      for a, b, ask in ((conn, far, True), (far, conn, False)):
        threading.Thread(target=self._pipe, args=(a, b, ask),
                         daemon=True).start()

  def _pipe(self, src, dst, asks):
    try:
      while True:
        data = src.recv(65536)
        if not data:
          break
        if asks:  # A client's request: the armed outage begins.
          with self._lock:
            if self._armed is not None:
              window, self._armed = self._armed[1], None
              self._begin(window)
              break
        dst.sendall(data)
    except OSError:
      pass
    for sock in (src, dst):
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    with self._lock:
      self._conns.discard(src)

  def close(self):
    self._closed = True
    self._thread.join(5)
    with self._lock:
      self._listener.close()
      for c in list(self._conns):
        _reset(c)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _reset(sock):
  """Closes ``sock`` with a TCP reset (the peer sees ECONNRESET)."""
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                    struct.pack("ii", 1, 0))
    sock.close()
  except OSError:
    pass


class _Bucket:
  """What the test buckets share: ``put_dir`` over their ``put``."""

  def url(self, key: str) -> str:
    raise NotImplementedError

  def put(self, key: str, data: bytes) -> str:
    raise NotImplementedError

  def put_dir(self, local_dir: str, prefix: str) -> str:
    """Uploads the files of ``local_dir`` under ``prefix``; its URL."""
    for name in sorted(os.listdir(local_dir)):
      path = os.path.join(local_dir, name)
      if os.path.isfile(path):
        with open(path, "rb") as f:
          self.put(f"{prefix}/{name}", f.read())
    return self.url(prefix)


class S3(_Bucket):
  """A bucket on the moto S3 server at ``endpoint`` (127.0.0.1)."""

  def __init__(self, endpoint: str, bucket: str):
    self.endpoint, self.bucket = endpoint, bucket
    host, port = endpoint.rsplit("//", 1)[1].split(":")
    self.host_port = (host, int(port))
    self.client = _boto_client(endpoint)
    self.client.create_bucket(Bucket=bucket)

  def url(self, key: str) -> str:
    return f"s3://{self.bucket}/{key}"

  def put(self, key: str, data: bytes) -> str:
    self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
    return self.url(key)

  def delete(self, key: str) -> None:
    self.client.delete_object(Bucket=self.bucket, Key=key)


# The environment of the S3 clients under test: moto's endpoint and test
# credentials; no ~/.aws files, no instance metadata lookups.
def s3_env(endpoint: str) -> dict:
  return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
          "AWS_CONFIG_FILE": os.devnull,
          "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
          "AWS_EC2_METADATA_DISABLED": "true"}


def _boto_client(endpoint: str):
  import boto3  # pylint: disable=import-outside-toplevel
  env = s3_env(endpoint)
  return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])


@pytest.fixture(scope="session")
def moto_endpoint():
  """The session's moto S3 server on 127.0.0.1 (a free port)."""
  pytest.importorskip("moto.server", reason="the dev extra (moto[server])")
  from moto.server import ThreadedMotoServer  # pylint: disable=import-outside-toplevel
  # werkzeug (moto's server) logs every request at INFO.
  logging.getLogger("werkzeug").setLevel(logging.WARNING)
  server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
  server.start()
  host, port = server.get_host_and_port()
  yield f"http://{host}:{port}"
  server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
  """A fresh bucket on the moto server, with the environment of an S3
  client pointed at it (see ``s3_env``)."""
  pytest.importorskip("s3fs", reason="the cloud extra")
  for k, v in s3_env(moto_endpoint).items():
    monkeypatch.setenv(k, v)
  return S3(moto_endpoint, f"test-{uuid.uuid4().hex[:12]}")


_GCS_OBJECT = re.compile(r"^(?:/download)?/storage/v1/b/([^/]+)/o/(.+)$")


class _GCSServer:
  """gcp-storage-emulator's JSON API (in memory) on 127.0.0.1, in a
  thread: its request handler on a threading server whose requests are
  handled one at a time (its storage is not thread-safe); each request is
  recorded in ``requests`` as (method, path, Range header).

  An object's content is answered with its generation in
  ``x-goog-generation``, as GCS does (TensorStore's GCS driver, which
  orbax writes through, reads an object's version from it; the emulator
  leaves it out).
  """

  def __init__(self):
    from gcp_storage_emulator import server as emulator  # pylint: disable=import-outside-toplevel
    from gcp_storage_emulator.storage import Storage  # pylint: disable=import-outside-toplevel
    logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)
    self.storage = Storage(use_memory_fs=True)
    self.requests = []
    lock, log, storage = threading.Lock(), self.requests, self.storage

    class Handler(emulator.RequestHandler):
      def __init__(self, *args, **kwargs):
        super().__init__(storage, *args, **kwargs)

      def _serialized(self, method):
        log.append((self.command, self.path, self.headers.get("Range")))
        self.status_sent = None
        with lock:
          getattr(super(), method)()

      def send_response(self, code, message=None):
        self.status_sent = code
        super().send_response(code, message)

      def end_headers(self):
        if self.command == "GET" and self.status_sent in (200, 206):
          parts = urllib.parse.urlsplit(self.path)
          m = _GCS_OBJECT.match(parts.path)
          if m and "alt=media" in parts.query:
            obj = storage.objects.get(m.group(1), {}).get(
                urllib.parse.unquote(m.group(2)))
            if obj:
              self.send_header("x-goog-generation", obj["generation"])
        super().end_headers()

      def do_GET(self):  # pylint: disable=invalid-name
        self._serialized("do_GET")

      def do_POST(self):  # pylint: disable=invalid-name
        self._serialized("do_POST")

      def do_PUT(self):  # pylint: disable=invalid-name
        self._serialized("do_PUT")

      def do_PATCH(self):  # pylint: disable=invalid-name
        self._serialized("do_PATCH")

      def do_DELETE(self):  # pylint: disable=invalid-name
        self._serialized("do_DELETE")

      def log_message(self, *args):  # pylint: disable=arguments-differ
        pass

    self._server = _Server((HOST, 0), Handler)
    self._thread = threading.Thread(target=self._server.serve_forever,
                                    daemon=True,
                                    kwargs={"poll_interval": 0.05})
    self._thread.start()
    self.host_port = (HOST, self._server.server_address[1])
    self.endpoint = f"http://{HOST}:{self.host_port[1]}"

  def create_bucket(self, name: str) -> None:
    from gcp_storage_emulator.handlers import buckets  # pylint: disable=import-outside-toplevel
    buckets.create_bucket(name, self.storage)

  def close(self):
    self._server.close()
    self._thread.join(5)


class GCS(_Bucket):
  """A bucket on the GCS emulator. Objects are put, listed and deleted
  through the emulator's JSON API over HTTP (not gcsfs, the client under
  test)."""

  def __init__(self, server: _GCSServer, bucket: str):
    self.server, self.bucket = server, bucket
    self.endpoint, self.host_port = server.endpoint, server.host_port
    self.requests = server.requests
    server.create_bucket(bucket)

  def url(self, key: str) -> str:
    return f"gs://{self.bucket}/{key}"

  def _call(self, method, path, body=None, ok=(200,)):
    import json  # pylint: disable=import-outside-toplevel
    conn = http.client.HTTPConnection(*self.host_port, timeout=30)
    try:
      conn.request(method, path, body=body)
      resp = conn.getresponse()
      data = resp.read()
    finally:
      conn.close()
    assert resp.status in ok, (method, path, resp.status, data[:200])
    return json.loads(data) if data else None

  def put(self, key: str, data: bytes) -> str:
    q = urllib.parse.quote(key, safe="")
    self._call("POST", f"/upload/storage/v1/b/{self.bucket}/o"
               f"?uploadType=media&name={q}", data)
    return self.url(key)

  def list(self, prefix: str = "") -> list:
    q = urllib.parse.quote(prefix, safe="")
    out = self._call("GET", f"/storage/v1/b/{self.bucket}/o?prefix={q}")
    return sorted(o["name"] for o in out.get("items") or [])

  def delete(self, key: str) -> None:
    q = urllib.parse.quote(key, safe="")
    self._call("DELETE", f"/storage/v1/b/{self.bucket}/o/{q}",
               ok=(200, 204))


# The environment of the GCS clients under test (gcsfs, TensorStore): the
# emulator's endpoint and anonymous credentials; no credential files and no
# metadata-server lookups. gcsfs's default class asks a bucket's layout over
# gRPC, which the emulator does not serve: the JSON API class instead.
def gcs_env(endpoint: str) -> dict:
  return {"STORAGE_EMULATOR_HOST": endpoint,
          "FSSPEC_GS_TOKEN": "anon",
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
          "TENSORSTORE_GCS_HTTP_URL": endpoint,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
          "NO_GCE_CHECK": "True",
          "GCE_METADATA_HOST": f"{HOST}:9", "GCE_METADATA_IP": f"{HOST}:9",
          "GCE_METADATA_ROOT": f"{HOST}:9"}


@pytest.fixture(scope="session")
def gcs_server():
  """The session's GCS emulator on 127.0.0.1 (a free port)."""
  pytest.importorskip("gcp_storage_emulator",
                      reason="the dev extra (gcp-storage-emulator)")
  server = _GCSServer()
  yield server
  server.close()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
  """A fresh bucket on the GCS emulator, with the environment of a GCS
  client pointed at it (see ``gcs_env``). What gcsfs and fsspec read from
  the environment when they are imported (the anonymous token, gcsfs's
  JSON API class for gs://) is set here too, for this test."""
  pytest.importorskip("gcsfs", reason="the cloud extra")
  import fsspec  # pylint: disable=import-outside-toplevel
  import fsspec.config  # pylint: disable=import-outside-toplevel
  import gcsfs.core  # pylint: disable=import-outside-toplevel
  for k, v in gcs_env(gcs_server.endpoint).items():
    monkeypatch.setenv(k, v)
  monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})
  previous = {p: fsspec.get_filesystem_class(p) for p in ("gs", "gcs")}
  for p in previous:
    fsspec.register_implementation(p, gcsfs.core.GCSFileSystem, clobber=True)
  yield GCS(gcs_server, f"test-{uuid.uuid4().hex[:12]}")
  for p, cls in previous.items():
    fsspec.register_implementation(p, cls, clobber=True)


@pytest.fixture
def http_dir(tmp_path):
  """A fresh directory served over HTTP (Range) on 127.0.0.1."""
  pytest.importorskip("aiohttp", reason="the cloud extra")
  root = tmp_path / "www"
  root.mkdir()
  with HTTPDir(str(root)) as server:
    yield server
