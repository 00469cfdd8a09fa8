"""Full-matrix definitions of the losses.

These build the whole (B_x, B_y) logit matrix, so they need O(B**2) memory.
They are the definitions the tiled backends must match, written to be
obviously correct rather than fast, and serve as ``backend="reference"``.
JAX autodiff gives their gradients.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from infcl_jax._math import softplus


def logits(image_emb, text_emb, logit_scale, logit_bias=None):
  """s_ij = logit_scale * <x_i, y_j> + logit_bias, in float32 (or wider)."""
  acc = jnp.promote_types(jnp.float32, jnp.result_type(image_emb, text_emb))
  s = jnp.einsum("id,jd->ij", image_emb, text_emb,
                 preferred_element_type=acc,
                 precision=jax.lax.Precision.HIGHEST)
  s = jnp.asarray(logit_scale, acc) * s
  if logit_bias is not None:
    s = s + jnp.asarray(logit_bias, acc)
  return s


def _group_matrix(groups, n_img, n_txt):
  """The (B_x, B_y) related pairs of ``groups`` (one array or a pair)."""
  g_x, g_y = groups if isinstance(groups, (tuple, list)) else (groups, groups)
  return jnp.asarray(g_x)[:n_img, None] == jnp.asarray(g_y)[None, :n_txt]


def _cross_entropy(s, pos):
  """Per query row of ``s``: -log softmax at its positive (``pos``, one True
  per row), as softplus(LSE of the others - positive): the positive stays
  out of the log-sum-exp, so a confident row's tiny loss (and its
  gradient) is not the difference of two numbers near the positive logit
  (the algebra: https://github.com/infcl-jax/infcl-jax/blob/main/docs/math.md#a-confident-model)."""
  s_pos = jnp.sum(jnp.where(pos, s, 0.0), axis=1)
  neg = jax.nn.logsumexp(jnp.where(pos, -jnp.inf, s), axis=1)
  return softplus(neg - s_pos)


def _grouped_clip(s, rel, direction, labels, group_mode):
  """The CLIP loss with groups on the full matrix (queries are rows)."""
  n_q, n_k = s.shape
  idx = jnp.arange(n_q) if labels is None else labels
  pos = jnp.zeros((n_q, n_k), bool).at[jnp.arange(n_q), idx].set(True)
  if group_mode == "mask":
    sm = jnp.where(rel & ~pos, -jnp.inf, s)
    rows = _cross_entropy(sm, pos)
    if direction != "both":
      return jnp.mean(rows)
    return 0.5 * (jnp.mean(rows) + jnp.mean(_cross_entropy(sm.T, pos.T)))
  if group_mode != "positives":
    raise ValueError(f"unknown group_mode {group_mode!r}")
  rows = _multi_positive(s, rel)
  if direction != "both":
    return jnp.mean(rows)
  return 0.5 * (jnp.mean(rows) + jnp.mean(_multi_positive(s.T, rel.T)))


def _multi_positive(s, rel):
  """Per query row of ``s``: LSE over all keys less the mean of its related
  logits (``rel``), as softplus(N - R) + (R - mean) with N the LSE of the
  unrelated keys and R of the related ones. The second part is exactly 0
  (value and gradient) for a row with one related key, which leaves the
  confident form of ``_cross_entropy``; otherwise it is at least log 2, and
  the sum does not cancel."""
  k = jnp.sum(rel, axis=1)
  # A row related to every key has no N (-inf); its LSE is not taken over
  # nothing, whose gradient would be NaN.
  some = k < s.shape[1]
  unrel = jnp.where(some, jax.nn.logsumexp(
      jnp.where(rel & some[:, None], -jnp.inf, s), axis=1), -jnp.inf)
  r = jax.nn.logsumexp(jnp.where(rel, s, -jnp.inf), axis=1)
  mean = jnp.sum(jnp.where(rel, s, 0.0), axis=1) / k
  return softplus(unrel - r) + jnp.where(k == 1, 0.0, r - mean)


def contrastive_loss_reference(image_emb, text_emb, logit_scale, *,
                               logit_bias=None, direction="both", labels=None,
                               groups=None, group_mode="mask"):
  """CLIP / InfoNCE loss on the full logit matrix.

  direction="both": mean of the image->text and text->image cross-entropies,
  positives on the diagonal. "image_to_text": rows are queries, the first
  B_x texts (or ``text_emb[labels]``) are their positives. "text_to_image":
  columns are queries, the first B_y images (or ``image_emb[labels]``) are
  their positives. ``groups`` / ``group_mode`` as in ``contrastive_loss``.
  """
  s = logits(image_emb, text_emb, logit_scale, logit_bias)
  n_img, n_txt = s.shape
  n_pos = min(n_img, n_txt)
  if groups is not None:
    rel = _group_matrix(groups, n_img, n_txt)
    if direction == "text_to_image":
      s, rel = s.T, rel.T
    elif direction not in ("both", "image_to_text"):
      raise ValueError(f"unknown direction {direction!r}")
    return _grouped_clip(s, rel, direction, labels, group_mode)
  if direction == "both":
    eye = jnp.eye(n_img, dtype=bool)
    return 0.5 * (jnp.mean(_cross_entropy(s, eye))
                  + jnp.mean(_cross_entropy(s.T, eye)))
  if direction == "text_to_image":
    s, n_img, n_txt = s.T, n_txt, n_img  # The texts are the queries.
  elif direction != "image_to_text":
    raise ValueError(f"unknown direction {direction!r}")
  idx = jnp.arange(n_pos) if labels is None else labels
  pos = jnp.arange(n_txt)[None, :] == jnp.asarray(idx)[:, None]
  return jnp.mean(_cross_entropy(s, pos))


def sigmoid_loss_reference(image_emb, text_emb, logit_scale, logit_bias, *,
                           groups=None, group_mode="mask"):
  """SigLIP sigmoid loss on the full logit matrix.

  L = -(1/B) sum_ij log sigmoid(z_ij * s_ij), with z_ij = +1 on the diagonal
  and -1 elsewhere, and B = B_x = B_y. With ``groups``, related pairs off
  the diagonal are left out ("mask") or get z = +1 ("positives").

  -log sigmoid(u) = softplus(-u) = max(-u, 0) + log1p(exp(-|u|)) is evaluated
  per element: log(sigmoid(u)) would underflow to log(0) for u << 0, and
  softplus(s) - s would cancel when the loss is tiny.
  """
  s = logits(image_emb, text_emb, logit_scale, logit_bias)
  n_img, n_txt = s.shape
  if n_img != n_txt:
    raise ValueError(
        f"the sigmoid loss needs equal batch sizes, got image_emb with "
        f"{n_img} rows and text_emb with {n_txt} rows")
  diag = jnp.eye(n_img, dtype=bool)
  keep = jnp.ones_like(diag)
  if groups is not None:
    rel = _group_matrix(groups, n_img, n_txt)
    if group_mode == "positives":
      diag = diag | rel
    elif group_mode == "mask":
      keep = ~(rel & ~diag)
    else:
      raise ValueError(f"unknown group_mode {group_mode!r}")
  z = jnp.where(diag, 1.0, -1.0).astype(s.dtype)
  return jnp.sum(jnp.where(keep, softplus(-z * s), 0.0)) / n_img
