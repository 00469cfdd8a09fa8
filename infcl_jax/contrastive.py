"""The CLIP / InfoNCE loss on tiles: forward statistics, recompute backward.

``tiled_contrastive_loss`` is a ``jax.custom_vjp`` over a tile backend
(``tile_backend``). The forward keeps only the O(B) row / column LSE vectors
as residuals; the backward recomputes every tile once to form the gradient.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from infcl_jax import tile_backend

F32 = jnp.float32


def direction_weights(direction, n_img, n_txt):
  """Coefficients of the row-LSE, column-LSE and positive terms of the loss.

  L = row_w * sum_i r_i + col_w * sum_j c_j - pos_w * sum_{i<n} s_ii,
  with n = min(n_img, n_txt) positives.
  """
  if direction == "both":
    w = 0.5 / n_img
    return w, w, 2 * w
  if direction == "image_to_text":
    return 1.0 / n_img, 0.0, 1.0 / n_img
  if direction == "text_to_image":
    return 0.0, 1.0 / n_txt, 1.0 / n_txt
  raise ValueError(f"unknown direction {direction!r}")


def positive_logits(x, y, scale, bias):
  """s_ii for the first min(B_x, B_y) pairs, in float32. O(B * D)."""
  n = min(x.shape[0], y.shape[0])
  xs, ys = x[:n].astype(F32), y[:n].astype(F32)
  return scale * jnp.sum(xs * ys, axis=-1) + bias, xs, ys


def positive_grads(x, y, scale, bias, weight):
  """Gradients of ``-weight * sum_i s_ii`` w.r.t. (x, y, scale, bias)."""
  del bias
  n = min(x.shape[0], y.shape[0])
  xs, ys = x[:n].astype(F32), y[:n].astype(F32)
  dx = jnp.zeros(x.shape, F32).at[:n].set(-weight * scale * ys)
  dy = jnp.zeros(y.shape, F32).at[:n].set(-weight * scale * xs)
  dscale = -weight * jnp.sum(xs * ys)
  dbias = -weight * n
  return dx, dy, dscale, dbias


def _rows_cols(direction):
  return direction in ("both", "image_to_text"), direction in ("both", "text_to_image")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def tiled_contrastive_loss(x, y, scale, bias, backend, direction, block_sizes):
  loss, _ = _fwd(x, y, scale, bias, backend, direction, block_sizes)
  return loss


def _fwd(x, y, scale, bias, backend, direction, block_sizes):
  kernel = tile_backend.get_backend(backend)
  rows, cols = _rows_cols(direction)
  s32, b32 = scale.astype(F32), bias.astype(F32)
  row_lse, col_lse = kernel.lse(x, y, s32, b32, rows=rows, cols=cols,
                                block_sizes=block_sizes)
  row_w, col_w, pos_w = direction_weights(direction, x.shape[0], y.shape[0])
  pos, _, _ = positive_logits(x, y, s32, b32)
  loss = -pos_w * jnp.sum(pos)
  if rows:
    loss = loss + row_w * jnp.sum(row_lse)
  if cols:
    loss = loss + col_w * jnp.sum(col_lse)
  return loss, (x, y, scale, bias, row_lse, col_lse)


def _bwd(backend, direction, block_sizes, res, g):
  x, y, scale, bias, row_lse, col_lse = res
  kernel = tile_backend.get_backend(backend)
  row_w, col_w, pos_w = direction_weights(direction, x.shape[0], y.shape[0])
  s32, b32 = scale.astype(F32), bias.astype(F32)
  g = g.astype(F32)
  dx, dy, dsc, dbi = kernel.lse_grad(x, y, s32, b32, row_lse, col_lse,
                                     g * row_w, g * col_w,
                                     block_sizes=block_sizes)
  px, py, psc, pbi = positive_grads(x, y, s32, b32, g * pos_w)
  return ((dx + px).astype(x.dtype), (dy + py).astype(y.dtype),
          (dsc + psc).astype(scale.dtype), (dbi + pbi).astype(bias.dtype))


tiled_contrastive_loss.defvjp(_fwd, _bwd)
