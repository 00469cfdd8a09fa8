"""The loss's own diagnostics, logged with every train step's metrics.

The learned temperature and bias, and the mean/min/max of the positive
(matching pair) and negative logits, the way big_vision's image-text trainers
log them. The logits are those of the loss head (``scale * cos + bias``) on a
small sample of the batch: its first ``sample_size`` pairs, re-embedded with
the parameters the step's loss saw, so the cost is ``sample_size`` forward
passes and a ``sample_size x sample_size`` matrix, never ``B x B``.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from infcl_jax.flax import l2_normalize

SAMPLE_SIZE = 64


def make_sample_embedder(*, embed_img: Callable | None,
                         embed_txt: Callable, sample_size: int = SAMPLE_SIZE):
  """``fn(params, batch) -> (img [s, D], txt [s, D])`` of the first s pairs.

  Args:
    embed_img: ``embed_img(img_params, images)`` as the step applies the image
      tower, or None when batches carry precomputed ``"image_emb"``.
    embed_txt: ``embed_txt(txt_params, tokens)``.
    sample_size: s (capped by the batch size).
  """
  def sample(params, batch):
    s = min(sample_size, batch["text"].shape[0])
    txt = embed_txt(params["txt"], batch["text"][:s])
    if embed_img is None:
      img = batch["image_emb"][:s]
    else:
      img = embed_img(params["img"], batch["image"][:s])
    # The sample is diagnostic only: no gradient flows through it.
    return jax.lax.stop_gradient(img), jax.lax.stop_gradient(txt)

  return sample


def loss_diagnostics(head, params, batch, embed_sample: Callable | None):
  """Scalars for the metrics dict of one step (see the module docstring).

  ``head`` is the ``ContrastiveLoss`` module, ``params`` the parameters before
  the update (those of the step's loss). Without ``embed_sample`` only the
  scale, temperature and bias are reported.
  """
  scale, bias = head.apply({"params": params["head"]},
                           method=type(head).scale_and_bias)
  out = {"logit_scale": scale, "temperature": 1.0 / scale, "logit_bias": bias}
  if embed_sample is None:
    return out
  img, txt = embed_sample(params, batch)
  if head.normalize:
    img, txt = l2_normalize(img), l2_normalize(txt)
  logits = scale * jnp.dot(img.astype(jnp.float32), txt.astype(jnp.float32).T,
                           precision=jax.lax.Precision.HIGHEST) + bias
  s = logits.shape[0]
  eye = jnp.eye(s, dtype=bool)
  pos = jnp.diagonal(logits)
  out.update({"pos_logit_mean": jnp.mean(pos), "pos_logit_min": jnp.min(pos),
              "pos_logit_max": jnp.max(pos)})
  if s > 1:  # A sample of one pair has no negatives.
    n_neg = s * (s - 1)
    out.update({
        "neg_logit_mean": jnp.sum(jnp.where(eye, 0.0, logits)) / n_neg,
        "neg_logit_min": jnp.min(jnp.where(eye, jnp.inf, logits)),
        "neg_logit_max": jnp.max(jnp.where(eye, -jnp.inf, logits))})
  return out
