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
combine; "positives" leaves out the pairs of the queries with one related
key, as "mask" (``groups.Positives``; the keys of those pairs take their
queries' logits from an O(B) all_gather), and adds the grouped sums of the
gathered keys for the other related pairs.

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def gather_loss(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                block_sizes, axes, outside=False):
  """Global CLIP loss by all-gather; arguments as ``softmax.softmax_loss``."""
  loss, _ = _fwd(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                 block_sizes, axes, outside)
  return loss


def _positives(keys, labels, me, b_q):
  """(idx, valid) of the local queries' positives among the gathered keys."""
  if labels is None:
    labels = terms.default_labels(me, b_q)
  return terms.shard_positives(labels, 0, keys.shape[0])


def _groups(groups, group_mode, axes, labels, me, b_q, b_k, n_dev, mode,
            outside):
  """(tile keywords, rel_pos, positives-term args, nan, split) of
  ``groups`` (``split``: "positives" mode's ``groups.Positives``, else
  None; ``outside``: as in ``softmax.softmax_loss``)."""
  if groups is None:
    # The positive alone is left out of the tiles, as a related pair.
    g_q, g_k_all = groups_lib.exact_positive_ids(b_q, n_dev * b_k, labels,
                                                 axes)
    return {"groups": (g_q, g_k_all)}, jnp.ones((b_q,), bool), None, 0.0, None
  g_q, g_k = groups
  g_k_all = groups_lib.gather_ids(g_k, axes)
  if group_mode == "mask" and outside:
    # Every positive left out by its index beside the related pairs.
    idx, valid = _positives(g_k_all, labels, me, b_q)
    return ({"groups": (g_q, g_k_all), "positives": jnp.where(valid, idx, -1)},
            jnp.ones((b_q,), bool), None, 0.0, None)
  if group_mode == "mask":
    pos = (terms.default_labels(me, b_q) if labels is None
           else jnp.clip(labels, 0, g_k_all.shape[0] - 1))
    return {"groups": (g_q, g_k_all)}, g_q == g_k_all[pos], None, 0.0, None
  row_w, col_w, _ = terms.weights(mode, n_dev * b_q, n_dev * b_k)
  split = groups_lib.Positives(
      g_q, g_k_all, groups_lib.gather_ids(g_q, axes), row_w,
      col_w if mode == "both" else 0.0, me)
  return ({"groups": (split.q_ids, split.k_ids)}, None,
          (g_q, g_k_all, split.w_q, split.w_k), split.nan, split)


def _fwd(q, k, scale, bias, labels, groups, backend, mode, group_mode,
         block_sizes, axes, outside=False):
  tiles = registry.get(backend, FAMILY)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q = q.shape[0]
  cols = mode == "both"
  row_w, col_w, _ = terms.weights(mode, n_dev * b_q, n_dev * k.shape[0])
  tile_kw, rel_pos, multi, nan, split = _groups(
      groups, group_mode, axes, labels, me, b_q, k.shape[0], n_dev, mode,
      outside)
  keys = lax.all_gather(k, axes, axis=0, tiled=True)
  row, col_part = tiles.lse(q, keys, scale, bias, rows=True, cols=cols,
                             block_sizes=block_sizes, **tile_kw)
  s_pos = margins = None
  if multi is not None:
    # The queries with one related key as in "mask", the others' plain LSE
    # less the grouped positive terms.
    s_pos, _ = terms.positive_logits(
        q, keys, scale, bias, *terms.shard_positives(split.labels, 0,
                                                     keys.shape[0]))
    row, u_r, row_loss = terms.confident(row, s_pos, split.one)
    local = row_w * jnp.sum(row_loss) - groups_lib.positives_term(
        q, keys, scale, bias, *multi)
    margins = (u_r, None, None)
  else:
    # The positive outside the log-sum-exp (``terms.confident``).
    s_pos, _ = terms.positive_logits(q, keys, scale, bias,
                                     *_positives(keys, labels, me, b_q))
    row, u_r, row_loss = terms.confident(row, s_pos, rel_pos)
    local = row_w * jnp.sum(row_loss)
    margins = (u_r, None)
  col = None
  if cols:
    if rel_pos is not None:
      # Key me * b_q + i's positive is local query i: the partial column
      # statistics combine as a pair, [positive put back, negatives only].
      at = me * b_q
      mine = lax.dynamic_slice_in_dim(col_part, at, b_q)
      full = lax.dynamic_update_slice_in_dim(
          col_part, groups_lib.put_back(mine, s_pos, rel_pos), at, 0)
      col, col_neg = _global_lse(jnp.stack([full, col_part]), axes)
      _, u_c, col_loss = terms.confident(
          lax.dynamic_slice_in_dim(col_neg, at, b_q), s_pos, rel_pos,
          full=lax.dynamic_slice_in_dim(col, at, b_q))
      local = local + col_w * jnp.sum(col_loss)
      margins = (u_r, u_c)
    else:
      # "positives". Every key's statistics are here: the left-out keys'
      # terms from all queries' logits (``groups.column_positives``); each
      # device adds the terms of its own keys.
      col_r, col_mean = groups_lib.column_positives(
          groups_lib.gather_ids(s_pos, axes), split.labels_all,
          keys.shape[0])
      col, u_c, col_loss = terms.confident_group(
          _global_lse(col_part, axes), col_r, col_mean, split.masked_k)
      local = local + col_w * jnp.sum(
          lax.dynamic_slice_in_dim(col_loss, me * k.shape[0], k.shape[0]))
      margins = (u_r, u_c, groups_lib.column_pair_weight(
          s_pos, split.labels, col_r, u_c, split.n_q))
  local = local + terms.nan_if_out_of_range(labels, keys.shape[0]) + nan
  loss = lax.psum(local, axes)
  return loss, (q, k, scale, bias, labels, groups, row, col, s_pos, margins)


def _bwd(backend, mode, group_mode, block_sizes, axes, outside, res, g):
  q, k, scale, bias, labels, groups, row, col, s_pos, margins = res
  tiles = registry.get(backend, FAMILY)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q = q.shape[0]
  row_w, col_w, _ = terms.weights(mode, n_dev * b_q, n_dev * k.shape[0])
  tile_kw, rel_pos, multi, nan, split = _groups(
      groups, group_mode, axes, labels, me, b_q, k.shape[0], n_dev, mode,
      outside)
  g = g.astype(F32)
  row_coef, col_coef = g * row_w, g * col_w
  if rel_pos is not None:
    # As ``losses.softmax``: 1 - p in float32, the tiles' G scaled to <= 1.
    sig_r, sig_c, log_factor, factor = terms.confident_scale(
        *margins, rel_pos, lambda v: lax.pmax(v, axes))
    w_pos = g * row_w * sig_r + (0.0 if sig_c is None else g * col_w * sig_c)
    row = row + log_factor
    col = None if col is None else col + log_factor
    row_coef, col_coef = row_coef * factor, col_coef * factor
  elif split is not None:
    # "positives": the pairs left out as in "mask", each with its column
    # part (``groups.Positives``).
    u_r, u_c, col_pos = margins
    sig_r, _, log_factor, factor = terms.confident_scale(
        u_r, u_c, split.one, lambda v: lax.pmax(v, axes),
        rel_c=split.masked_k)
    w_pos = g * row_w * sig_r + (0.0 if col_pos is None
                                 else g * col_w * col_pos)
    row = row + log_factor
    col = None if col is None else col + log_factor
    row_coef, col_coef = row_coef * factor, col_coef * factor
    block_sizes = groups_lib.positives_block_sizes(block_sizes)
  keys = lax.all_gather(k, axes, axis=0, tiled=True)
  dq, dkeys, dsc, dbi = tiles.lse_grad(q, keys, scale, bias, row, col,
                                        row_coef, col_coef,
                                        block_sizes=block_sizes,
                                        **tile_kw)
  if multi is not None:
    pq, pk, psc, pbi = groups_lib.positives_term_grads(q, keys, scale, bias,
                                                       *multi, -g)
    dq, dkeys, dsc, dbi = dq + pq, dkeys + pk, dsc + psc, dbi + pbi
    idx, valid = terms.shard_positives(split.labels, 0, keys.shape[0])
    _, k_rows = terms.positive_sum(q, keys, scale, bias, idx, valid)
    pq, pk, psc, pbi = terms.positive_grads(q, keys, scale, w_pos, k_rows,
                                            idx, valid)
  else:
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
