"""The config keys that name files, and which of them take URLs.

Every key that names a file either reads it through the remote layer
(train/data/sources/remote.py: the same stores, credentials, retries and outage
budget as the training data) or refuses a URL in one line that names the
key. docs/data.md lists them.

- Read where they are (by range, never copied): ``data.name`` and
  ``data.eval_split`` (shards, tables and their images),
  ``data.shard_index_cache`` (a directory or a URL).
- Fetched once into a local cache (``FETCHED``: their readers, the
  tokenizers and the checkpoint loaders, take local paths): a URL is
  replaced by its local copy in the config the run uses
  (``localized``); config.json keeps the URL.
- Written by orbax: ``checkpoint.directory`` (local, gs:// or s3://:
  train/checkpoint.py).
- Local only (``LOCAL_ONLY``): refused with a URL.
"""
from __future__ import annotations

import copy

from train.data.sources import remote

# Keys whose file (or directory of files) is fetched from a URL.
FETCHED = ("data.zeroshot_classnames_file", "data.zeroshot_templates_file",
           "tokenizer.spm_path", "tokenizer.bpe_path", "model.image.init",
           "model.text.init")
# Keys that take no URL, and why.
LOCAL_ONLY = {
    "data.data_dir": "TFDS reads and synthetic_shapes writes a local or "
                     "mounted directory",
    "model.image.pretrain_path": "the run writes the pretrained tower there "
                                 "when it is missing",
}
# Read in place (train/data/sources/remote.py) or written by orbax: for the
# docs.
READ_IN_PLACE = ("data.name", "data.eval_split", "data.shard_index_cache",
                 "checkpoint.directory")


def _get(config, key: str):
  node = config
  for part in key.split("."):
    if node is None or part not in node:
      return None
    node = node[part]
  return node


def _set(config, key: str, value) -> None:
  *parents, last = key.split(".")
  node = config
  for part in parents:
    node = node[part]
  node[last] = value


def check(config) -> None:
  """One-line ValueError for a URL in a key that takes none."""
  for key, why in LOCAL_ONLY.items():
    value = _get(config, key)
    if isinstance(value, str) and remote.is_url(value):
      raise ValueError(f"config.{key}={remote.scrub(value)}: URLs are not "
                       f"taken here ({why}); give a local or mounted path")


def localized(config):
  """``config``, or a copy of it with each URL of the ``FETCHED`` keys
  replaced by the path of its local copy (``remote.local_copy``, through
  config.data's store). One-line error naming the key for a URL that
  cannot be read, or for one in a key that takes none (``check``)."""
  check(config)
  urls = {}
  for key in FETCHED:
    value = _get(config, key)
    if isinstance(value, str) and remote.is_url(value):
      urls[key] = value
  if not urls:
    return config
  store = remote.make_store(config.data)
  out = copy.deepcopy(config)
  for key, url in urls.items():
    try:
      local = remote.local_copy(store, url)
    except remote.NotFound:
      raise FileNotFoundError(f"config.{key}: {remote.scrub(url)} does not "
                              "exist") from None
    except remote.RemoteError as e:
      raise ValueError(f"config.{key}: {e}") from None
    _set(out, key, local)
  return out
