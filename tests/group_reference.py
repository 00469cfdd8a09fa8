"""Float64 numpy references of ``groups=`` with analytic gradients.

Independent of JAX, like ``np_reference``; ``test_groups.py`` checks their
gradients against finite differences. Pair (i, j) is related when
``gq[i] == gk[j]``.

Tile level (the seam of ``backends.base``): softmax tiles leave related
pairs out of both LSEs; sigmoid tiles drop them ("mask", the diagonal stays
a positive) or label them +1 ("positives").

Loss level (``contrastive_loss`` / ``sigmoid_loss``): "mask" removes the
related pairs other than each query's positive from its LSE; "positives"
makes every related pair a positive (the mean over a query's positives of
-log softmax, SupCon's L_out).
"""
import numpy as np


def _f64(*arrays):
  return [np.asarray(a, np.float64) for a in arrays]


def _lse(a, axis):
  m = np.max(a, axis=axis, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  with np.errstate(divide="ignore"):
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(a - m), axis=axis))


def related(gq, gk):
  return np.asarray(gq)[:, None] == np.asarray(gk)[None, :]


# ------------------------------------------------------------------ tiles


def tile_lse(x, y, scale, bias, gx, gy):
  """(row_lse, col_lse) with related pairs left out (-inf if all are)."""
  x, y = _f64(x, y)
  s = float(scale) * (x @ y.T) + float(bias)
  s = np.where(related(gx, gy), -np.inf, s)
  return _lse(s, 1), _lse(s, 0)


def tile_lse_grads(x, y, scale, bias, row_lse, col_lse, row_coef, col_coef,
                   gx, gy):
  """(dx, dy, dscale, dbias) of the seam's ``lse_grad`` with groups:
  G = row_coef exp(s - r) + col_coef exp(s - c), zero on related pairs."""
  x, y = _f64(x, y)
  s0 = x @ y.T
  s = float(scale) * s0 + float(bias)
  g = np.zeros_like(s)
  if row_lse is not None:
    g += row_coef * np.exp(s - np.asarray(row_lse, np.float64)[:, None])
  if col_lse is not None:
    g += col_coef * np.exp(s - np.asarray(col_lse, np.float64)[None, :])
  g = np.where(related(gx, gy), 0.0, g)
  return float(scale) * g @ y, float(scale) * g.T @ x, np.sum(g * s0), np.sum(g)


def sigmoid_labels(gx, gy, has_diagonal, mode):
  """(z, keep): the labels and the pairs that count, of a sigmoid tile."""
  n, m = len(gx), len(gy)
  diag = np.eye(n, m, dtype=bool) if has_diagonal else np.zeros((n, m), bool)
  rel = related(gx, gy)
  if mode == "positives":
    return np.where(diag | rel, 1.0, -1.0), np.ones((n, m), bool)
  if mode == "mask":
    return np.where(diag, 1.0, -1.0), ~(rel & ~diag)
  raise ValueError(mode)


def sigmoid_tile(x, y, scale, bias, gx, gy, has_diagonal, mode):
  """Float64 (sum, dx, dy, dscale, dbias) of the sigmoid tile ops with
  groups, coef = 1."""
  x, y = _f64(x, y)
  s0 = x @ y.T
  s = float(scale) * s0 + float(bias)
  z, keep = sigmoid_labels(gx, gy, has_diagonal, mode)
  total = np.sum(np.where(keep, np.logaddexp(0.0, -z * s), 0.0))
  g = np.where(keep, -z * np.exp(-np.logaddexp(0.0, z * s)), 0.0)
  return (total, float(scale) * g @ y, float(scale) * g.T @ x,
          np.sum(g * s0), np.sum(g))


# ------------------------------------------------------------------ losses


def _queries_keys(x, y, direction):
  if direction == "text_to_image":
    return y, x
  return x, y


def clip_loss_and_grads(x, y, scale, bias, gq, gk, mode="mask",
                        direction="both", labels=None):
  """Float64 (loss, dx, dy, dscale, dbias) of the CLIP loss with groups.

  ``gq`` / ``gk`` are the query and key groups (images / texts, swapped for
  "text_to_image"); ``labels`` (one-way, "mask" only) as in
  ``contrastive_loss``.
  """
  x, y = _f64(x, y)
  q, k = _queries_keys(x, y, direction)
  s0 = q @ k.T
  s = float(scale) * s0 + float(bias)
  bq, bk = s.shape
  rel = related(gq, gk)
  e = np.zeros_like(s)  # The positives' weights per query row.
  if mode == "mask":
    idx = np.arange(bq) if labels is None else np.asarray(labels)
    pos = np.zeros_like(s, dtype=bool)
    pos[np.arange(bq), idx] = True
    drop = rel & ~pos
    e[pos] = 1.0
    e_col = e.copy()
  elif mode == "positives":
    assert labels is None
    drop = np.zeros_like(rel)
    with np.errstate(invalid="ignore", divide="ignore"):
      e = rel / rel.sum(axis=1, keepdims=True)
      e_col = rel / rel.sum(axis=0, keepdims=True)
  else:
    raise ValueError(mode)
  sm = np.where(drop, -np.inf, s)
  r = _lse(sm, 1)
  p_r = np.where(drop, 0.0, np.exp(sm - r[:, None]))
  row_terms = r - np.sum(e * s, axis=1)
  if direction == "both":
    c = _lse(sm, 0)
    p_c = np.where(drop, 0.0, np.exp(sm - c[None, :]))
    col_terms = c - np.sum(e_col * s, axis=0)
    loss = 0.5 * (np.mean(row_terms) + np.mean(col_terms))
    g = (p_r - e) / (2 * bq) + (p_c - e_col) / (2 * bk)
  else:
    loss = np.mean(row_terms)
    g = (p_r - e) / bq
  dq = float(scale) * g @ k
  dk = float(scale) * g.T @ q
  dx, dy = (dk, dq) if direction == "text_to_image" else (dq, dk)
  return loss, dx, dy, np.sum(g * s0), np.sum(g)


def sigmoid_loss_and_grads(x, y, scale, bias, groups, mode="mask"):
  """Float64 (loss, dx, dy, dscale, dbias) of the SigLIP loss with groups
  (one array: the batch is paired), 1/B-normalized."""
  n = np.asarray(x).shape[0]
  out = sigmoid_tile(x, y, scale, bias, groups, groups, True, mode)
  return tuple(v / n for v in out)
