"""A user's files for the LiT recipe, made from the committed fixtures.

``checkpoint(dir)``: a Hugging Face CLIP ``save_pretrained`` directory as a
user has it (config.json, model.safetensors and tokenizer.json), copied
from tests/fixtures/towers (written by scripts/make_tower_fixtures.py).
``shards(dir, ...)``: img2dataset-style webdataset shards (``key.jpg``,
``key.txt``, ``key.json`` with an integer ``"label"``) of synthetic_shapes
examples, with bad members planted on request; ``classnames(dir)``: the
class-name file, one name per line, line i naming label i.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tarfile

from train.data.sources import synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOWERS = os.path.join(ROOT, "tests", "fixtures", "towers")
IMAGE_SIZE = 16
# The kinds of bad member a web corpus has, and the reason each is counted
# under (train/data/ledger.py, reason_kind).
PLANTED = {
    "corrupt_jpeg": "undecodable image",    # a JPEG cut short
    "not_a_jpeg": "undecodable image",      # an HTML error page as .jpg
    "empty_caption": "empty caption",
    "orphan": "orphan member",              # a caption without its image
}


def checkpoint(root) -> str:
  """The fixture HF CLIP checkpoint with its tokenizer.json beside it."""
  path = os.path.join(str(root), "clip-checkpoint")
  os.makedirs(path, exist_ok=True)
  for name in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(TOWERS, "hf_clip", name), path)
  shutil.copy(os.path.join(TOWERS, "clip_bpe_json", "tokenizer.json"), path)
  return path


def _add(tar, name, data: bytes):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


@dataclasses.dataclass
class Shards:
  pattern: str            # the brace pattern of config.data.name
  num_good: int
  bad: dict               # "shard:key" -> reason kind
  num_classes: int


def shards(root, name: str = "train", *, num: int = 32, per_shard: int = 16,
           planted=(), labels: bool = True, label_offset: int = 0,
           split: str = "train", seed: int = 0) -> Shards:
  """``num`` examples (plus one per planted member) in shards of
  ``per_shard``; ``planted``: kinds of PLANTED, each once, in the first
  shard. ``labels=False`` writes no .json; ``label_offset`` shifts every
  label (a label outside the class names)."""
  root = str(root)
  os.makedirs(root, exist_ok=True)
  rows = []
  for i in range(num):
    image, attrs, rng = synthetic.render_example(seed, split, i, IMAGE_SIZE)
    caption = synthetic.make_captions(attrs, rng, split)[0]
    jpg = synthetic._encode(image, "jpg", 95)  # pylint: disable=protected-access
    rows.append({"jpg": jpg, "txt": caption.encode(),
                 "label": attrs["shape_id"] + label_offset})
  bad_rows = []
  good_jpg = rows[0]["jpg"]
  for kind in planted:
    if kind == "corrupt_jpeg":
      bad_rows.append((kind, {"jpg": good_jpg[:len(good_jpg) // 3],
                              "txt": b"a cut photo", "label": 0}))
    elif kind == "not_a_jpeg":
      bad_rows.append((kind, {"jpg": b"<html><body>404 Not Found</body>"
                                     b"</html>\n", "txt": b"a missing photo",
                              "label": 0}))
    elif kind == "empty_caption":
      bad_rows.append((kind, {"jpg": good_jpg, "txt": b"", "label": 0}))
    elif kind == "orphan":
      bad_rows.append((kind, {"txt": b"a caption without its image",
                              "label": 0}))
    else:
      raise ValueError(f"unknown planted kind {kind!r}")
  # The planted members first, then the good ones, in shards.
  items = bad_rows + [(None, r) for r in rows]
  bad = {}
  n_shards = -(-len(items) // per_shard)
  for s in range(n_shards):
    shard = f"{name}-{s:06d}.tar"
    with tarfile.open(os.path.join(root, shard), "w",
                      format=tarfile.USTAR_FORMAT) as tar:
      for j, (kind, r) in enumerate(items[s * per_shard:(s + 1) * per_shard]):
        key = f"{s * per_shard + j:06d}"
        if "jpg" in r:
          _add(tar, f"{key}.jpg", r["jpg"])
        _add(tar, f"{key}.txt", r["txt"])
        if labels:
          _add(tar, f"{key}.json", json.dumps({"label": r["label"]}).encode())
        if kind is not None:
          bad[f"{shard}:{key}"] = PLANTED[kind]
  pattern = os.path.join(root, f"{name}-{{000000..{n_shards - 1:06d}}}.tar")
  if n_shards == 1:
    pattern = os.path.join(root, f"{name}-000000.tar")
  return Shards(pattern=pattern, num_good=num, bad=bad,
                num_classes=len(synthetic.SHAPES))


def classnames(root, n: int | None = None) -> str:
  """The class-name file of the shards' labels (synthetic_shapes' shapes)."""
  names = list(synthetic.SHAPES)[:n]
  path = os.path.join(str(root), "classnames.txt")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(names) + "\n")
  return path
