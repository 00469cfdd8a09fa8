"""Image <-> text retrieval recall, over every caption (as the papers do).

``N`` images, ``T`` captions, ``caption_image[t]`` the image of caption t
(COCO and Flickr30k have about 5 per image):

* image -> text: the query is an image, the candidates all T captions; a hit
  at K if ANY of the image's captions is among the K most similar;
* text -> image: every caption is a query over the N images; a hit at K if
  its own image is among the K most similar.

Ties: a candidate ranks above the match only when strictly more similar, so
equal scores count in the match's favour (what an exact-score argsort gives
when the match happens to come first). Non-finite embeddings give NaN
recalls, never a number. The similarity is computed in row
blocks, so memory is O(block x max(N, T)) on top of the embeddings.
"""
from __future__ import annotations

import numpy as np

KS = (1, 5, 10)


def _blocks(n: int, block: int):
  for start in range(0, n, block):
    yield start, min(start + block, n)


def image_to_text_ranks(img, txt, caption_image, block: int = 1024):
  """Per image: how many captions score strictly above its best caption.

  An image without captions gets rank T (never a hit).
  """
  img, txt = np.asarray(img, np.float32), np.asarray(txt, np.float32)
  caption_image = np.asarray(caption_image, np.int64)
  n, t = img.shape[0], txt.shape[0]
  ranks = np.full((n,), t, np.int64)
  for a, b in _blocks(n, block):
    sim = img[a:b] @ txt.T                                    # [b - a, T]
    own = (caption_image[None, :] == np.arange(a, b)[:, None])
    best = np.where(own, sim, -np.inf).max(axis=1)            # [b - a]
    has = own.any(axis=1)
    ranks[a:b] = np.where(has, (sim > best[:, None]).sum(axis=1), t)
  return ranks


def text_to_image_ranks(img, txt, caption_image, block: int = 1024):
  """Per caption: how many images score strictly above its own image."""
  img, txt = np.asarray(img, np.float32), np.asarray(txt, np.float32)
  caption_image = np.asarray(caption_image, np.int64)
  ranks = np.zeros((txt.shape[0],), np.int64)
  for a, b in _blocks(txt.shape[0], block):
    sim = txt[a:b] @ img.T                                    # [b - a, N]
    own = sim[np.arange(b - a), caption_image[a:b]]
    ranks[a:b] = (sim > own[:, None]).sum(axis=1)
  return ranks


def recall(img, txt, caption_image, ks=KS) -> dict[str, float]:
  """``i2t_r{k}`` and ``t2i_r{k}`` of normalized embeddings (module doc)."""
  caption_image = np.asarray(caption_image, np.int64)
  if caption_image.size and (caption_image.min() < 0 or
                             caption_image.max() >= len(img)):
    raise ValueError("caption_image indexes outside the images")
  if not (np.isfinite(img).all() and np.isfinite(txt).all()):
    # A NaN similarity compares False with everything: it would rank first.
    return {f"{d}_r{k}": float("nan") for d in ("i2t", "t2i") for k in ks}
  i2t = image_to_text_ranks(img, txt, caption_image)
  t2i = text_to_image_ranks(img, txt, caption_image)
  out = {}
  for k in ks:
    out[f"i2t_r{k}"] = float(np.mean(i2t < k)) if len(i2t) else float("nan")
  for k in ks:
    out[f"t2i_r{k}"] = float(np.mean(t2i < k)) if len(t2i) else float("nan")
  return out
