"""Held-out evaluation: zero-shot classification and image <-> text retrieval.

Zero-shot: every class name is put into every prompt template, the text
embeddings of a class are L2-normalized, averaged over its templates and
normalized again (the CLIP recipe); an image is assigned the class whose
averaged text embedding is most similar. Retrieval: image i's caption is
text i; R@K is the fraction of queries whose match ranks in the top K, in
both directions.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def embed_all(embed_fn: Callable, params, inputs: np.ndarray, batch_size: int):
  """``embed_fn(params, batch)`` over ``inputs`` in fixed-size batches.

  The last batch is padded (by repeating row 0) so that one compiled program
  serves every batch; the padding rows are dropped.
  """
  n = inputs.shape[0]
  out = []
  for start in range(0, n, batch_size):
    chunk = inputs[start:start + batch_size]
    pad = batch_size - chunk.shape[0]
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[:1], pad, axis=0)])
    out.append(np.asarray(embed_fn(params, chunk), np.float32)[:batch_size -
                                                                pad])
  return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _normalize(x):
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def class_embeddings(embed_txt: Callable, txt_params, tokenizer, classnames,
                     templates, batch_size: int):
  """(num_classes, D): per class, the normalized mean over templates."""
  prompts = [t.format(c) for c in classnames for t in templates]
  emb = _normalize(embed_all(embed_txt, txt_params, tokenizer.encode(prompts),
                             batch_size))
  emb = emb.reshape(len(classnames), len(templates), -1).mean(axis=1)
  return _normalize(emb)


def zero_shot(embed_img: Callable, embed_txt: Callable, params, tokenizer,
              zs, batch_size: int) -> dict[str, float]:
  """Top-1 accuracy of ``zs`` (a train.data.ZeroShotSet) and its chance."""
  img = _normalize(embed_all(embed_img, params["img"], zs.images, batch_size))
  cls = class_embeddings(embed_txt, params["txt"], tokenizer, zs.classnames,
                         zs.templates, batch_size)
  pred = np.argmax(img @ cls.T, axis=-1)
  labels = np.asarray(zs.labels)
  # Chance: always guessing the most frequent class.
  counts = np.bincount(labels, minlength=len(zs.classnames))
  return {"zeroshot_top1": float(np.mean(pred == labels)),
          "zeroshot_chance": float(counts.max() / max(len(labels), 1)),
          "zeroshot_num_classes": float(len(zs.classnames))}


def recall_at_k(sim: np.ndarray, ks=(1, 5, 10)) -> dict[int, float]:
  """R@K of ``sim`` (queries x candidates), query i's match is candidate i."""
  target = sim[np.arange(sim.shape[0]), np.arange(sim.shape[0])][:, None]
  # Rank = number of candidates strictly more similar than the match.
  rank = np.sum(sim > target, axis=1)
  return {k: float(np.mean(rank < k)) for k in ks}


def retrieval(embed_img: Callable, embed_txt: Callable, params, rs,
              batch_size: int) -> dict[str, float]:
  """Image -> text and text -> image R@1/5/10 of ``rs`` (a RetrievalSet)."""
  img = _normalize(embed_all(embed_img, params["img"], rs.images, batch_size))
  txt = _normalize(embed_all(embed_txt, params["txt"], rs.texts, batch_size))
  sim = img @ txt.T
  out = {}
  for name, s in (("i2t", sim), ("t2i", sim.T)):
    for k, v in recall_at_k(s).items():
      out[f"{name}_r{k}"] = v
  return out


def evaluate(embed_img: Callable, embed_txt: Callable, params, tokenizer,
             zs, rs, batch_size: int) -> dict[str, float]:
  """All held-out metrics; a set that is None is skipped."""
  out = {}
  if zs is not None:
    out.update(zero_shot(embed_img, embed_txt, params, tokenizer, zs,
                         batch_size))
  if rs is not None:
    out.update(retrieval(embed_img, embed_txt, params, rs, batch_size))
  return out
