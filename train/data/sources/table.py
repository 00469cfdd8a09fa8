"""CSV / TSV / JSONL tables of (image path, caption) as a random-access source.

    config.data.name = "csv:/data/pairs.csv"      # or a .tsv file
    config.data.name = "jsonl:/data/pairs.jsonl"

Columns are named by ``config.data.table_image_column`` and
``table_caption_column`` (and optionally ``table_label_column``); image paths
are relative to the table file's directory unless absolute. The table and
its images may be fsspec URLs (``s3://``, ``gs://``, ``https://``; a
relative image path of a remote table is relative to its URL), read through
train/data/sources/remote.py: an image that is not there is a bad example,
like a local one; other permanent failures stop the run in one line. A JSONL
caption may be a list of captions (one is drawn per epoch). The table is
read whole at start-up (the standard library's csv and json: a million rows
take seconds); the images are read when their example is. Rows with an empty
caption or no image path are listed in ``bad_at_open``; an image file that
cannot be read, or does not decode, is skipped when it is reached. Rows
that name the same image file share an image id (the group of
``config.loss.groups = "image"``).
"""
from __future__ import annotations

import csv
import io
import json
import os

from train.data.sources import contract
from train.data.sources import remote
from train.data.sources.contract import BadExample

PREFIXES = ("csv:", "tsv:", "jsonl:")


def _rows(path: str, fmt: str, what: str, store=None):
  try:
    if remote.is_url(path):
      f = io.StringIO(store.read(path).decode("utf-8", "surrogateescape"),
                      newline="")
    else:
      # Bytes that are not UTF-8 become lone surrogates: the row holding
      # them is bad (``_not_utf8``), the rest of the table is read.
      f = open(path, newline="", encoding="utf-8", errors="surrogateescape")
  except remote.NotFound:
    raise ValueError(f"{what}: table {remote.scrub(path)!r} does not "
                     "exist") from None
  except remote.RemoteError as e:
    raise ValueError(f"{what}: table {e}") from None
  except OSError as e:
    raise ValueError(f"{what}: cannot read table {path!r}: "
                     f"{e.strerror or e}") from None
  with f:
    if fmt == "jsonl":
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except ValueError as e:
          yield n, None, f"not a JSON object ({e})"
          continue
        if not isinstance(row, dict):
          yield n, None, f"not a JSON object (a {type(row).__name__})"
        else:
          yield n, row, ""
    else:
      reader = csv.DictReader(f, delimiter="\t" if fmt == "tsv" else ",")
      if reader.fieldnames is None:
        raise ValueError(f"{what}: table {path!r} is empty (no header row)")
      for row in reader:
        yield reader.line_num, row, ""


def _not_utf8(text: str) -> str:
  """"" for valid UTF-8 text read with surrogateescape, else the reason."""
  try:
    text.encode("utf-8")
    return ""
  except UnicodeEncodeError as e:
    byte = ord(text[e.start]) - 0xDC00
    return f"is not valid UTF-8 (byte {byte:#04x} at character {e.start})"


class TableSource:
  """Random access to the (image file, caption) rows of a table.

  Args:
    spec: "csv:PATH", "tsv:PATH" or "jsonl:PATH" ("csv:" with a .tsv or
      .jsonl file reads that format).
    image_column, caption_column, label_column: column names ("" = no
      labels: -1).
  """

  def __init__(self, spec: str, *, image_column: str, caption_column: str,
               label_column: str = "", what: str = "config.data.name",
               store: remote.Store | None = None):
    fmt, _, path = spec.partition(":")
    self.spec = f"{fmt}:{remote.scrub(path)}"
    self.store = store or remote.Store()
    if not remote.is_url(path):
      path = os.path.abspath(remote.local_path(path))
      if not os.path.isfile(path):
        raise ValueError(f"{what}: table {path!r} does not exist")
    if fmt == "csv" and remote.basename(path).endswith((".tsv", ".jsonl")):
      fmt = remote.basename(path).rsplit(".", 1)[1]
    self.path, self.format = path, fmt
    root = remote.dirname(path)
    name = remote.basename(path)
    self.bad_at_open = []
    self._images, self._captions, self._labels, self.keys = [], [], [], []
    checked_header = False
    for line, row, problem in _rows(path, fmt, what, self.store):
      where = f"{name}:{line}"
      if row is None:
        self.bad_at_open.append((where, problem))
        continue
      if not checked_header:
        checked_header = True
        for col in (image_column, caption_column, label_column):
          if col and fmt != "jsonl" and col not in row:
            raise ValueError(f"{what}: table {remote.scrub(path)!r} has no "
                             f"column {col!r} "
                             f"(columns: {sorted(row)}); set config.data."
                             "table_image_column / table_caption_column / "
                             "table_label_column")
      image = row.get(image_column)
      captions = row.get(caption_column)
      if isinstance(captions, str) or captions is None:
        captions = [captions] if captions is not None else []
      captions = [str(c).strip() for c in captions
                  if c is not None and str(c).strip()]
      if not image:
        self.bad_at_open.append((where, f"no image path (column "
                                 f"{image_column!r})"))
        continue
      problem = next((_not_utf8(c) for c in captions if _not_utf8(c)), "")
      if problem:
        self.bad_at_open.append((where, f"caption {problem} (column "
                                 f"{caption_column!r})"))
        continue
      if _not_utf8(str(image)):
        self.bad_at_open.append((where, f"image path {_not_utf8(str(image))}"
                                 f" (column {image_column!r})"))
        continue
      if not captions:
        self.bad_at_open.append((where, f"missing or empty caption (column "
                                 f"{caption_column!r})"))
        continue
      label = -1
      if label_column:
        try:
          label = int(row.get(label_column))
        except (TypeError, ValueError):
          self.bad_at_open.append((where, f"label {row.get(label_column)!r} "
                                   f"(column {label_column!r}) is not an "
                                   "integer"))
          continue
      self._images.append(remote.join(root, str(image)))
      self._captions.append(captions)
      self._labels.append(label)
      self.keys.append(where)
    if not self.keys:
      raise ValueError(f"{what}: table {remote.scrub(path)!r} has no "
                       f"usable (image, "
                       f"caption) rows ({len(self.bad_at_open)} bad)")
    # Rows of one image file (a table of one row per caption) share an
    # image id: the index of the first of them (config.loss.groups="image").
    first = {}
    self._image_ids = [first.setdefault(p, i)
                       for i, p in enumerate(self._images)]
    self.is_remote = any(remote.is_url(p) for p in self._images)

  def __len__(self):
    return len(self.keys)

  def describe(self) -> str:
    return (f"{self.format}: {len(self)} rows of {remote.scrub(self.path)}, "
            f"{len(self.bad_at_open)} bad found while reading it")

  def label_of(self, index: int) -> int:
    """The label of example ``index`` without reading its image."""
    return self._labels[index]

  def read_many(self, indices, parallelism: int) -> list:
    """``source[i]`` (or the BadExample it raised) for each index, in order,
    up to ``parallelism`` images read at a time (``remote.parallel_map``)."""
    return remote.parallel_map(
        lambda i: contract.get_or_bad(self, int(i)), indices, parallelism)

  def __getitem__(self, index: int) -> dict:
    key, path = self.keys[index], self._images[index]
    if remote.is_url(path):
      try:
        data = self.store.read(path)
      except remote.NotFound:
        raise BadExample(key, f"cannot read image {remote.scrub(path)!r}: "
                         "not found") from None
    else:
      try:
        with open(path, "rb") as f:
          data = f.read()
      except OSError as e:
        raise BadExample(key, f"cannot read image {path!r}: "
                         f"{e.strerror or e}") from None
    return {"key": key, "image": data, "captions": self._captions[index],
            "label": self._labels[index],
            "image_id": self._image_ids[index]}


def check_spec(name: str, what: str, store) -> None:
  """The table of ``name`` exists and is readable (its rows are not read)."""
  path = name.partition(":")[2]
  if remote.is_url(path):
    try:
      (store or remote.Store()).info(path)
    except remote.NotFound:
      raise ValueError(f"{what}: table {remote.scrub(path)!r} does not "
                       "exist") from None
    except remote.RemoteError as e:
      raise ValueError(f"{what}: table {e}") from None
    return
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise ValueError(f"{what}: table {path!r} does not exist")
  if not os.access(path, os.R_OK):
    raise ValueError(f"{what}: table {path!r} is not readable")


def open_spec(data, name: str, *, what: str, between_chunks=None):  # pylint: disable=unused-argument
  """The ``TableSource`` of ``name`` with config.data's columns."""
  return TableSource(
      name, image_column=data.table_image_column,
      caption_column=data.table_caption_column,
      label_column=data.table_label_column, what=what,
      store=remote.make_store(data))
