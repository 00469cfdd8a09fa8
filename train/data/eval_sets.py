"""Held-out evaluation data: a zero-shot classification set and a retrieval set.

Both are read through the same TFDS source and example function as training
(decode, resize/crop, scale), in split order, with the first caption of each
image. For synthetic_shapes the eval split holds only (shape, color)
combinations never seen in training, and the zero-shot prompt templates are
ones no training caption uses.
"""

import dataclasses

from absl import logging

import numpy as np

from train.data import pipeline
from train.data import sources
from train.data import synthetic
from train.data.source import Bad

# Generic prompts for TFDS classification datasets without their own.
DEFAULT_TEMPLATES = (
    "a photo of a {}.",
    "a picture of the {}.",
    "an image of a {}.",
    "a close-up photo of the {}.",
)


@dataclasses.dataclass
class ZeroShotSet:
  """Zero-shot classification: score images against classnames x templates.

  images: float32 [N, H, W, 3] in [-1, 1]; labels: int32 [N] indices into
  classnames; templates: prompts with "{}" for the class name (the trainer
  averages the text embeddings of a class over its templates).
  """
  images: np.ndarray
  labels: np.ndarray
  classnames: list
  templates: list


@dataclasses.dataclass
class RetrievalSet:
  """Image <-> text retrieval: texts[i] (tokenized captions[i]) is image i's."""
  images: np.ndarray
  texts: np.ndarray
  captions: list


def _decode(text) -> str:
  return text.decode("utf-8") if isinstance(text, bytes) else str(text)


def make_eval_sets(config, tokenizer):
  """Returns (ZeroShotSet or None, RetrievalSet) for config.data.

  The zero-shot set is None when it has no labeled source (a TFDS dataset
  without label_key and without zeroshot_name).
  """
  data = config.data
  # eval_split "" (a file source without a held-out set): no retrieval set.
  source = (sources.open_source(data, data.eval_split,
                                what="config.data.eval_split")
            if data.eval_split else [])
  limit = data.num_eval_examples if data.name != synthetic.NAME else 0
  n = len(source) if not limit else min(limit, len(source))
  compact = pipeline.Compact(source, data.image_size)
  images, captions, labels = [], [], []
  for i in range(n):
    item = compact(i)
    if isinstance(item, Bad):
      logging.warning("held-out example skipped: %s: %s", item.where,
                      item.reason)
      continue
    images.append(pipeline.to_float(item["image"]))
    labels.append(item["label"])
    captions.append(_decode(item["captions"][0] if item["captions"] else b""))
  retrieval = None
  if images:
    images = np.stack(images)
    retrieval = RetrievalSet(images=images, texts=tokenizer.encode(captions),
                             captions=captions)
  builder = (sources.builder_for(data)
             if sources.kind_of(data.name) == "tfds" else None)

  templates = list(data.zeroshot_templates)
  if data.zeroshot_name:
    zs_builder = sources.zeroshot_builder_for(data)
    label_feature = sources.feature_at(zs_builder.info.features,
                                       data.zeroshot_label_key)
    zs = _read_images_labels(zs_builder, data.zeroshot_split,
                             data.zeroshot_image_key, data.zeroshot_label_key,
                             data.image_size, data.num_eval_examples)
    classnames = [c.replace("_", " ") for c in label_feature.names]
    zeroshot = ZeroShotSet(images=zs[0], labels=zs[1], classnames=classnames,
                           templates=templates or list(
                               synthetic.ZEROSHOT_TEMPLATES
                               if data.zeroshot_name == synthetic.NAME
                               else DEFAULT_TEMPLATES))
  elif data.label_key and builder is not None:
    label_feature = sources.feature_at(builder.info.features, data.label_key)
    names = getattr(label_feature, "names", None)
    if not names:
      return None, retrieval
    if data.name == synthetic.NAME:
      default_templates = list(synthetic.ZEROSHOT_TEMPLATES)
    else:
      default_templates = list(DEFAULT_TEMPLATES)
    zeroshot = ZeroShotSet(images=images, labels=np.asarray(labels, np.int32),
                           classnames=[c.replace("_", " ") for c in names],
                           templates=templates or default_templates)
  else:
    zeroshot = None
  return zeroshot, retrieval


def _read_images_labels(builder, split, image_key, label_key, image_size,
                        limit):
  source = builder.as_data_source(split=split)
  n = len(source) if not limit else min(limit, len(source))
  images, labels = [], []
  for i in range(n):
    ex = source[i]
    images.append(pipeline.preprocess_image(
        np.asarray(sources.value_at(ex, image_key)), image_size))
    labels.append(int(sources.value_at(ex, label_key)))
  return np.stack(images), np.asarray(labels, np.int32)
