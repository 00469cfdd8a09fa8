"""Float64 numpy references with analytic (closed-form) gradients.

Independent of JAX, so a bug in the library's reference cannot hide a bug in
the tiled code. ``test_np_reference.py`` checks these gradients against
finite differences, so they are themselves tested.
"""
import numpy as np


def _lse(a, axis):
  m = np.max(a, axis=axis, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  return np.squeeze(m, axis) + np.log(np.sum(np.exp(a - m), axis=axis))


def clip_loss_and_grads(x, y, scale, bias=0.0, direction="both", labels=None):
  """Returns (loss, dx, dy, dscale, dbias) in float64.

  ``labels`` (one-way directions): query i's positive is key labels[i]
  (texts for image_to_text, images for text_to_image) instead of key i.
  """
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  scale = float(scale)
  bias = float(bias)
  s0 = x @ y.T
  s = scale * s0 + bias
  bx, by = s.shape
  n = min(bx, by)
  r = _lse(s, 1)
  c = _lse(s, 0)
  e = np.zeros_like(s)
  if labels is None:
    e[np.arange(n), np.arange(n)] = 1.0
  elif direction == "image_to_text":
    e[np.arange(bx), np.asarray(labels)] = 1.0
  elif direction == "text_to_image":
    e[np.asarray(labels), np.arange(by)] = 1.0
  else:
    raise ValueError("labels need a one-way direction")
  # Each query's positive logit (e has one 1 per query row / column).
  if direction == "image_to_text":
    diag = np.sum(e * s, axis=1)
  elif direction == "text_to_image":
    diag = np.sum(e * s, axis=0)
  else:
    diag = np.diagonal(s)[:n]
  p_r = np.exp(s - r[:, None])
  p_c = np.exp(s - c[None, :])
  if direction == "both":
    loss = 0.5 * (np.mean(r - diag) + np.mean(c - diag))
    g = (p_r - e) / (2 * bx) + (p_c - e) / (2 * by)
  elif direction == "image_to_text":
    loss = np.mean(r - diag)
    g = (p_r - e) / bx
  elif direction == "text_to_image":
    loss = np.mean(c - diag)
    g = (p_c - e) / by
  else:
    raise ValueError(direction)
  dx = scale * g @ y
  dy = scale * g.T @ x
  return loss, dx, dy, np.sum(g * s0), np.sum(g)


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
