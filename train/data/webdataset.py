"""webdataset tar shards (img2dataset's layout) as a random-access source.

    config.data.name = "webdataset:/data/cc3m/{00000..00331}.tar"

A shard holds members ``<key>.<ext>``: an image (``.jpg``, ``.png``,
``.webp``, ...), a caption (``.txt``) and optionally ``.json`` metadata
(img2dataset writes all three). On opening, every shard's tar headers are
read once (the standard library's ``tarfile``; no member data is read) into
an index of (shard, offset, size) per member. An example is then two
``os.pread`` calls at known offsets, from any thread, in any order: the
pipeline shuffles the whole corpus by example index, and a resumed run only
needs its position (see pipeline.py). This was measured against the
``webdataset`` package's sequential reader (BENCHMARKS.md, "Data at scale"):
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

import numpy as np

from train.data.source import BadExample

PREFIX = "webdataset:"
DEFAULT_IMAGE_EXTS = "jpg;jpeg;png;webp"
DEFAULT_CAPTION_EXT = "txt"


def expand_shards(pattern: str, what: str = "config.data.name") -> list[str]:
  """Brace-expands a shard pattern; ValueError naming a missing shard."""
  import braceexpand  # pylint: disable=import-outside-toplevel
  paths = []
  for part in pattern.split("::"):  # "a-{0..9}.tar::b-{0..3}.tar" mixes sets
    paths.extend(os.path.expanduser(p) for p in braceexpand.braceexpand(part))
  if not paths:
    raise ValueError(f"{what}: no shards in {pattern!r}")
  for p in paths:
    if not os.path.isfile(p):
      raise ValueError(f"{what}: shard {p!r} does not exist"
                       + (f" (and {len(paths) - 1} more in the pattern)"
                          if len(paths) > 1 else ""))
    if not os.access(p, os.R_OK):
      raise ValueError(f"{what}: shard {p!r} is not readable")
  return paths


def _split_name(name: str) -> tuple[str, str]:
  # webdataset's convention: the key runs to the first "." of the basename.
  d, base = os.path.split(name)
  stem, dot, ext = base.partition(".")
  return (f"{d}/{stem}" if d else stem), (ext.lower() if dot else "")


def _index_shard(path: str, image_exts: tuple, caption_ext: str,
                 json_ext: str = "json"):
  """(rows, bad): rows of (key, img_off, img_size, txt_off, txt_size,
  json_off, json_size); bad is a list of (where, reason)."""
  size = os.path.getsize(path)
  shard = os.path.basename(path)
  groups: dict[str, dict] = {}
  order = []
  bad = []
  end = 0
  try:
    with tarfile.open(path, "r:") as tar:
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
        key, ext = _split_name(m.name)
        if m.offset_data + m.size > size:
          bad.append((f"{shard}:{key}", f"truncated shard: member {m.name!r} "
                      f"needs {m.offset_data + m.size} bytes, the file has "
                      f"{size}"))
          groups.pop(key, None)
          end = size
          break
        end = m.offset_data + m.size
        if key not in groups:
          groups[key] = {}
          order.append(key)
        groups[key][ext] = (m.offset_data, m.size)
  except tarfile.ReadError as e:
    raise ValueError(f"webdataset shard {path!r} is not a readable tar file: "
                     f"{e}") from None
  if end < size:
    # Past the last member: the end-of-archive zero blocks, or a partial
    # header that tarfile stops at without a word.
    with open(path, "rb") as f:
      f.seek(end + (-end % 512))
      tail = f.read()
    if tail.strip(b"\0"):
      bad.append((f"{shard}@{end}", "truncated shard: partial member at the "
                  "end of the file"))
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


class WebDatasetSource:
  """Random access to the examples of webdataset shards (see module doc).

  Args:
    pattern: brace pattern of local shard paths ("::" joins several).
    image_exts: image extensions in order of preference ("jpg;png").
    caption_ext: the caption member's extension.
    label_field: a field of the ``.json`` member holding an integer label
      ("" = no labels: -1).
    num_threads: threads that read the shards' headers while opening.
  """

  def __init__(self, pattern: str, *, image_exts: str = DEFAULT_IMAGE_EXTS,
               caption_ext: str = DEFAULT_CAPTION_EXT, label_field: str = "",
               num_threads: int = 8, what: str = "config.data.name"):
    self.spec = PREFIX + pattern
    self.paths = expand_shards(pattern, what)
    self.image_exts = tuple(e.strip().lower().lstrip(".")
                            for e in image_exts.split(";") if e.strip())
    self.caption_ext = caption_ext.lower().lstrip(".")
    self.label_field = label_field
    index = lambda p: _index_shard(p, self.image_exts, self.caption_ext)
    with concurrent.futures.ThreadPoolExecutor(max(1, num_threads)) as pool:
      results = list(pool.map(index, self.paths))
    self.bad_at_open = [b for _, bad in results for b in bad]
    self.keys = []
    shard_ids, table = [], []
    for sid, (rows, _) in enumerate(results):
      for r in rows:
        self.keys.append(f"{os.path.basename(self.paths[sid])}:{r[0]}")
        table.append(r[1:])
        shard_ids.append(sid)
    self._shard = np.asarray(shard_ids, np.int32)
    self._table = np.asarray(table, np.int64).reshape(-1, 6)
    if not self.keys:
      raise ValueError(f"{what}: no complete (image, caption) pairs in the "
                       f"{len(self.paths)} shard(s) of {pattern!r} (image "
                       f"extensions {'/'.join(self.image_exts)}, caption "
                       f".{self.caption_ext})")

  def __len__(self):
    return len(self.keys)

  def describe(self) -> str:
    return (f"webdataset: {len(self)} examples in {len(self.paths)} shard(s)"
            f", {len(self.bad_at_open)} bad found while indexing")

  def _read(self, path: str, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
      data = os.pread(fd, size, offset)
    finally:
      os.close(fd)
    if len(data) != size:
      raise BadExample(path, f"short read ({len(data)} of {size} bytes at "
                       f"offset {offset}): the shard changed since indexing")
    return data

  def label_of(self, index: int) -> int:
    """The label of example ``index`` (its .json only; -1 without a label
    field); BadExample if the .json or its integer label is missing."""
    if not self.label_field:
      return -1
    path = self.paths[self._shard[index]]
    js_off, js_size = (int(v) for v in self._table[index, 4:])
    key = self.keys[index]
    if js_size < 0:
      raise BadExample(key, f"no .json member for label field "
                       f"{self.label_field!r}")
    try:
      return int(json.loads(self._read(path, js_off, js_size))[
          self.label_field])
    except (ValueError, KeyError, TypeError) as e:
      raise BadExample(key, f"no integer {self.label_field!r} in its .json "
                       f"({type(e).__name__}: {e})") from None

  def __getitem__(self, index: int) -> dict:
    path = self.paths[self._shard[index]]
    img_off, img_size, txt_off, txt_size = (
        int(v) for v in self._table[index, :4])
    key = self.keys[index]
    caption = self._read(path, txt_off, txt_size).decode("utf-8", "replace")
    if not caption.strip():
      raise BadExample(key, "empty caption (whitespace only)")
    label = self.label_of(index)
    return {"key": key, "image": self._read(path, img_off, img_size),
            "captions": [caption.strip()], "label": label}
