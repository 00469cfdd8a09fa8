"""Float64 numpy references with analytic (closed-form) gradients.

Independent of JAX, so a bug in the library's reference cannot hide a bug in
the tiled code. ``test_np_reference.py`` checks these gradients against
finite differences, so they are themselves tested.
"""
import functools

import numpy as np


def _lse(a, axis):
  m = np.max(a, axis=axis, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(a - m), axis=axis))


def round_tf32(a):
  """float32 values of ``a`` rounded to nearest TF32 (10 mantissa bits, ties
  to even), as float64: what the GPU's TF32 tiles multiply (the library
  rounds their operands so, since Triton's TF32 dot truncates)."""
  bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
  bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
  return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def clip_loss_and_grads(x, y, scale, bias=0.0, direction="both", labels=None,
                        related=None, group_mode="mask", tiles=None):
  """Returns (loss, dx, dy, dscale, dbias) in float64.

  ``labels`` (one-way directions): query i's positive is key labels[i]
  (texts for image_to_text, images for text_to_image) instead of key i.
  ``related``: optional (B_x, B_y) bool, the pairs left out of every
  log-sum-exp but the positive's (``groups=`` in "mask" mode), or with
  ``group_mode="positives"`` every query's positives (multi-positive
  InfoNCE: ``_multi_positive``; no labels).
  ``tiles``: "tf32" for the loss that the GPU's TF32 tiles compute exactly:
  every logit from operands rounded to TF32 (``round_tf32``) but those the
  library takes outside the tiles, in float32 (each query's positive; in
  "positives" mode the pairs of the queries with one related key), the
  gradients flowing through the same operands. float32 on TF32 tiles is
  held to this reference, as 16-bit inputs are to the one of their
  rounded inputs: what is left is the kernels' own error.
  """
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  scale = float(scale)
  bias = float(bias)
  s0 = x @ y.T
  bx, by = s0.shape
  n = min(bx, by)
  if group_mode == "positives":
    rel = np.asarray(related, bool)
    e = rel
    outside = rel & (rel.sum(1) == 1)[:, None]
    per_row = _multi_positive
  elif group_mode == "mask":
    e = np.zeros_like(s0)
    if labels is None:
      e[np.arange(n), np.arange(n)] = 1.0
    elif direction == "image_to_text":
      e[np.arange(bx), np.asarray(labels)] = 1.0
    elif direction == "text_to_image":
      e[np.asarray(labels), np.arange(by)] = 1.0
    else:
      raise ValueError("labels need a one-way direction")
    outside = e > 0
    per_row = _cross_entropy
  else:
    raise ValueError(group_mode)
  operands = None
  s_mean = None
  if tiles == "tf32":
    x_t, y_t = round_tf32(x), round_tf32(y)
    # In "positives" mode the related pairs' mean is taken outside the tiles
    # too (in float32, ``groups_lib.positives_term``), their LSE inside.
    s_mean = scale * s0 + bias
    s0_t = x_t @ y_t.T
    operands = (outside, x_t, y_t, s0, s0_t)
    s0 = np.where(outside, s0, s0_t)
  elif tiles is not None:
    raise ValueError(tiles)
  s = scale * s0 + bias
  if group_mode == "mask" and related is not None:
    s = np.where(np.asarray(related) & (e == 0), -np.inf, s)
  if group_mode == "positives":
    per_row = functools.partial(_multi_positive,
                                s_mean=None if s_mean is None else (s_mean,))
  return _directions(per_row, s, s0, x, y, scale, e, direction, operands)


def _directions(per_row, s, s0, x, y, scale, e, direction, operands=None):
  """The mean loss of ``direction`` from ``per_row(s, e)`` -> (per-row
  losses, d/ds, the part of d/ds through the exact logits) of rows
  (image_to_text) and of columns (text_to_image, through the transposes),
  and its gradients (``operands``: (the pairs whose logits are x . y, x_t,
  y_t the other pairs' operands, x . y and x_t . y_t), or None)."""
  bx, by = s.shape
  if direction == "both":
    l_r, g_r, x_r = per_row(s, e)
    l_c, g_c, x_c = per_row(s.T, e.T, transposed=True)
    loss = 0.5 * (np.mean(l_r) + np.mean(l_c))
    g = g_r / (2 * bx) + g_c.T / (2 * by)
    g_x = x_r / (2 * bx) + x_c.T / (2 * by)
  elif direction == "image_to_text":
    l_r, g_r, x_r = per_row(s, e)
    loss, g, g_x = np.mean(l_r), g_r / bx, x_r / bx
  elif direction == "text_to_image":
    l_c, g_c, x_c = per_row(s.T, e.T, transposed=True)
    loss, g, g_x = np.mean(l_c), g_c.T / by, x_c.T / by
  else:
    raise ValueError(direction)
  if operands is None:
    return loss, scale * g @ y, scale * g.T @ x, np.sum(g * s0), np.sum(g)
  outside, x_t, y_t, s0_exact, s0_t = operands
  g_out = np.where(outside, g, g_x)
  g_in = np.where(outside, 0.0, g - g_x)
  return (loss, scale * (g_out @ y + g_in @ y_t),
          scale * (g_out.T @ x + g_in.T @ x_t),
          np.sum(g_out * s0_exact + g_in * s0_t), np.sum(g))


def _multi_positive(s, rel, transposed=False, s_mean=None):
  """Per query row of ``s`` with related keys ``rel`` (k of them): the loss
  LSE_j s_ij - mean over the related of s_ij, and d loss / d s.

  With N the LSE of the unrelated keys, R of the related ones and
  q = exp(s - R) (the softmax within the related), the loss is
  softplus(N - R) + (R - mean), the second part exactly 0 for k = 1 and
  >= log k otherwise; d loss / d s is exp(s - LSE) at an unrelated key and
  (q - 1/k) - q sigmoid(N - R) at a related one (-sigmoid(N - s_pos) for
  k = 1: ``_cross_entropy``'s form). Nothing cancels, whatever the
  confidence.
  """
  k = np.sum(rel, axis=1)
  n = _lse(np.where(rel, -np.inf, s), 1)
  r = _lse(np.where(rel, s, -np.inf), 1)
  # ``s_mean``: (logits,) of the related pairs' mean where it is taken from
  # other (exact) logits than the LSEs; its share of d/ds, -1/k, is returned
  # apart.
  s_m = s if s_mean is None else (s_mean[0].T if transposed else s_mean[0])
  mean = np.sum(np.where(rel, s_m, 0.0), axis=1) / k
  u = n - r
  loss = np.logaddexp(0.0, u) + np.where(k == 1, 0.0, r - mean)
  sig = np.exp(-np.logaddexp(0.0, -u))
  full = r + np.logaddexp(0.0, u)
  q = np.exp(np.where(rel, s, -np.inf) - r[:, None])
  p = np.exp(np.where(rel, -np.inf, s) - full[:, None])
  g_rel = (q - 1.0 / k[:, None]) - q * sig[:, None]
  g_mean = np.where(rel & (k[:, None] > 1), -1.0 / k[:, None], 0.0)
  return loss, np.where(rel, g_rel, p), g_mean


def confident_inputs(rng, n_x, n_y, d, loss, *, direction="both",
                     labels=None, groups=None, related=None, noise=0.05):
  """Float64 unit embeddings of a confident model and the scale at which
  the float64 loss is ``loss`` (per-row losses spread around it).

  Each query sits near its positive key (``noise`` apart, so p_pos -> 1 as
  the scale grows); keys without a query are random. ``groups`` (one id
  per pair) puts the members of a group near one centre, as the captions
  of one image: their pairs are related, left out in "mask" mode.
  ``related`` instead: any (n_x, n_y) bool relation ("mask" mode), the
  keys random (a positive may lie outside its query's group, and a key
  related to nothing sits far from every query but its own).
  Returns (x, y, scale).
  """
  if groups is not None and related is not None:
    raise ValueError("groups= or related=, not both")
  def unit(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)

  flip = direction == "text_to_image"
  n_q, n_k = (n_y, n_x) if flip else (n_x, n_y)
  keys = unit(rng.standard_normal((n_k, d)))
  if groups is not None:
    centres = unit(rng.standard_normal((int(np.max(groups)) + 1, d)))
    keys[:len(groups)] = unit(centres[groups] + 0.5 * noise
                              * rng.standard_normal((len(groups), d)))
  idx = np.arange(n_q) if labels is None else np.asarray(labels)
  queries = unit(keys[idx] + noise * rng.standard_normal((n_q, d)))
  x, y = (keys, queries) if flip else (queries, keys)
  rel = related if groups is None else (np.asarray(groups)[:, None]
                                        == np.asarray(groups)[None, :])
  loss_at = _loss_only(x @ y.T, direction, labels, rel)
  return x, y, _scale_at(loss_at, loss, max_scale=1e4)


def _loss_only(s0, direction, labels, related):
  """``clip_loss_and_grads``'s loss alone as a function of the scale, the
  logits ``s0`` computed once: the scale search below calls it ~30 times
  (the gradients would cost ~5x more each time)."""
  bx, by = s0.shape
  e = np.zeros(s0.shape, bool)
  if labels is None:
    e[np.arange(min(bx, by)), np.arange(min(bx, by))] = True
  elif direction == "image_to_text":
    e[np.arange(bx), np.asarray(labels)] = True
  else:
    e[np.asarray(labels), np.arange(by)] = True
  drop = e if related is None else (np.asarray(related) | e)

  def rows(s, e, drop):
    s_pos = np.sum(np.where(e, s, 0.0), axis=1)
    return np.mean(np.logaddexp(0.0, _lse(np.where(drop, -np.inf, s), 1)
                                - s_pos))

  def f(t):
    s = t * s0
    if direction == "image_to_text":
      return rows(s, e, drop)
    if direction == "text_to_image":
      return rows(s.T, e.T, drop.T)
    return 0.5 * (rows(s, e, drop) + rows(s.T, e.T, drop.T))
  return f


def _scale_at(f, loss, max_scale, rtol=1e-9):
  """The scale t at which the decreasing loss ``f(t)`` is ``loss``, by
  bisection to ``rtol`` of t (the loss then within ~rtol * t of it,
  relative). Above log(B) (the loss at scale 0) it is a negative scale:
  positives less similar than the rest."""
  lo, hi = (0.0, 8.0) if f(0.0) > loss else (-8.0, 0.0)
  while f(hi) > loss:
    if hi > max_scale:
      raise ValueError(f"no scale reaches a loss of {loss:g}: some query "
                       f"is not closest to its positive")
    lo, hi = hi, 2 * hi
  while f(lo) < loss:
    lo, hi = 2 * lo, lo
  while hi - lo > rtol * max(abs(lo), abs(hi)):
    mid = 0.5 * (lo + hi)
    lo, hi = (mid, hi) if f(mid) > loss else (lo, mid)
  return 0.5 * (lo + hi)


def positives_inputs(rng, n_x, n_y, d, loss, g_x, g_y, *, direction="both",
                     near=None, noise=0.05, spread=0.2):
  """Float64 unit embeddings of a confident model for "positives" groups
  (``g_x``, ``g_y``: the ids of the images and of the texts) and the scale
  at which the mean term of the queries (and, both directions, keys) with
  ONE related partner is ``loss``; the others' terms are at least log 2.

  The keys of an id sit near one centre (``spread`` apart per dimension),
  as the captions of one image; query i sits near key ``near[i]`` (default
  i), ``noise`` apart.
  Returns (x, y, scale).
  """
  def unit(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)

  flip = direction == "text_to_image"
  n_q, n_k = (n_y, n_x) if flip else (n_x, n_y)
  g_k = np.asarray(g_x if flip else g_y)
  ids, at = np.unique(g_k, return_inverse=True)
  centres = unit(rng.standard_normal((len(ids), d)))
  keys = unit(centres[at] + spread * rng.standard_normal((n_k, d)))
  idx = np.arange(n_q) if near is None else np.asarray(near)
  queries = unit(keys[idx] + noise * rng.standard_normal((n_q, d)))
  x, y = (keys, queries) if flip else (queries, keys)
  rel = np.equal.outer(np.asarray(g_x), np.asarray(g_y))
  s0 = x @ y.T
  # The rows with one related key: softplus(N - s_pos) (``_multi_positive``
  # with k = 1), the loss alone.
  one_r, one_c = rel.sum(1) == 1, rel.sum(0) == 1

  def one_key_terms(s, rel, one):
    s, rel = s[one], rel[one]
    s_pos = np.sum(np.where(rel, s, 0.0), axis=1)
    return np.logaddexp(0.0, _lse(np.where(rel, -np.inf, s), 1) - s_pos)

  def f(t):
    terms = []
    if direction != "text_to_image":
      terms.append(one_key_terms(t * s0, rel, one_r))
    if direction != "image_to_text":
      terms.append(one_key_terms(t * s0.T, rel.T, one_c))
    return np.mean(np.concatenate(terms))

  return x, y, _scale_at(f, loss, max_scale=1e5)


def _cross_entropy(s, e, transposed=False):
  """Per query row of ``s`` (its positive where ``e`` is 1): the loss
  log1p(sum over the others of exp(s_ij - s_pos)) and d loss / d s.

  The positive stays out of the log-sum-exp: with n the others' LSE and
  u = n - s_pos, the loss is softplus(u) and the positive's gradient is
  -(1 - p) = -sigmoid(u), neither a difference of nearly equal numbers, so
  both keep float64's relative precision however confident the row (a
  per-row loss of 1e-30 included; r - s_pos would be 0 there).
  """
  pos = e > 0
  s_pos = np.sum(np.where(pos, s, 0.0), axis=1)
  others = np.where(pos, -np.inf, s)
  u = _lse(others, 1) - s_pos
  loss = np.logaddexp(0.0, u)
  sig = np.exp(-np.logaddexp(0.0, -u))
  p = np.exp(others - (s_pos + loss)[:, None])  # 0 at the positive
  del transposed
  return loss, p - e * sig[:, None], np.zeros_like(s)


def sigmoid_tile_sums_and_grads(x, y, scale, bias, has_diagonal=True):
  """Float64 (sum, dx, dy, dscale, dbias) of the sigmoid tile ops, coef = 1.

  sum = sum_ij softplus(-z_ij s_ij) with z = +1 on the diagonal when
  ``has_diagonal`` (else every pair is a negative); G = -z sigmoid(-z s).
  """
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  scale = float(scale)
  s0 = x @ y.T
  s = scale * s0 + float(bias)
  z = -np.ones_like(s)
  if has_diagonal:
    np.fill_diagonal(z, 1.0)
  total = np.sum(np.logaddexp(0.0, -z * s))
  g = -z * np.exp(-np.logaddexp(0.0, z * s))  # -z * sigmoid(-z s), stable
  return total, scale * g @ y, scale * g.T @ x, np.sum(g * s0), np.sum(g)


def sigmoid_loss_and_grads(x, y, scale, bias):
  """Float64 (loss, dx, dy, dscale, dbias) of the SigLIP loss, 1/B-normalized."""
  n = np.asarray(x).shape[0]
  return tuple(v / n for v in sigmoid_tile_sums_and_grads(x, y, scale, bias))
