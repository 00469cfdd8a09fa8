"""The exact CLIP loss across devices by gathering the keys (DisCo-CLIP style).

Runs inside ``jax.shard_map``, with the same shards, global batch,
positives and gradient convention as the ring (``losses.softmax``).

Forward: one ``all_gather`` of the key shards (B_k x D per device), then the
local b_q x B_k rows through the tile backend in one sweep. That sweep gives
the local rows' LSE completely and, for every key, the LSE over the local
queries only; the column LSE over all queries is their log-sum-exp across
devices (``pmax`` + ``psum`` of B_k floats, next to nothing beside B_k x D).
With "mask" groups each device puts its own queries' positives back into
that partial column LSE (the columns' positives are (i, i)) before the
combine; "positives" adds the grouped sums of the gathered keys.

Backward: the keys are gathered again (rather than kept as a B_k x D
residual between forward and backward), one ``lse_grad`` gives dq and the
gradient of every gathered key, and a ``psum_scatter`` (reduce-scatter) sums
the devices' key gradients and returns each shard's sum home.

DisCo-CLIP proper gathers both towers and computes the local rows of each
direction separately, i.e. twice the matmul work; here the column direction
rides on the same sweep, so flops equal the ring's. Costs per device:
memory O(B_k * D) (the gathered keys and their float32 gradient) against the
ring's O(b * D); traffic about 2 * B_k * D elements in two large collectives
(plus one O(B_k) all-reduce) against the ring's 2N ppermutes of b_k * D. The
gather wins when the B_k x D buffers fit comfortably and N is small or the
per-step latency of the ring dominates (small local batch, slow
interconnect); the ring wins on memory and at large N.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import _math
from infcl_jax.backends import registry
from infcl_jax.losses import groups as groups_lib
from infcl_jax.losses import terms

F32 = jnp.float32
FAMILY = "softmax"


def _global_lse(partial_lse, axes):
  """log sum_devices exp(partial_lse), elementwise, stable."""
  shift = _math.safe_max(lax.pmax(partial_lse, axes))
  return shift + jnp.log(lax.psum(jnp.exp(partial_lse - shift), axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def gather_loss(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                block_sizes, axes):
  """Global CLIP loss by all-gather; arguments as ``softmax.softmax_loss``."""
  loss, _ = _fwd(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                 block_sizes, axes)
  return loss


def _positives(keys, labels, me, b_q):
  """(idx, valid) of the local queries' positives among the gathered keys."""
  if labels is None:
    labels = terms.default_labels(me, b_q)
  return terms.shard_positives(labels, 0, keys.shape[0])


def _groups(groups, group_mode, axes, labels, me, b_q, b_k, n_dev, mode):
  """(tile groups, rel_pos, positives-term args, nan) of ``groups``."""
  if groups is None:
    return None, None, None, 0.0
  g_q, g_k = groups
  g_k_all = groups_lib.gather_ids(g_k, axes)
  if group_mode == "mask":
    pos = (terms.default_labels(me, b_q) if labels is None
           else jnp.clip(labels, 0, g_k_all.shape[0] - 1))
    return (g_q, g_k_all), g_q == g_k_all[pos], None, 0.0
  row_w, col_w, _ = terms.weights(mode, n_dev * b_q, n_dev * b_k)
  w_q, w_k, nan = groups_lib.weights(
      g_q, g_k_all, groups_lib.gather_ids(g_q, axes), g_k_all, row_w,
      col_w if mode == "both" else 0.0)
  return None, None, (g_q, g_k_all, w_q, w_k), nan


def _fwd(q, k, scale, bias, labels, groups, backend, mode, group_mode,
         block_sizes, axes):
  tiles = registry.get(backend, FAMILY)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q = q.shape[0]
  cols = mode == "both"
  row_w, col_w, pos_w = terms.weights(mode, n_dev * b_q, n_dev * k.shape[0])
  tile_groups, rel_pos, multi, nan = _groups(
      groups, group_mode, axes, labels, me, b_q, k.shape[0], n_dev, mode)
  keys = lax.all_gather(k, axes, axis=0, tiled=True)
  row, col_part = tiles.lse(q, keys, scale, bias, rows=True, cols=cols,
                             block_sizes=block_sizes, groups=tile_groups)
  s_pos = None
  if multi is not None:
    pos = groups_lib.positives_term(q, keys, scale, bias, *multi)
    pos_w = 1.0
  elif rel_pos is not None:
    s_pos, _ = terms.positive_logits(q, keys, scale, bias,
                                     *_positives(keys, labels, me, b_q))
    row = groups_lib.put_back(row, s_pos, rel_pos)
    if cols:  # Key me * b_q + i's positive is local query i.
      at = me * b_q
      mine = lax.dynamic_slice_in_dim(col_part, at, b_q)
      col_part = lax.dynamic_update_slice_in_dim(
          col_part, groups_lib.put_back(mine, s_pos, rel_pos), at, 0)
    pos = jnp.sum(s_pos)
  else:
    pos, _ = terms.positive_sum(q, keys, scale, bias,
                                *_positives(keys, labels, me, b_q))
  local = row_w * jnp.sum(row) - pos_w * pos
  local = local + terms.nan_if_out_of_range(labels, keys.shape[0]) + nan
  loss = lax.psum(local, axes)
  col = None
  if cols:
    col = _global_lse(col_part, axes)  # Identical on every device.
    loss = loss + col_w * jnp.sum(col)
  return loss, (q, k, scale, bias, labels, groups, row, col, s_pos)


def _bwd(backend, mode, group_mode, block_sizes, axes, res, g):
  q, k, scale, bias, labels, groups, row, col, s_pos = res
  tiles = registry.get(backend, FAMILY)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q = q.shape[0]
  row_w, col_w, pos_w = terms.weights(mode, n_dev * b_q, n_dev * k.shape[0])
  tile_groups, rel_pos, multi, nan = _groups(
      groups, group_mode, axes, labels, me, b_q, k.shape[0], n_dev, mode)
  g = g.astype(F32)
  w_pos = g * pos_w
  keys = lax.all_gather(k, axes, axis=0, tiled=True)
  dq, dkeys, dsc, dbi = tiles.lse_grad(q, keys, scale, bias, row, col,
                                        g * row_w, g * col_w,
                                        block_sizes=block_sizes,
                                        groups=tile_groups)
  if multi is not None:
    pq, pk, psc, pbi = groups_lib.positives_term_grads(q, keys, scale, bias,
                                                       *multi, -g)
  else:
    if rel_pos is not None:
      # d/ds_pos of the put-back LSEs (see ``losses.softmax``).
      w_pos = w_pos - g * row_w * groups_lib.put_back_share(s_pos, row,
                                                            rel_pos)
      if col is not None:
        w_pos = w_pos - g * col_w * groups_lib.put_back_share(
            s_pos, lax.dynamic_slice_in_dim(col, me * b_q, b_q), rel_pos)
    idx, valid = _positives(keys, labels, me, b_q)
    _, k_rows = terms.positive_sum(q, keys, scale, bias, idx, valid)
    pq, pk, psc, pbi = terms.positive_grads(q, keys, scale, w_pos, k_rows,
                                            idx, valid)
  dq, dkeys, dsc, dbi = dq + pq, dkeys + pk, dsc + psc, dbi + pbi
  dk = lax.psum_scatter(dkeys, axes, scatter_dimension=0, tiled=True)
  dq = dq + terms.nan_if_out_of_range(labels, keys.shape[0]) + nan
  return (dq.astype(q.dtype), dk.astype(k.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype), None, None)


gather_loss.defvjp(_fwd, _bwd)
