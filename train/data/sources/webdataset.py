"""webdataset tar shards (img2dataset's layout) as a random-access source.

    config.data.name = "webdataset:/data/cc3m/{00000..00331}.tar"

A shard holds members ``<key>.<ext>``: an image (``.jpg``, ``.png``,
``.webp``, ...), a caption (``.txt``) and optionally ``.json`` metadata
(img2dataset writes all three). On opening, every shard's tar headers are
read once (the standard library's ``tarfile``; no member data is read) into
an index of (shard, offset, size) per member. An example is then two
``os.pread`` calls at known offsets, from any thread, in any order: the
pipeline shuffles the whole corpus by example index, and a resumed run only
needs its position (see train/data/pipeline.py). This was measured against
the ``webdataset`` package's sequential reader (BENCHMARKS.md "Data path"):
reading members is not the bottleneck either way (JPEG decoding is), and
random access is what makes exact resumption and a full shuffle free.

Bad data found while indexing is listed in ``bad_at_open`` (and skipped):
a member without its pair (an image without a caption or the reverse), an
empty caption member, and a truncated shard (its incomplete final member).
A shard that is missing or is not a tar file fails at start-up.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import tarfile

import braceexpand
import numpy as np

from train.data.sources import contract
from train.data.sources import remote
from train.data.sources.contract import BadExample

PREFIX = "webdataset:"
PREFIXES = (PREFIX,)
# Shards indexed between two calls of ``between_chunks`` (the trainer's
# preemption check: a signal while indexing stops the run after the chunk).
INDEX_CHUNK = 64
DEFAULT_IMAGE_EXTS = "jpg;jpeg;png;webp"
DEFAULT_CAPTION_EXT = "txt"


def expand_shards(pattern: str, what: str = "config.data.name",
                  store: remote.Store | None = None,
                  num_threads: int = 16) -> list[str]:
  """Brace-expands a shard pattern; ValueError naming a missing shard (a
  remote one is looked up with ``store``, in parallel)."""
  return _expand(pattern, what, store, num_threads)[0]


def _expand(pattern, what, store, num_threads):
  """(paths, {url: info} of the remote ones)."""
  paths = []
  for part in pattern.split("::"):  # "a-{0..9}.tar::b-{0..3}.tar" mixes sets
    paths.extend(p if remote.is_url(p) else remote.local_path(p)
                 for p in braceexpand.braceexpand(part))
  if not paths:
    raise ValueError(f"{what}: no shards in {pattern!r}")
  urls = [p for p in paths if remote.is_url(p)]
  infos, missing = {}, []
  if urls:
    infos = _infos(urls, store or remote.Store(), num_threads, what)
    missing = [p for p in urls if infos[p] is None]
  missing += [p for p in paths if not remote.is_url(p)
              and not os.path.isfile(p)]
  if missing:
    first = min(missing, key=paths.index)
    raise ValueError(f"{what}: shard {remote.scrub(first)!r} does not exist"
                     + _missing_count(len(missing), len(paths)))
  for p in urls:
    if infos[p].get("size") is None:
      raise ValueError(f"{what}: shard {remote.scrub(p)!r}: the server "
                       "gives no size (Content-Length)")
  for p in paths:
    if not remote.is_url(p) and not os.access(p, os.R_OK):
      raise ValueError(f"{what}: shard {p!r} is not readable")
  return paths, infos


def _missing_count(missing: int, total: int) -> str:
  """How many of the pattern's shards are missing, in words."""
  if total == 1:
    return ""
  return (f" ({missing} of the {total} shards in the pattern "
          f"{'is' if missing == 1 else 'are'} missing)")


def _infos(urls, store, num_threads, what) -> dict:
  """{url: store.info(url), or None for a missing one}, looked up in
  parallel; one line naming the first that is unreadable."""
  def info(u):
    try:
      return store.info(u)
    except remote.NotFound:
      return None
    except remote.RemoteError as e:
      raise ValueError(f"{what}: shard {e}") from None
  with concurrent.futures.ThreadPoolExecutor(
      max(1, min(num_threads, len(urls)))) as pool:
    return dict(zip(urls, pool.map(info, urls)))


def _split_name(name: str) -> tuple[str, str]:
  # webdataset's convention: the key runs to the first "." of the basename.
  d, base = os.path.split(name)
  stem, dot, ext = base.partition(".")
  return (f"{d}/{stem}" if d else stem), (ext.lower() if dot else "")


def _scan(fileobj, size: int, shard: str, label: str):
  """A shard's tar headers -> (members, bad): members [name, data offset,
  size] of its files, in order; bad (where, reason) of a truncated shard.
  Reads headers only (tarfile seeks past the data)."""
  members, bad = [], []
  end = 0
  try:
    with tarfile.open(fileobj=fileobj, mode="r:") as tar:
      while True:
        try:
          m = tar.next()
        except tarfile.ReadError as e:  # A corrupt header mid-shard.
          bad.append((f"{shard}@{tar.offset}", f"truncated shard: {e}"))
          break
        if m is None:
          break
        if not m.isfile():
          continue
        if m.offset_data + m.size > size:
          key, _ = _split_name(m.name)
          bad.append((f"{shard}:{key}", f"truncated shard: member {m.name!r} "
                      f"needs {m.offset_data + m.size} bytes, the file has "
                      f"{size}"))
          members.append([m.name, -1, -1])  # Drops its key's other members.
          end = size
          break
        end = m.offset_data + m.size
        members.append([m.name, m.offset_data, m.size])
  except tarfile.ReadError as e:
    raise ValueError(f"webdataset shard {label!r} is not a readable tar "
                     f"file: {e}") from None
  if end < size:
    # Past the last member: the end-of-archive zero blocks, or a partial
    # header that tarfile stops at without a word.
    fileobj.seek(end + (-end % 512))
    tail = fileobj.read()
    if tail.strip(b"\0"):
      bad.append((f"{shard}@{end}", "truncated shard: partial member at the "
                  "end of the file"))
  return members, bad


def _rows(members, bad, shard: str, image_exts: tuple, caption_ext: str,
          json_ext: str = "json"):
  """(rows, bad): rows of (key, img_off, img_size, txt_off, txt_size,
  json_off, json_size) from a shard's members; bad is a list of (where,
  reason)."""
  groups: dict[str, dict] = {}
  order = []
  bad = [tuple(b) for b in bad]
  for name, offset, size in members:
    key, ext = _split_name(name)
    if offset < 0:  # The truncated final member: its key is dropped.
      groups.pop(key, None)
      continue
    if key not in groups:
      groups[key] = {}
      order.append(key)
    groups[key][ext] = (offset, size)
  rows = []
  for key in order:
    g = groups.get(key)
    if g is None:
      continue
    where = f"{shard}:{key}"
    img = next((g[e] for e in image_exts if e in g), None)
    txt = g.get(caption_ext)
    if img is None and txt is None:
      bad.append((where, f"neither an image ({'/'.join(image_exts)}) nor a "
                  f"caption (.{caption_ext}) member (has {sorted(g)})"))
    elif img is None:
      bad.append((where, f"orphan member: .{caption_ext} without an image "
                  f"({'/'.join(image_exts)})"))
    elif txt is None:
      bad.append((where, f"orphan member: image without a caption "
                  f".{caption_ext}"))
    elif txt[1] == 0:
      bad.append((where, f"empty caption (.{caption_ext} has 0 bytes)"))
    else:
      js = g.get(json_ext, (0, -1))
      rows.append((key, img[0], img[1], txt[0], txt[1], js[0], js[1]))
  return rows, bad


def _index_shard(path: str, image_exts: tuple, caption_ext: str,
                 json_ext: str = "json", *, store=None, info=None,
                 index_cache: str = ""):
  """(rows, bad) of one shard (see ``_rows``). A remote shard's headers
  are read in large sequential ranges, and kept in ``index_cache``."""
  shard = remote.basename(path)
  if remote.is_url(path):
    def scan():
      members, bad = _scan(remote.RangeFile(store, path, info["size"]),
                           info["size"], shard, remote.scrub(path))
      return {"members": members, "bad": bad}
    index = remote.cached(store, index_cache, path, info, scan)
    members, bad = index["members"], index["bad"]
  else:
    with open(path, "rb") as f:
      members, bad = _scan(f, os.path.getsize(path), shard, path)
  return _rows(members, bad, shard, image_exts, caption_ext, json_ext)


class WebDatasetSource:
  """Random access to the examples of webdataset shards (see module doc).

  Args:
    pattern: brace pattern of shard paths or URLs ("::" joins several).
    image_exts: image extensions in order of preference ("jpg;png").
    caption_ext: the caption member's extension.
    label_field: a field of the ``.json`` member holding an integer label
      ("" = no labels: -1).
    num_threads: threads that read the shards' headers while opening.
    store: reads remote shards (train/data/sources/remote.py; default: the
      standard environment's credentials, default retries).
    index_cache: where remote shards' indexes are kept ("" = not kept).
    between_chunks: called as ``between_chunks(shards_done, shards)``
      after each INDEX_CHUNK shards indexed (the trainer's preemption
      check; with a third argument, the ``remote.Outage`` that stopped the
      chunk); it may raise to stop the indexing there.
  """

  def __init__(self, pattern: str, *, image_exts: str = DEFAULT_IMAGE_EXTS,
               caption_ext: str = DEFAULT_CAPTION_EXT, label_field: str = "",
               num_threads: int = 8, what: str = "config.data.name",
               store: remote.Store | None = None,
               index_cache: str = "", between_chunks=None):
    # The pattern without the secrets a URL may hold (a signed URL's
    # query): the spec is logged and kept in checkpoints.
    self.spec = PREFIX + remote.scrub_pattern(pattern)
    self.store = store or remote.Store()
    self.paths, infos = _expand(pattern, what, self.store,
                                max(num_threads, 16))
    self._remote = [remote.is_url(p) for p in self.paths]
    self.is_remote = any(self._remote)
    self.image_exts = tuple(e.strip().lower().lstrip(".")
                            for e in image_exts.split(";") if e.strip())
    self.caption_ext = caption_ext.lower().lstrip(".")
    self.label_field = label_field
    index = lambda p: _index_shard(p, self.image_exts, self.caption_ext,
                                   store=self.store, info=infos.get(p),
                                   index_cache=index_cache)
    # Remote shards are latency-bound: more of them in flight.
    threads = max(1, num_threads) * (4 if infos else 1)
    results = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      for a in range(0, len(self.paths), INDEX_CHUNK):
        try:
          results += pool.map(index, self.paths[a:a + INDEX_CHUNK])
        except remote.RemoteError as e:
          raise ValueError(f"{what}: shard {e}") from None
        except remote.Outage as e:
          if between_chunks is not None:  # It stops the run (all processes).
            between_chunks(len(results), len(self.paths), e)
          raise
        if between_chunks is not None:
          between_chunks(len(results), len(self.paths))
    self.bad_at_open = [b for _, bad in results for b in bad]
    self.keys = []
    shard_ids, table = [], []
    for sid, (rows, _) in enumerate(results):
      name = remote.basename(self.paths[sid])
      for r in rows:
        self.keys.append(f"{name}:{r[0]}")
        table.append(r[1:])
        shard_ids.append(sid)
    self._shard = np.asarray(shard_ids, np.int32)
    self._table = np.asarray(table, np.int64).reshape(-1, 6)
    if not self.keys:
      raise ValueError(f"{what}: no complete (image, caption) pairs in the "
                       f"{len(self.paths)} shard(s) of "
                       f"{remote.scrub(pattern)!r} (image extensions "
                       f"{'/'.join(self.image_exts)}, caption "
                       f".{self.caption_ext})")

  def __len__(self):
    return len(self.keys)

  def describe(self) -> str:
    where = (f" on {remote.protocol(self.paths[0])}://" if any(self._remote)
             else "")
    return (f"webdataset: {len(self)} examples in {len(self.paths)} shard(s)"
            f"{where}, {len(self.bad_at_open)} bad found while indexing")

  def _read_local(self, path: str, spans: list) -> list:
    fd = os.open(path, os.O_RDONLY)
    try:
      out = [os.pread(fd, size, offset) for offset, size in spans]
    finally:
      os.close(fd)
    for data, (offset, size) in zip(out, spans):
      if len(data) != size:
        raise BadExample(path, f"short read ({len(data)} of {size} bytes at "
                         f"offset {offset}): the shard changed since indexing")
    return out

  def _read_remote(self, url: str, spans: list) -> list:
    # Members of one example sit side by side in a tar (key.jpg, key.json,
    # key.txt): one request for all of them when little lies between.
    lo = min(o for o, _ in spans)
    hi = max(o + s for o, s in spans)
    if hi == lo:  # Empty members only: no request (a Range of 0 bytes).
      return [b"" for _ in spans]
    try:
      if hi - lo <= sum(s for _, s in spans) + (64 << 10):
        data = self.store.read(url, lo, hi)
        return [data[o - lo:o - lo + s] for o, s in spans]
      return [self.store.read(url, o, o + s) for o, s in spans]
    except remote.NotFound as e:
      raise remote.NotFound(f"webdataset shard {e}; it was there when the "
                            "run started") from None

  def _members(self, index: int, which: tuple) -> list:
    """The bytes of members ``which`` (0 image, 1 caption, 2 json)."""
    sid = self._shard[index]
    row = self._table[index]
    spans = [(int(row[2 * w]), int(row[2 * w + 1])) for w in which]
    read = self._read_remote if self._remote[sid] else self._read_local
    return read(self.paths[sid], spans)

  def _label(self, index: int, js) -> int:
    if not self.label_field:
      return -1
    key = self.keys[index]
    if js is None:
      raise BadExample(key, f"no .json member for label field "
                       f"{self.label_field!r}")
    try:
      return int(json.loads(js)[self.label_field])
    except (ValueError, KeyError, TypeError) as e:
      raise BadExample(key, f"no integer {self.label_field!r} in its .json "
                       f"({type(e).__name__}: {e})") from None

  def _has_json(self, index: int) -> bool:
    return self._table[index, 5] >= 0

  def label_of(self, index: int) -> int:
    """The label of example ``index`` (its .json only; -1 without a label
    field); BadExample if the .json or its integer label is missing."""
    if not self.label_field:
      return -1
    js = (self._members(index, (2,))[0] if self._has_json(index) else None)
    return self._label(index, js)

  def read_many(self, indices, parallelism: int) -> list:
    """``source[i]`` (or the BadExample it raised) for each index, in order,
    up to ``parallelism`` requests at a time (``remote.parallel_map``)."""
    return remote.parallel_map(
        lambda i: contract.get_or_bad(self, int(i)), indices, parallelism)

  def __getitem__(self, index: int) -> dict:
    key = self.keys[index]
    want_json = bool(self.label_field) and self._has_json(index)
    parts = self._members(index, (0, 1, 2) if want_json else (0, 1))
    image, text = parts[0], parts[1]
    try:
      caption = text.decode("utf-8")
    except UnicodeDecodeError as e:
      raise BadExample(key, f"caption is not valid UTF-8 (byte "
                       f"{text[e.start]:#04x} at {e.start})") from None
    if not caption.strip():
      raise BadExample(key, "empty caption (whitespace only)")
    label = self._label(index, parts[2] if want_json else None)
    return {"key": key, "image": image, "captions": [caption.strip()],
            "label": label}


def index_cache_of(data) -> str:
  """config.data.shard_index_cache: "" = the default directory, "none" =
  no cache."""
  value = data.get("shard_index_cache", "")
  if value == "none":
    return ""
  return value or remote.default_index_cache()


def check_spec(name: str, what: str, store) -> None:
  """The shards of ``name`` exist and are readable (no indexing)."""
  expand_shards(name[len(PREFIX):], what, store)


def open_spec(data, name: str, *, what: str, between_chunks=None):
  """The ``WebDatasetSource`` of ``name`` with config.data's settings."""
  return WebDatasetSource(
      name[len(PREFIX):], image_exts=data.wds_image_exts,
      caption_ext=data.wds_caption_ext, label_field=data.wds_label_field,
      num_threads=max(data.num_threads, 4), what=what,
      store=remote.make_store(data), index_cache=index_cache_of(data),
      between_chunks=between_chunks)
