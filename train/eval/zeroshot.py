"""Zero-shot classification from embeddings: class embeddings, top-k, chance.

Every class name goes into every template; a class's text embeddings are
L2-normalized, averaged over its templates and normalized again (the CLIP
recipe); an image's scores are its cosine similarities to the classes.
Top-k counts an image when fewer than k classes score strictly above its
true class (ties in its favour, as in retrieval).

Chance is defined once, here: the expected top-1 of a uniform random guess,
1 / number of classes (not the majority class of the split), printed the same
way everywhere by ``describe``.
"""
from __future__ import annotations

import numpy as np

KS = (1, 5)


def normalize(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def prompts(classnames, templates) -> list[str]:
  """Class-major: class 0 with every template, then class 1, ..."""
  return [t.replace("{}", c) for c in classnames for t in templates]


def average_templates(prompt_emb: np.ndarray, num_classes: int) -> np.ndarray:
  """(C * T, D) prompt embeddings (class-major) -> (C, D) class embeddings."""
  emb = normalize(prompt_emb).reshape(num_classes, -1, prompt_emb.shape[-1])
  return normalize(emb.mean(axis=1))


def chance(num_classes: int) -> float:
  """Top-1 of a uniform random guess over the classes."""
  return 1.0 / max(int(num_classes), 1)


def accuracy(img: np.ndarray, cls: np.ndarray, labels: np.ndarray,
             ks=KS, block: int = 4096) -> dict[str, float]:
  """``zeroshot_top{k}`` of normalized image and class embeddings."""
  img, cls = np.asarray(img, np.float32), np.asarray(cls, np.float32)
  labels = np.asarray(labels, np.int64)
  n, c = img.shape[0], cls.shape[0]
  out = {"zeroshot_num_classes": float(c), "zeroshot_chance": chance(c),
         "zeroshot_num_examples": float(n)}
  if labels.size and (labels.min() < 0 or labels.max() >= c):
    raise ValueError(f"zero-shot labels outside [0, {c}): "
                     f"{sorted(set(labels[(labels < 0) | (labels >= c)]))[:5]}")
  if n == 0 or not (np.isfinite(img).all() and np.isfinite(cls).all()):
    # No images, or a NaN score (which would compare False and rank first).
    out.update({f"zeroshot_top{k}": float("nan") for k in ks})
    return out
  ranks = np.empty((n,), np.int64)
  for a in range(0, n, block):
    sim = img[a:a + block] @ cls.T
    own = sim[np.arange(sim.shape[0]), labels[a:a + block]]
    ranks[a:a + block] = (sim > own[:, None]).sum(axis=1)
  out.update({f"zeroshot_top{k}": float(np.mean(ranks < k)) for k in ks})
  return out


def describe(m: dict, prefix: str = "") -> str:
  """"top-1 54.7%, top-5 98.1% (8 classes; chance 1/8 = 12.5%, 4.4x)"."""
  acc = m[f"{prefix}zeroshot_top1"]
  n = int(m[f"{prefix}zeroshot_num_classes"])
  ch = m[f"{prefix}zeroshot_chance"]
  top5 = m.get(f"{prefix}zeroshot_top5")
  s = f"top-1 {100 * acc:.1f}%"
  if top5 is not None and n > 5:
    s += f", top-5 {100 * top5:.1f}%"
  return (s + f" ({n} classes; chance 1/{n} = {100 * ch:.1f}%, "
          f"{acc / ch:.1f}x)")
