"""TFDS datasets (synthetic_shapes included) as random-access sources.

    config.data.name = "coco_captions/2017"          # dataset[/config][:X.Y.Z]
    config.data.name = "synthetic_shapes"            # generated locally

Every dataset, the embedded synthetic_shapes included, is read the same way:
its prepared TFDS directory (data_dir/name[/config]/version, array_record
files + dataset_info.json) is opened with `tfds.builder_from_directory`, and a
split becomes a random-access `ArrayRecordDataSource` that decodes examples to
numpy (images through Pillow). Builders are never constructed from their
registered classes (several, coco_captions included, need TensorFlow just to
describe their features) and nothing is ever downloaded: a dataset that is not
prepared gives a clear error saying how to prepare it.

The zero-shot classification set (``config.data.zeroshot_name``) is a TFDS
dataset too, whatever the training source: ``zeroshot_builder_for``.
"""

import functools
import logging
import os
import re

import numpy as np

from train.data.sources import synthetic
from train.data.sources.contract import BadExample

_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+$")


def default_data_dir(name: str) -> str:
  if name == synthetic.NAME:
    return os.environ.get("INFCL_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "infcl_jax", "tfds")
  return os.environ.get("TFDS_DATA_DIR") or os.path.join(
      os.path.expanduser("~"), "tensorflow_datasets")


def data_dir_of(data) -> str:
  return data.data_dir or default_data_dir(data.name)


def _quiet_opencv_notice(record: logging.LogRecord) -> bool:
  # TFDS warns on every first image decode that OpenCV is missing and that
  # it uses Pillow instead; Pillow is the intended decoder here.
  return "OpenCV is not installed" not in record.getMessage()


def _tfds():
  # Lazy: TFDS takes ~0.4 s to import, and only a TFDS source needs it.
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  absl_logger = logging.getLogger("absl")
  if _quiet_opencv_notice not in absl_logger.filters:
    absl_logger.addFilter(_quiet_opencv_notice)
  return tfds


def _known_tfds_names() -> list[str]:
  # The builders TFDS ships (imported, not constructed: no TensorFlow needed).
  _tfds()
  # Lazy: TFDS's (see _tfds).
  from tensorflow_datasets.core import registered  # pylint: disable=g-import-not-at-top
  return registered.list_imported_builders()


def _versions(path: str) -> list[str]:
  if not os.path.isdir(path):
    return []
  found = [v for v in os.listdir(path) if _VERSION_RE.match(v) and
           os.path.exists(os.path.join(path, v, "dataset_info.json"))]
  return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def resolve_dataset_dir(name: str, data_dir: str, what: str = "config.data.name") -> str:
  """The prepared TFDS directory of `name` ("ds", "ds/config", "ds:1.0.0")."""
  base, _, version = name.partition(":")
  if version and not _VERSION_RE.match(version):
    raise ValueError(f"{what}={name!r}: version {version!r} is not X.Y.Z")
  parts = base.split("/")
  if len(parts) > 2 or not all(parts):
    raise ValueError(f"{what}={name!r} must look like 'dataset', "
                     "'dataset/config' or 'dataset/config:1.2.3'")
  if not os.path.isdir(data_dir):
    if parts[0] not in _known_tfds_names():
      raise ValueError(f"{what}={name!r} is neither a TFDS dataset nor "
                       f"{synthetic.NAME!r} (and data_dir {data_dir!r} does "
                       "not exist)")
    raise ValueError(f"data_dir {data_dir!r} (for {what}={name!r}) does not "
                     "exist; set config.data.data_dir to the TFDS data "
                     "directory where the dataset was prepared")
  path = os.path.join(data_dir, *parts)
  if len(parts) == 2 and os.path.isdir(os.path.join(data_dir, parts[0])):
    if not os.path.isdir(path):
      configs = sorted(c for c in os.listdir(os.path.join(data_dir, parts[0]))
                       if _versions(os.path.join(data_dir, parts[0], c)))
      raise ValueError(f"{what}={name!r}: config {parts[1]!r} is not prepared "
                       f"under data_dir {data_dir!r} (prepared: {configs})")
  if not os.path.isdir(path):
    if parts[0] in _known_tfds_names():
      raise ValueError(
          f"TFDS dataset {parts[0]!r} is not prepared under data_dir "
          f"{data_dir!r} (nothing is downloaded at run time): prepare it with "
          f"`tfds build {base} --data_dir {data_dir} --file_format "
          "array_record`")
    raise ValueError(f"{what}={name!r} is not a TFDS dataset (neither "
                     f"registered in TFDS nor found under data_dir "
                     f"{data_dir!r}) nor {synthetic.NAME!r}")
  if len(parts) == 1 and not _versions(path):
    # No version directly below: the dataset has configs; take the only one.
    configs = sorted(c for c in os.listdir(path) if _versions(os.path.join(path, c)))
    if len(configs) != 1:
      raise ValueError(f"{what}={name!r}: choose a config, one of "
                       f"{configs or 'none prepared'} ({name}/<config>)")
    path = os.path.join(path, configs[0])
  versions = _versions(path)
  if not versions:
    raise ValueError(f"{what}={name!r}: no prepared version (no "
                     f"dataset_info.json) under {path!r}")
  if version:
    if version not in versions:
      raise ValueError(f"{what}={name!r}: version {version} not prepared "
                       f"under {path!r} (found {versions})")
  else:
    version = versions[-1]
  return os.path.join(path, version)


@functools.lru_cache(maxsize=16)
def _builder_from_dir(path: str):
  builder = _tfds().builder_from_directory(path)
  file_format = getattr(builder.info, "file_format", None)
  file_format = str(getattr(file_format, "value", file_format) or "tfrecord")
  if file_format != "array_record":
    raise ValueError(
        f"dataset at {path!r} is stored as {file_format}; the "
        "input pipeline reads array_record (random access, no TensorFlow): "
        "convert it (where TensorFlow is installed) with `tfds convert_format "
        f"--dataset_version_dir={path} --out_file_format=array_record "
        "--out_dir=<new_data_dir>/<same name/config/version>`")
  return builder


def builder_for(data, *, prepare: bool = True):
  """The TFDS read-only builder of config.data, generating synthetic data."""
  data_dir = data_dir_of(data)
  if data.name == synthetic.NAME:
    kwargs = dict(image_size=data.image_size,
                  num_train=data.num_train_examples,
                  num_test=data.num_eval_examples, seed=data.synthetic_seed)
    path = (synthetic.prepare(data_dir, **kwargs) if prepare
            else synthetic.dataset_dir(data_dir, **kwargs))
  else:
    path = resolve_dataset_dir(data.name, data_dir)
  return _builder_from_dir(path)


def zeroshot_builder_for(data):
  if data.zeroshot_name == synthetic.NAME:
    # The labelled held-out split of synthetic_shapes, e.g. beside a
    # webdataset or CSV training source.
    data_dir = data.data_dir or default_data_dir(synthetic.NAME)
    return _builder_from_dir(synthetic.prepare(
        data_dir, image_size=data.image_size,
        num_train=data.num_train_examples, num_test=data.num_eval_examples,
        seed=data.synthetic_seed))
  data_dir = data.data_dir or default_data_dir(data.zeroshot_name)
  return _builder_from_dir(resolve_dataset_dir(
      data.zeroshot_name, data_dir, what="config.data.zeroshot_name"))


def _walk(node, key: str, children, done: str = ""):
  """Follows a '/'-separated key down nested mappings.

  TFDS feature names may contain '/' themselves (coco's "image/id"), so at
  each level the longest prefix of the remaining key that is present wins.
  `children(node)` gives a node's mapping of sub-nodes, or None for a leaf.
  """
  if not key:
    return node
  mapping = children(node)
  parts = key.split("/")
  for j in range(len(parts), 0, -1):
    name = "/".join(parts[:j])
    if mapping is not None and name in mapping:
      return _walk(mapping[name], "/".join(parts[j:]), children,
                   f"{done}/{name}" if done else name)
  choices = sorted(mapping.keys()) if mapping is not None else []
  raise KeyError(f"no {parts[0]!r} at {done or '<top>'} (available: {choices})")


def feature_at(features, key: str):
  """The TFDS feature at a '/'-separated key; KeyError listing choices."""
  tfds = _tfds()

  def children(feature):
    while isinstance(feature, tfds.features.Sequence):
      feature = feature.feature  # a sequence of dicts: look inside
    return feature if isinstance(feature, tfds.features.FeaturesDict) else None

  return _walk(features, key, children)


def value_at(example, key: str):
  """The decoded value at a '/'-separated key of a decoded example."""
  return _walk(example, key, lambda v: v if isinstance(v, dict) else None)


def check_split_and_keys(builder, split: str, keys: dict, where: str) -> None:
  """Checks that `split` exists and each (config field -> key) is present."""
  tfds = _tfds()
  splits = sorted(builder.info.splits.keys())
  if split not in splits:
    raise ValueError(f"{where}: split {split!r} not in {builder.info.full_name} "
                     f"(splits: {splits})")
  for field, key in keys.items():
    if not key:
      continue
    try:
      feature = feature_at(builder.info.features, key)
    except KeyError as e:
      raise ValueError(f"{field}={key!r} is not a feature of "
                       f"{builder.info.full_name}: {e.args[0]}") from None
    if field.endswith("image_key") and not isinstance(feature, tfds.features.Image):
      raise ValueError(f"{field}={key!r} is a {type(feature).__name__}, not "
                       f"an Image feature of {builder.info.full_name}")
    if field.endswith("text_key") and not isinstance(feature, tfds.features.Text):
      raise ValueError(f"{field}={key!r} is a {type(feature).__name__}, not "
                       f"a Text feature of {builder.info.full_name}")
    if field.endswith("label_key") and not isinstance(
        feature, (tfds.features.ClassLabel, tfds.features.Scalar)):
      raise ValueError(f"{field}={key!r} is a {type(feature).__name__}, not "
                       f"an integer label of {builder.info.full_name}")


def check(data) -> None:
  """config.data of a TFDS training source: synthetic_shapes' settings, or
  the dataset prepared with its splits and feature keys (one-line
  ValueError; nothing is generated or downloaded)."""
  if data.name == synthetic.NAME:
    if data.split not in ("train", "test") or data.eval_split not in ("train", "test"):
      raise ValueError(f"{synthetic.NAME} has splits 'train' and 'test'; got "
                       f"config.data.split={data.split!r}, "
                       f"eval_split={data.eval_split!r}")
    if data.image_size < 8:
      raise ValueError(f"config.data.image_size={data.image_size} is too "
                       f"small for {synthetic.NAME} (>= 8)")
    if data.num_eval_examples < 1:
      raise ValueError(f"config.data.num_eval_examples must be >= 1 for "
                       f"{synthetic.NAME} (the size of its test split)")
    data_dir = os.path.abspath(data_dir_of(data))
    existing = data_dir
    while not os.path.exists(existing):  # nearest existing ancestor
      existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
      raise ValueError(f"config.data.data_dir={data_dir!r}: cannot create or "
                       f"write it ({existing!r} is not a writable directory)")
    for key in ("image_key", "text_key", "label_key"):
      want = {"image_key": "image", "text_key": "captions/text",
              "label_key": "label"}[key]
      if data[key] not in (want, "") or (key == "image_key" and not data[key]):
        raise ValueError(f"config.data.{key}={data[key]!r}: {synthetic.NAME} "
                         f"has {want!r}")
    if not data.text_key:
      raise ValueError("config.data.text_key must name the caption feature")
  else:
    if not data.image_key or not data.text_key:
      raise ValueError("config.data.image_key and text_key must name the "
                       "image and caption features")
    builder = builder_for(data, prepare=False)
    keys = {"config.data.image_key": data.image_key,
            "config.data.text_key": data.text_key,
            "config.data.label_key": data.label_key}
    check_split_and_keys(builder, data.split, keys, "config.data.split")
    check_split_and_keys(builder, data.eval_split, keys, "config.data.eval_split")


def check_zeroshot(data) -> None:
  """config.data.zeroshot_name's dataset: prepared, with the split, the
  image feature and a ClassLabel (whose names name the classes)."""
  if data.zeroshot_name:
    zs = zeroshot_builder_for(data)
    check_split_and_keys(zs, data.zeroshot_split, {
        "config.data.zeroshot_image_key": data.zeroshot_image_key,
        "config.data.zeroshot_label_key": data.zeroshot_label_key,
    }, "config.data.zeroshot_split")
    if not isinstance(feature_at(zs.info.features, data.zeroshot_label_key),
                      _tfds().features.ClassLabel):
      raise ValueError(f"config.data.zeroshot_label_key="
                       f"{data.zeroshot_label_key!r} must be a ClassLabel "
                       "(its names are the zero-shot class names)")


def _as_text_list(value) -> list:
  if isinstance(value, (bytes, str)):
    return [value]
  return list(value)


class TfdsSource:
  """A split of a prepared TFDS dataset, in the source contract.

  Images arrive decoded (TFDS decodes through Pillow), as uint8 arrays.
  """

  def __init__(self, data, split: str):
    self._builder = builder_for(data)
    self._source = self._builder.as_data_source(split=split)
    self._keys = (data.image_key, data.text_key, data.label_key)
    self.split = split
    self.spec = f"{self._builder.info.full_name}[{split}]"
    self.bad_at_open = []

  def __len__(self):
    return len(self._source)

  def describe(self) -> str:
    return f"TFDS {self.spec}: {len(self)} examples"

  def _convert(self, index, example) -> dict:
    image_key, text_key, label_key = self._keys
    where = f"{self.spec}#{index}"
    captions = [c for c in _as_text_list(value_at(example, text_key))
                if (c.strip() if isinstance(c, (str, bytes)) else True)]
    if not captions:
      raise BadExample(where, f"missing or empty caption ({text_key!r})")
    return {"key": where, "image": np.asarray(value_at(example, image_key)),
            "captions": captions,
            "label": int(value_at(example, label_key)) if label_key else -1}

  def __getitem__(self, index: int) -> dict:
    return self._convert(index, self._source[index])

  def __getitems__(self, indices):
    out = []
    for i, ex in zip(indices, self._source.__getitems__(list(indices))):
      try:
        out.append(self._convert(i, ex))
      except BadExample as e:
        out.append(e)
    return out
