"""Held-out evaluation data: a zero-shot classification set and a retrieval set.

Neither is read here: each is an ``EvalSplit`` (a split, its length and a
``read(indices)`` function) that evaluation streams in batches, so only the
embeddings of a split are ever held, never its decoded images. Examples are
read through the same TFDS source and example function as training (decode,
resize/crop to uint8), in split order, with every caption of each image.
For synthetic_shapes the eval split holds only (shape, color) combinations
never seen in training, and the zero-shot prompt templates are ones no
training caption uses.

Class names and templates are resolved by ``train.eval.names`` (config list
or file, the dataset's labels, WordNet IDs -> names, shipped defaults).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import numpy as np

from train.data import pipeline
from train.data import sources
from train.data.decode import host as host_lib
from train.data.sources import synthetic
from train.data.sources import tfds
from train.data.sources.contract import Bad
from train.data.sources.contract import BadExample
from train.eval import names as names_lib


@dataclasses.dataclass
class EvalSplit:
  """A split read in order for evaluation.

  ``read(indices)`` returns one dict per index: ``{"image": uint8 [S, S, 3],
  "captions": [str], "label": int}`` (label -1 and captions [] where the
  split has none). A bad example (an image that does not decode, an empty
  caption) comes back with ``"bad": "where: why"`` and a blank image, so a
  batch keeps its rows; evaluation drops it from the metrics and counts it.
  """
  name: str
  num_examples: int
  total_examples: int  # Of the whole split (num_examples may be a prefix).
  image_size: int
  read: Callable[[Sequence[int]], list]

  def read_all(self) -> list:
    """Every example at once (small splits: notebooks, tests)."""
    return self.read(list(range(self.num_examples)))


class _WholeSplit:
  """The whole split in memory, read once on first use: for notebooks and
  tests; evaluation itself streams ``split``."""

  @functools.cached_property
  def _all(self):
    return self.split.read_all()

  @property
  def images(self) -> np.ndarray:
    """uint8 [N, S, S, 3] of the whole split (exploration only)."""
    return np.stack([e["image"] for e in self._all])


@dataclasses.dataclass
class ZeroShotSet(_WholeSplit):
  """Zero-shot classification: images of ``split`` against classnames x
  templates (``prompts.templates`` have "{}" for the class name)."""
  split: EvalSplit
  prompts: names_lib.Prompts

  @property
  def classnames(self):
    return list(self.prompts.classnames)

  @property
  def templates(self):
    return list(self.prompts.templates)

  @property
  def labels(self) -> np.ndarray:
    return np.asarray([e["label"] for e in self._all], np.int32)


@dataclasses.dataclass
class RetrievalSet(_WholeSplit):
  """Image <-> text retrieval over ``split``: every caption of every image."""
  split: EvalSplit

  @property
  def captions(self) -> list:
    """Per image, the list of its captions."""
    return [list(e["captions"]) for e in self._all]


def decode_text(text) -> str:
  return text.decode("utf-8") if isinstance(text, bytes) else str(text)


class _SourceReader:
  """``read(indices)`` of a training-format source (TFDS, webdataset, CSV:
  train/data/sources/contract.py): uint8 images at ``image_size``, text
  decoded."""

  def __init__(self, source, image_size: int):
    self.source = source
    self._compact = pipeline.Compact(source, image_size)
    self._image_size = image_size

  def __call__(self, indices):
    out = []
    for i in indices:
      c = self._compact(i)
      if isinstance(c, Bad):
        s = self._image_size
        out.append({"image": np.zeros((s, s, 3), np.uint8), "captions": [],
                    "label": -1, "bad": f"{c.where}: {c.reason}"})
      else:
        out.append({"image": c["image"],
                    "captions": [decode_text(t) for t in c["captions"]],
                    "label": int(c["label"])})
    return out


class _ClassificationReader:
  """``read(indices)`` of a TFDS classification split (``zeroshot_name``):
  image and label only."""

  def __init__(self, source, *, image_key, label_key, image_size):
    self._source = source
    self._image_key, self._label_key = image_key, label_key
    self._image_size = image_size

  def __call__(self, indices):
    examples = self._source.__getitems__(list(indices)) if len(indices) else []
    return [{"image": host_lib.resize_crop(
                 np.asarray(tfds.value_at(ex, self._image_key)),
                 self._image_size),
             "captions": [],
             "label": int(tfds.value_at(ex, self._label_key))}
            for ex in examples]


def _classification_split(builder, split, *, image_key, label_key,
                          image_size, limit) -> EvalSplit:
  source = builder.as_data_source(split=split)
  total = len(source)
  n = total if not limit else min(limit, total)
  return EvalSplit(
      name=f"{builder.info.full_name}[{split}]", num_examples=n,
      total_examples=total, image_size=image_size,
      read=_ClassificationReader(source, image_key=image_key,
                                 label_key=label_key, image_size=image_size))


def _source_split(data, limit) -> EvalSplit:
  source = sources.open_source(data, data.eval_split,
                               what="config.data.eval_split")
  total = len(source)
  n = total if not limit else min(limit, total)
  return EvalSplit(name=source.spec, num_examples=n, total_examples=total,
                   image_size=data.image_size,
                   read=_SourceReader(source, data.image_size))


@dataclasses.dataclass
class EvalSets:
  """The held-out sets of a config; ``zeroshot_skipped`` says in one
  sentence why there is no zero-shot set ("" when there is one)."""
  zeroshot: ZeroShotSet | None
  retrieval: RetrievalSet | None
  zeroshot_skipped: str = ""


# The config key of the label field of each file source kind.
_LABEL_KEYS = {"webdataset": "wds_label_field", "table": "table_label_column"}


def without_labels(data):
  """``data`` (a copy) with the file sources' label fields unset: the
  training split never needs labels, so its examples do not depend on them
  (a label field set for the held-out shards' zero-shot may be absent from
  the training shards)."""
  data = data.copy_and_resolve_references()
  with data.unlocked():
    for key in _LABEL_KEYS.values():
      data[key] = ""
  return data


def _labels_of(source, n: int) -> tuple[list, list]:
  """(labels of examples 0..n-1, None where missing; the BadExamples of
  the missing ones), reading labels only where the source can."""
  labels, missing = [], []
  label_of = getattr(source, "label_of", None)
  for i in range(n):
    try:
      labels.append(label_of(i) if label_of else int(source[i]["label"]))
    except BadExample as e:
      labels.append(None)
      missing.append(e)
  return labels, missing


def _file_zeroshot(data, limit):
  """(ZeroShotSet, "") of a file source's held-out split with integer
  labels and class names from the config, or (None, why not)."""
  kind = sources.kind_of(data.eval_split)
  key = _LABEL_KEYS.get(kind)
  if key is None:
    return None, f"the held-out source {data.eval_split!r} has no labels"
  if not data[key]:
    return None, (f"config.data.{key} is empty: the held-out examples have "
                  "no labels")
  if not names_lib.has_classnames(data):
    return None, ("no class names: set config.data.zeroshot_classnames (a "
                  "list) or zeroshot_classnames_file (one name per line, "
                  "line i names label i)")
  prompts = names_lib.resolve_integer_labels(data)
  split = _source_split(data, limit)
  labels, missing = _labels_of(split.read.source, split.num_examples)
  if len(missing) == split.num_examples:
    return None, (f"none of the {split.num_examples} held-out examples of "
                  f"{split.name} has a label (config.data.{key}="
                  f"{data[key]!r}), e.g. {missing[0]}")
  n = len(prompts.classnames)
  for i, label in enumerate(labels):
    if label is not None and not 0 <= label < n:
      raise ValueError(
          f"config.data.eval_split: the label {label} of "
          f"{split.read.source.keys[i]} is outside the {n} class names "
          f"(labels 0..{n - 1}) of {prompts.classnames_from}")
  return ZeroShotSet(split=split, prompts=prompts), ""


def make_eval_sets(config, tokenizer=None):
  """Returns (ZeroShotSet or None, RetrievalSet) for config.data
  (``eval_sets_of`` without the reason). ``tokenizer`` is unused (captions are tokenized when
  evaluated); kept for the callers' signature."""
  del tokenizer
  sets = eval_sets_of(config)
  return sets.zeroshot, sets.retrieval


def eval_sets_of(config) -> EvalSets:
  """The held-out sets of config.data, and why zero-shot is skipped if it is.

  Zero-shot runs on ``zeroshot_name`` (a TFDS classification set) when it is
  set; else on the held-out split itself when it has labels and class
  names: a TFDS ``label_key`` (its ClassLabel names, or the config's), or a
  file source's integer labels (``wds_label_field``, ``table_label_column``)
  with ``zeroshot_classnames`` or ``zeroshot_classnames_file``. A label
  outside the class names is an error here, before any training; examples
  without a label are left out of the evaluation and counted.
  """
  data = config.data
  limit = data.num_eval_examples if data.name != synthetic.NAME else 0
  if (not data.zeroshot_name and data.eval_split
      and sources.kind_of(data.name) != "tfds"):
    zs, why = _file_zeroshot(data, limit)
    if zs is not None:
      return EvalSets(zs, RetrievalSet(split=zs.split))
    # Retrieval needs no labels: a label field the shards lack must not
    # make every held-out example bad.
    main = _source_split(without_labels(data), limit)
    return EvalSets(None, RetrievalSet(split=main), why)
  zs, rs, why = _tfds_eval_sets(data, limit)
  return EvalSets(zs, rs, why)


def _tfds_eval_sets(data, limit):
  # eval_split "" (a file source without a held-out set): no retrieval set.
  main = _source_split(data, limit) if data.eval_split else None
  retrieval = RetrievalSet(split=main) if main is not None else None

  if data.zeroshot_name:
    zs_builder = tfds.zeroshot_builder_for(data)
    label_feature = tfds.feature_at(zs_builder.info.features,
                                    data.zeroshot_label_key)
    split = _classification_split(
        zs_builder, data.zeroshot_split, image_key=data.zeroshot_image_key,
        label_key=data.zeroshot_label_key, image_size=data.image_size,
        limit=data.num_eval_examples)
    dataset_templates = (synthetic.ZEROSHOT_TEMPLATES
                         if data.zeroshot_name == synthetic.NAME else None)
    prompts = names_lib.resolve(data, list(label_feature.names),
                                dataset_templates=dataset_templates)
    return ZeroShotSet(split=split, prompts=prompts), retrieval, ""
  if main is None:
    return None, retrieval, ("no held-out source (config.data.eval_split is "
                             "empty)")
  if not data.label_key:
    return None, retrieval, ("config.data.label_key is empty and "
                             "config.data.zeroshot_name is unset: no labels")
  builder = tfds.builder_for(data)
  label_feature = tfds.feature_at(builder.info.features, data.label_key)
  label_names = getattr(label_feature, "names", None)
  if not label_names:
    return None, retrieval, (f"the label {data.label_key!r} of {data.name} "
                             "has no class names (not a ClassLabel)")
  dataset_templates = (synthetic.ZEROSHOT_TEMPLATES
                       if data.name == synthetic.NAME else None)
  prompts = names_lib.resolve(data, list(label_names),
                              dataset_templates=dataset_templates)
  return ZeroShotSet(split=main, prompts=prompts), retrieval, ""
