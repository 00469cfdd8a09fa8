"""Precomputed image embeddings for a locked image tower (LiT).

A locked tower maps an image to the same embedding at every step, so it only
needs to see each image once. ``ImageEmbeddingCache`` keys embeddings by the
image's content (a hash of its preprocessed pixels): the first time an image
appears it is embedded (in fixed-size batches, data-parallel over the mesh),
afterwards its embedding is looked up. After the first epoch a train step
runs the text tower and the loss only. Keying by content works with any data
iterator (no example ids needed) and is exact: a different preprocessing of
the same example is a different image and gets its own embedding.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np

from train import evaluate


class ImageEmbeddingCache:
  """Content-addressed image -> embedding table on the host.

  Args:
    embed_fn: jitted ``embed_fn(params, images) -> (n, D)``.
    params: the (locked) image tower params.
    batch_size: images per embedding call (a multiple of the device count).
  """

  def __init__(self, embed_fn: Callable, params, batch_size: int):
    self._embed_fn = embed_fn
    self._params = params
    self._batch_size = batch_size
    self._index: dict[bytes, int] = {}
    self._table: np.ndarray | None = None
    self.hits = 0
    self.misses = 0

  def __len__(self):
    return len(self._index)

  @staticmethod
  def _key(image: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(image).tobytes(),
                           digest_size=16).digest()

  def __call__(self, images: np.ndarray) -> np.ndarray:
    """(b, H, W, 3) images -> (b, D) float32 embeddings."""
    keys = [self._key(im) for im in images]
    new_rows, seen = [], set()
    for i, k in enumerate(keys):
      if k not in self._index and k not in seen:
        seen.add(k)
        new_rows.append(i)
    self.misses += len(new_rows)
    self.hits += len(keys) - len(new_rows)
    if new_rows:
      emb = evaluate.embed_all(self._embed_fn, self._params, images[new_rows],
                               self._batch_size)
      start = len(self._index)
      if self._table is None:
        self._table = np.zeros((max(1024, 2 * len(new_rows)), emb.shape[1]),
                               np.float32)
      while start + len(new_rows) > self._table.shape[0]:
        self._table = np.concatenate([self._table, np.zeros_like(self._table)])
      self._table[start:start + len(new_rows)] = emb
      for j, i in enumerate(new_rows):
        self._index[keys[i]] = start + j
    return self._table[[self._index[k] for k in keys]]
