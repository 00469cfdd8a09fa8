"""Precomputed image embeddings on disk (written by ``train.precompute``).

    DIR/meta.json            fingerprint of the tower, source, n, D, shard size
    DIR/shard-00000.npy      bfloat16 [rows, D] (stored as its uint16 bits)
    DIR/shard-00000.json     keys, captions, labels, image ids, content
                             hashes and bad rows of the shard, written
                             last: its presence marks the shard done

Row i of the concatenated shards is example i of the source (its index, in
source order), so training reads an embedding by example index from a
memory-mapped file and decodes no image; ``row_of(key)`` gives the row of a
key. An example whose image was bad when precomputing is bad here too, at the
same index, so a stream skips the same examples either way.

Group ids (``config.loss.groups``): "image" reads the source's image id of
each row; "content" gives the rows with equal content hashes (duplicate
images) one id, the index of the first of them, found once when the
directory is opened.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from train.data.sources.contract import BadExample

FORMAT = "infcl-jax image embeddings v1"
PREFIX = "embeddings:"
PREFIXES = (PREFIX,)


def shard_paths(directory: str, k: int) -> tuple[str, str]:
  base = os.path.join(directory, f"shard-{k:05d}")
  return base + ".npy", base + ".json"


def read_meta(directory: str, what: str = "config.data.name") -> dict:
  path = os.path.join(os.path.expanduser(directory), "meta.json")
  try:
    with open(path) as f:
      meta = json.load(f)
  except OSError as e:
    raise ValueError(f"{what}: no precomputed embeddings at {directory!r} "
                     f"({path}: {e.strerror or e}); write them with `python "
                     "-m train.precompute --config ... --out DIR`") from None
  except ValueError as e:
    raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
  if meta.get("format") != FORMAT:
    raise ValueError(f"{what}: {path} is not an embeddings directory of this "
                     f"trainer (format {meta.get('format')!r})")
  return meta


class EmbeddingSource:
  """Random access to precomputed embeddings, in the source contract
  (examples carry ``image_emb`` float32 [D] instead of ``image``)."""

  def __init__(self, directory: str, *, what: str = "config.data.name"):
    self.directory = os.path.abspath(os.path.expanduser(directory))
    self.meta = read_meta(self.directory, what)
    self.spec = PREFIX + self.directory
    self.fingerprint = self.meta["fingerprint"]
    # What the data iterator's state names (checkpoints): the embeddings by
    # their content (the images' source and the tower), not by where they
    # are, so that a moved workdir (its image_embeddings) resumes.
    self.stream_spec = (f"{PREFIX}{self.meta['source']}@"
                        f"{self.meta['fingerprint']}")
    self.rows = int(self.meta["rows_per_shard"])
    n, k = int(self.meta["num_examples"]), int(self.meta["num_shards"])
    missing = [s for s in range(k) if not os.path.exists(
        shard_paths(self.directory, s)[1])]
    if missing:
      raise ValueError(
          f"{what}: the embeddings in {self.directory} are incomplete: "
          f"{len(missing)} of {k} shards missing (first: {missing[0]}); "
          "rerun `python -m train.precompute` with the same --out to finish")
    self._emb, self.keys, self._captions, self._labels = [], [], [], []
    self._bad = {}
    image_ids, hashes = [], []
    for s in range(k):
      npy, js = shard_paths(self.directory, s)
      with open(js) as f:
        info = json.load(f)
      self._emb.append(np.load(npy, mmap_mode="r"))
      base = s * self.rows
      self.keys.extend(info["keys"])
      self._captions.extend(info["captions"])
      self._labels.extend(info["labels"])
      # Shards written before ids were recorded have none: then no groups.
      image_ids = (image_ids + info["image_ids"]
                   if image_ids is not None and "image_ids" in info else None)
      hashes = (hashes + info["content_hashes"]
                if hashes is not None and "content_hashes" in info else None)
      self._bad.update({base + int(r): why for r, why in info["bad"].items()})
    if len(self.keys) != n:
      raise ValueError(f"{what}: {self.directory} holds {len(self.keys)} "
                       f"rows, meta.json says {n}")
    # Found while opening the images' source: counted as bad here as well.
    self.bad_at_open = [tuple(b) for b in self.meta.get("bad_at_open", [])]
    self._row_of = None
    self._image_ids = image_ids
    self._content_ids = None
    if hashes is not None:
      first = {}
      self._content_ids = [first.setdefault(h, i) if h else -1
                           for i, h in enumerate(hashes)]

  @property
  def has_image_ids(self) -> bool:
    return self._image_ids is not None

  @property
  def has_content_ids(self) -> bool:
    return self._content_ids is not None

  @property
  def dim(self) -> int:
    return int(self.meta["dim"])

  def __len__(self):
    return len(self.keys)

  def describe(self) -> str:
    return (f"precomputed embeddings: {len(self)} x {self.dim} "
            f"{self.meta['dtype']} in {len(self._emb)} shard(s) of "
            f"{self.directory} (of {self.meta['source']})")

  def check_fingerprint(self, fingerprint: str, what: str) -> None:
    if fingerprint != self.fingerprint:
      raise ValueError(
          f"the embeddings in {self.directory} were computed by another "
          f"image tower or preprocessing (fingerprint {self.fingerprint}) "
          f"than {what} ({fingerprint}); recompute them with `python -m "
          "train.precompute`")

  def same_stream(self, saved: str) -> bool:
    """Whether ``saved`` (a checkpoint's "dataset") names these embeddings:
    their ``stream_spec``, or (a checkpoint written before it) their
    directory: this one, one that holds the same embeddings, or one that is
    gone with the same name (a workdir moved)."""
    if saved == self.stream_spec:
      return True
    if not saved.startswith(PREFIX):
      return False
    old = saved[len(PREFIX):]
    if old == self.directory:
      return True
    try:
      meta = read_meta(old)
    except ValueError:  # Gone (moved): the same name, the same contents?
      return (os.path.basename(old.rstrip("/"))
              == os.path.basename(self.directory))
    return all(meta.get(k) == self.meta.get(k) for k in
               ("fingerprint", "source", "num_examples", "decode_size"))

  def row_of(self, key: str) -> int:
    if self._row_of is None:
      self._row_of = {k: i for i, k in enumerate(self.keys)}
    return self._row_of[key]

  def __getitem__(self, index: int) -> dict:
    key = self.keys[index]
    why = self._bad.get(index)
    if why is not None:
      raise BadExample(key, why)
    row = self._emb[index // self.rows][index % self.rows]
    out = {"key": key,
           "image_emb": np.asarray(row).view(ml_dtypes.bfloat16).astype(
               np.float32),
           "captions": self._captions[index], "label": self._labels[index]}
    if self._image_ids is not None:
      out["image_id"] = self._image_ids[index]
    if self._content_ids is not None:
      out["content_id"] = self._content_ids[index]
    return out


def check_spec(name: str, what: str, store) -> None:  # pylint: disable=unused-argument
  """The directory of ``name`` holds embeddings of this trainer."""
  read_meta(name[len(PREFIX):], what)


def open_spec(data, name: str, *, what: str, between_chunks=None):  # pylint: disable=unused-argument
  """The ``EmbeddingSource`` of ``name``."""
  return EmbeddingSource(name[len(PREFIX):], what=what)
