"""Held-out evaluation as the CLIP/LiT papers compute it.

``Evaluator(params)`` streams each evaluation split through the image tower
(``train.eval.embed``: batches straight from the source, data-parallel over
the mesh and the processes, only the (N, D) embeddings kept), then computes

* zero-shot classification: top-1 and top-5 against the class embeddings,
  each the normalized mean over the prompt templates (``train.eval.zeroshot``;
  names and templates from ``train.eval.names``), with chance 1/classes;
* image <-> text retrieval over every caption of every image: R@1/5/10 both
  ways (``train.eval.retrieval``).

When the zero-shot set and the retrieval set are the same split (the
trainer's own eval split with labels), it is read and embedded once.
"""
from __future__ import annotations

import numpy as np

from train.eval import embed as embed_lib
from train.eval import retrieval as retrieval_lib
from train.eval import zeroshot as zeroshot_lib

# Batched embedding of a host array (token ids; the embedding cache's images).
embed_all = embed_lib.embed_host_array


def class_embeddings(embed_txt, txt_params, tokenizer, classnames, templates,
                     batch_size: int) -> np.ndarray:
  """(num_classes, D): per class, the normalized mean over templates."""
  tokens = tokenizer.encode(zeroshot_lib.prompts(classnames, templates))
  return zeroshot_lib.average_templates(
      embed_all(embed_txt, txt_params, tokens, batch_size), len(classnames))


def caption_table(captions):
  """Per-image caption lists -> (flat captions, image index of each)."""
  texts, owner = [], []
  for i, caps in enumerate(captions):
    texts.extend(caps)
    owner.extend([i] * len(caps))
  return texts, np.asarray(owner, np.int64)


class Evaluator:
  """All held-out metrics of a parameter set ``{"img", "txt", "head"}``.

  Args:
    mesh: the 1-D "data" mesh (all devices of all processes).
    image_tower: the ``train.towers.Tower`` of the image tower (its
      ``embed(params, uint8)`` is used; its own params are not).
    text_tower: the text tower module.
    tokenizer: the trainer's tokenizer.
    zeroshot, retrieval: from ``train.data.make_eval_sets`` (None: skipped).
    batch_size: global images or texts per batch (a multiple of mesh.size).
    zeroshot_skipped: why there is no zero-shot set (``describe`` says it).
  """

  def __init__(self, *, mesh, image_tower, text_tower, tokenizer, zeroshot,
               retrieval, batch_size: int, zeroshot_skipped: str = ""):
    self.mesh, self.tokenizer = mesh, tokenizer
    self.zeroshot, self.retrieval = zeroshot, retrieval
    self.zeroshot_skipped = zeroshot_skipped
    self.batch_size = batch_size
    self._embed_img = embed_lib.make_image_embed(mesh, image_tower.embed)
    self._embed_txt = embed_lib.make_embed_fn(mesh, text_tower)
    self._prompt_tokens = None
    if zeroshot is not None:
      self._prompt_tokens = tokenizer.encode(zeroshot_lib.prompts(
          zeroshot.classnames, zeroshot.templates))

  def describe(self) -> list[str]:
    """One console line per evaluation set: what is evaluated, from where."""
    lines = []
    zs, rs = self.zeroshot, self.retrieval
    if zs is not None:
      p = zs.prompts
      lines.append(
          f"[lit] zero-shot eval: {zs.split.num_examples} images of "
          f"{zs.split.name}" + _prefix_note(zs.split)
          + f", {len(p.classnames)} classes (names from {p.classnames_from}),"
          f" {len(p.templates)} templates (from {p.templates_from})")
    elif self.zeroshot_skipped:
      lines.append(f"[lit] zero-shot eval: skipped: {self.zeroshot_skipped}")
    if rs is not None:
      lines.append(f"[lit] retrieval eval: {rs.split.num_examples} images of "
                   f"{rs.split.name}" + _prefix_note(rs.split)
                   + ", every caption of each image")
    return lines

  def _embed(self, split, params, keep_captions):
    return embed_lib.embed_split(split, mesh=self.mesh,
                                 image_embed=self._embed_img,
                                 params=params["img"],
                                 batch_size=self.batch_size,
                                 keep_captions=keep_captions)

  def __call__(self, params) -> dict[str, float]:
    zs, rs = self.zeroshot, self.retrieval
    out = {}
    shared = None
    if zs is not None:
      same = rs is not None and rs.split is zs.split
      emb = self._embed(zs.split, params, keep_captions=same)
      shared = emb if same else None
      cls = zeroshot_lib.average_templates(
          embed_all(self._embed_txt, params["txt"], self._prompt_tokens,
                    self.batch_size), len(zs.classnames))
      out.update(zeroshot_lib.accuracy(zeroshot_lib.normalize(emb.images),
                                       cls, emb.labels))
    if rs is not None:
      emb = shared or self._embed(rs.split, params, keep_captions=True)
      texts, owner = caption_table(emb.captions)
      txt = np.zeros((0, emb.images.shape[-1]), np.float32)
      if texts:
        txt = embed_all(self._embed_txt, params["txt"],
                        self.tokenizer.encode(texts), self.batch_size)
      out.update(retrieval_lib.recall(zeroshot_lib.normalize(emb.images),
                                      zeroshot_lib.normalize(txt), owner))
      out["retrieval_num_images"] = float(len(emb.images))
      out["retrieval_num_captions"] = float(len(texts))
    return out


def _prefix_note(split) -> str:
  if split.num_examples == split.total_examples:
    return " (the whole split)"
  return (f" (the first {split.num_examples} of {split.total_examples}: "
          "config.data.num_eval_examples)")
