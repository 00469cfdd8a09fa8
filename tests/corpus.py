"""Small synthetic image-text corpora with known bad data, for the source tests.

``make_corpus(dir)`` writes the same synthetic_shapes examples as
webdataset shards, a CSV, a TSV and a JSONL table (JPEG files), and spoils
some of them in the ways a web corpus is spoiled. ``Corpus`` says which
examples are good and which bad ones each format must skip and name.
"""
import dataclasses
import io
import json
import os
import tarfile

import ml_collections

from train import data as data_lib
from train.data.sources import synthetic

IMAGE_SIZE = 16
PER_SHARD = 16


@dataclasses.dataclass
class Corpus:
  pattern: str                 # webdataset brace pattern
  tables: dict                 # "csv" | "tsv" | "jsonl" -> path
  good: dict                   # key -> (jpeg bytes, caption, label)
  wds_bad: dict                # where -> reason fragment (webdataset)
  table_bad: dict              # where -> reason fragment (tables)


def _jpeg(image):
  return synthetic._encode(image, "jpg", 95)  # pylint: disable=protected-access


def _add(tar, name, data):
  info = tarfile.TarInfo(name)
  info.size = len(data)
  tar.addfile(info, io.BytesIO(data))


def make_corpus(root, num=64, split="train", seed=0) -> Corpus:
  """``num`` examples in shards of 16; spoiled: a corrupt JPEG, an empty
  and a blank caption, an image without its caption, a caption without its
  image, and a final shard cut in the middle of a member."""
  root = str(root)
  os.makedirs(os.path.join(root, "images"), exist_ok=True)
  examples = []
  for i in range(num):
    image, attrs, rng = synthetic.render_example(seed, split, i, IMAGE_SIZE)
    caption = synthetic.make_captions(attrs, rng, split)[0]
    examples.append((f"{i:06d}", _jpeg(image), caption, attrs["shape_id"]))
  corrupt, empty, blank, no_txt, no_img = 3, 5, 7, 20, 21
  spoiled = {corrupt, empty, blank, no_txt, no_img}
  num_shards = -(-num // PER_SHARD)
  good, wds_bad = {}, {}
  cut_key = None
  for s in range(num_shards):
    path = os.path.join(root, f"{split}-{s:03d}.tar")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
      for key, jpg, caption, label in examples[s * PER_SHARD:(s + 1) * PER_SHARD]:
        i = int(key)
        img = jpg[:len(jpg) // 3] if i == corrupt else jpg
        txt = {empty: b"", blank: b"  \n"}.get(i, caption.encode())
        if i != no_img:
          _add(tar, f"{key}.jpg", img)
        if i != no_txt:
          _add(tar, f"{key}.txt", txt)
        _add(tar, f"{key}.json", json.dumps({"label": label}).encode())
        if i not in spoiled:
          good[f"{os.path.basename(path)}:{key}"] = (jpg, caption, label)
    if s == num_shards - 1:
      # Cut the last shard inside the image of its third-to-last example.
      with tarfile.open(path) as tar:
        members = tar.getmembers()
      m = members[-9]  # .jpg, .txt, .json per example
      assert m.name.endswith(".jpg"), m.name
      cut_key = m.name.split(".")[0]
      with open(path, "r+b") as f:
        f.truncate(m.offset_data + m.size // 2)
      shard = os.path.basename(path)
      lost = [k for k in good if k.startswith(shard + ":")
              and k.split(":")[1] >= cut_key]
      for k in lost:
        del good[k]
      wds_bad[f"{shard}:{cut_key}"] = "truncated shard"
  wds_bad.update({
      f"{split}-000.tar:{corrupt:06d}": "undecodable image",
      f"{split}-000.tar:{empty:06d}": "empty caption",
      f"{split}-000.tar:{blank:06d}": "empty caption",
      f"{split}-001.tar:{no_txt:06d}": "orphan member",
      f"{split}-001.tar:{no_img:06d}": "orphan member",
  })
  pattern = os.path.join(root, f"{split}-{{000..{num_shards - 1:03d}}}.tar")

  # Tables of the same examples (all of them: the tables have their own
  # spoils: a corrupt image file, an empty caption, a missing image file).
  rows = []
  for key, jpg, caption, label in examples:
    i = int(key)
    name = os.path.join("images", f"{key}.jpg")
    if i != no_img:
      with open(os.path.join(root, name), "wb") as f:
        f.write(jpg[:len(jpg) // 3] if i == corrupt else jpg)
    rows.append({"image": name, "caption": "" if i == empty else caption,
                 "label": label})
  tables = {}
  for fmt in ("csv", "tsv", "jsonl"):
    path = os.path.join(root, f"{split}.{fmt}")
    with open(path, "w", encoding="utf-8", newline="") as f:
      if fmt == "jsonl":
        for r in rows:
          f.write(json.dumps(r) + "\n")
      else:
        sep = "\t" if fmt == "tsv" else ","
        f.write(sep.join(["image", "caption", "label"]) + "\n")
        for r in rows:
          cap = r["caption"]
          if fmt == "csv":
            cap = '"' + cap.replace('"', '""') + '"'
          f.write(sep.join([r["image"], cap, str(r["label"])]) + "\n")
    tables[fmt] = path
  table_bad = {"corrupt": corrupt, "empty": empty, "missing": no_img}
  return Corpus(pattern=pattern, tables=tables, good=good, wds_bad=wds_bad,
                table_bad=table_bad)


def data_config(name, **data):
  """A trainer config whose data section reads the source ``name`` at this
  corpus' image size, labels from its "label" fields, up to half of it
  bad; ``data`` overrides keys of ``config.data``."""
  config = ml_collections.ConfigDict()
  config.data = data_lib.default_data_config()
  config.tokenizer = data_lib.default_tokenizer_config()
  config.data.name = name
  config.data.eval_split = ""
  config.data.image_size = IMAGE_SIZE
  config.data.max_bad_fraction = 0.5
  config.data.wds_label_field = "label"
  config.data.table_label_column = "label"
  for k, v in data.items():
    config.data[k] = v
  return config
