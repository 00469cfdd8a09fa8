"""Group-aware positives: the O(B) side of ``groups=``.

Global query i and global key j are *related* when ``gq[i] == gk[j]`` (the
other captions of an image, duplicate images). Group ids are O(B) integers,
so every device holds all of them (one ``all_gather``); only the
embeddings stay sharded.

Two modes (``MODES``):

* ``"mask"`` (false-negative masking): the related pairs other than a
  query's positive leave its LSE. The tiles leave *all* related pairs out
  (``backends.base``), and the positive too: with one id array and no
  labels every positive (i, i) is related; otherwise (``labels=``, or a
  pair of id arrays, where a positive may lie outside its query's group)
  the tiles are also given each positive's index (``positives=``). The
  negatives' LSE then gives the confident form (``terms.confident``) and
  the full LSE is ``logaddexp(lse_unrelated, s_pos)``. With all ids
  distinct and no labels this is the plain loss up to float rounding.
* ``"positives"`` (multi-positive InfoNCE, SupCon's L_out): every related
  pair is a positive, a query's term is ``lse - mean over its positives of
  s``. A query with k >= 2 related keys keeps the plain LSE (its term is
  at least log k, so LSE - mean does not cancel), and the positive term
  ``sum over related (i, j) of (w_q[i] + w_k[j]) s_ij``, with ``w_q = row
  weight / (number of keys related to i)`` and likewise for the keys, is
  O(B * D): per key shard, sums of the related keys grouped by id
  (``related_sum``), no B x B anything. A query with one related key (most
  of them: an image without duplicates) is the confident form of "mask"
  mode instead (``Positives``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import _math
from infcl_jax.block_sizes import BlockSizes

F32 = jnp.float32
MODES = ("mask", "positives")


def gather_ids(g, axes):
  """All devices' group ids (or any per-row values) in axis order (this
  device's when axes == ())."""
  if not axes:
    return g
  return lax.all_gather(g, axes, axis=0, tiled=True)


def shard(g_all, src, b):
  """The ids of the shard of device ``src`` (b rows each)."""
  return lax.dynamic_slice_in_dim(g_all, src * b, b)


def related_sum(g_dst, g_src, vals):
  """For each i: the sum of ``vals[j]`` over the j with g_src[j] == g_dst[i].

  O((n + m) log m) by sorting ``g_src``: equal ids become one segment, and
  each destination finds its segment by binary search. Differentiable in
  ``vals`` (a segment sum and a gather).
  """
  m = g_src.shape[0]
  order = jnp.argsort(g_src)
  srt = g_src[order]
  starts = jnp.concatenate([jnp.zeros((1,), bool), srt[1:] != srt[:-1]])
  seg = jnp.cumsum(starts.astype(jnp.int32))
  sums = jax.ops.segment_sum(vals[order], seg, num_segments=m)
  at = jnp.clip(jnp.searchsorted(srt, g_dst), 0, m - 1)
  found = srt[at] == g_dst
  picked = sums[seg[at]]
  found = found.reshape(found.shape + (1,) * (picked.ndim - 1))
  return jnp.where(found, picked, 0)


def count(g_dst, g_src):
  """float32 number of j with g_src[j] == g_dst[i], for each i."""
  return related_sum(g_dst, g_src, jnp.ones(g_src.shape, F32))


def put_back(lse, s_pos, rel_pos):
  """The LSE with the positive put back where the tiles left it out."""
  return jnp.logaddexp(lse, jnp.where(rel_pos, s_pos, -jnp.inf))


def put_back_share(s_pos, lse, rel_pos):
  """d put_back / d s_pos: the positive's softmax probability, 0 where the
  tiles kept it (its gradient came from the tiles)."""
  return jnp.where(rel_pos, jnp.exp(s_pos - lse), 0.0)


def weights(g_q, g_k_all, g_q_all, g_k_all_keys, row_w, col_w):
  """(w_q (b_q,), w_k (all keys,), nan): each local query's and every
  global key's weight per positive, and 0.0 or NaN.

  NaN when a query (or, with columns, a key) has no related partner: its
  mean over no positives is undefined, and dropping it silently would
  change the loss.
  """
  n_q = count(g_q, g_k_all)
  w_q = row_w / jnp.maximum(n_q, 1.0)
  bad = jnp.any(n_q == 0)
  if col_w:
    n_k = count(g_k_all_keys, g_q_all)
    w_k = col_w / jnp.maximum(n_k, 1.0)
    bad = bad | jnp.any(n_k == 0)
  else:
    w_k = jnp.zeros(g_k_all_keys.shape, F32)
  return w_q, w_k, jnp.where(bad, jnp.nan, 0.0).astype(F32)


def _segments(g_q, g_k):
  """Dense segment ids of one key shard's groups: (seg_q, seg_k), where
  seg_k[j] is the rank of g_k[j] among the shard's distinct ids and seg_q[i]
  the rank of g_q[i] there, or b_k (out of range: ``segment_sum`` drops it)
  when no key of the shard shares the query's id. O(b log b) on ints."""
  m = g_k.shape[0]
  order = jnp.argsort(g_k)
  srt = g_k[order]
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            (srt[1:] != srt[:-1]).astype(jnp.int32)])
  rank = jnp.cumsum(starts)
  seg_k = jnp.zeros((m,), jnp.int32).at[order].set(rank)
  at = jnp.clip(jnp.searchsorted(srt, g_q), 0, m - 1)
  seg_q = jnp.where(srt[at] == g_q, rank[at], m)
  return seg_q, seg_k


def positives_term(q, k, scale, bias, g_q, g_k, w_q, w_k):
  """sum over related (i, j) of (w_q[i] + w_k[j]) * s_ij, float32, for the
  local queries against one key shard (``g_k``, ``w_k`` its ids and
  weights).

  Per group G the pairs give (sum_G w_q q) . (sum_G k) + (sum_G q) .
  (sum_G w_k k), so both sides are summed by group id straight from the
  embeddings (scatter-adds, nothing sorted or gathered at B x D): the
  term's cost stays a few passes over q and k.
  """
  m = k.shape[0]
  seg_q, seg_k = _segments(g_q, g_k)
  q32, k32 = q.astype(F32), k.astype(F32)
  sum_k = lambda v: jax.ops.segment_sum(v, seg_k, num_segments=m)
  sum_q = lambda v: jax.ops.segment_sum(v, seg_q, num_segments=m)
  dots = (jnp.sum(sum_q(q32 * w_q[:, None]) * sum_k(k32))
          + jnp.sum(sum_q(q32) * sum_k(k32 * w_k[:, None])))
  n_q, wq_g = sum_q(jnp.ones_like(w_q)), sum_q(w_q)
  n_k, wk_g = sum_k(jnp.ones_like(w_k)), sum_k(w_k)
  return scale * dots + bias * jnp.sum(wq_g * n_k + n_q * wk_g)


def positives_term_grads(q, k, scale, bias, g_q, g_k, w_q, w_k, coef):
  """Gradients of ``coef * positives_term`` w.r.t. (q, k, scale, bias),
  float32 (the term's own autodiff: it is O(b * D))."""
  f = lambda q_, k_, s_, b_: positives_term(q_, k_, s_, b_, g_q, g_k, w_q,
                                            w_k)
  _, vjp = jax.vjp(f, q.astype(F32), k.astype(F32), scale, bias)
  ct = _axes.vary_like(jnp.asarray(coef, F32), q, k, scale, bias)
  return vjp(ct)


def exact_positive_ids(b_q, n_k, labels, axes):
  """Group ids under which each query's positive is its only related key.

  Without ``groups=`` the loss runs as "mask" with these: the tiles leave
  the positive out (the negatives' LSE) and the loss takes it with its
  float32 logit (``terms.confident``), so a confident model's loss and
  gradient keep their relative accuracy. Ids are global key indices: query
  i gets its positive's index, key j gets j. Returns (g_q (b_q,), the ids of
  all ``n_k`` global keys): the keys' are an iota, known on every device
  without a collective.
  """
  me = lax.axis_index(axes) if axes else 0
  g_q = (me * b_q + jnp.arange(b_q, dtype=jnp.int32) if labels is None
         else labels.astype(jnp.int32))
  return g_q, jnp.arange(n_k, dtype=jnp.int32)


# ------------------------------------- "positives": one related key, exact
#
# With N_i the LSE over the keys unrelated to query i (what "mask" tiles
# give) and R_i the LSE over its k_i related keys, the multi-positive term
# is
#   LSE_i - mean_related s = softplus(N_i - R_i) + (R_i - mean_related s),
# the second part exactly 0 for k_i = 1 (R_i is the one related logit) and
# at least log k_i otherwise. For k_i = 1 that is the confident form of the
# softmax (``terms.confident``): softplus(N - s_pos), gradient -sigmoid(N -
# s_pos) at the positive. Those pairs are enumerable in O(B): the pairs of
# an id held by exactly one key (the key of each of its queries). The tiles
# leave them out (as "mask" does), and the loss takes them outside in
# float32; every other related pair stays in the tiles, under the plain
# LSE - mean. A key whose related queries all have it as their only key
# (the column of such an id) gets the same split, with R' the LSE of
# those queries' logits: softplus(N' - R') + (R' - mean), exact for any
# number of them. What stays plain: ids with >= 2 keys (queries with
# k >= 2: a term >= log 2) and, with columns, their keys (>= log 2 as
# well when the id also has >= 2 queries, always so for one (B,) id array;
# an id with one query and several keys, possible with an (images, texts)
# pair of id arrays, leaves that query's columns plain although each has one
# related query: each such column's one pair is also one of its query's
# k >= 2 related pairs, whose row term >= log k and entry p - 1/k bound
# what the column's LSE' - s and p' - 1 lose; taking them outside would
# need each pair's logit from the key's side, a gather of query rows per
# ring step). A plain query's related entries of G, p - 1/k, are as
# precise as the tiles' G panel relative to 1/k (the limits of the
# confident form: https://github.com/infcl-jax/infcl-jax/blob/main/docs/losses.md#a-confident-model): taking them outside too would need its k related
# logits, k gathers of the key rows per key shard rather than one.


def positives_block_sizes(block_sizes):
  """The block sizes of a "positives" backward: float32 gradient panels on
  TF32 tiles (``BlockSizes.f32_panels``). The panels' float16 shares one
  scale with G's largest entry, which a query with several related keys
  puts near 1 (its p - 1/k), beside a confident one-key row's tiny
  entries: these would keep ~3 digits, not float32's."""
  if block_sizes is None:
    return BlockSizes(f32_panels=True)
  return dataclasses.replace(block_sizes, f32_panels=True)


class Positives:
  """The split of "positives" mode on one device (see above).

  Args:
    g_q: (b_q,) ids of the local queries; ``me``: this device's index.
    g_k_all, g_q_all: the ids of all keys and of all queries.
    row_w, col_w: the loss weights of rows and columns (col_w 0: no
      columns).

  Attributes:
    one: (b_q,) bool, local queries with exactly one related key.
    labels: (b_q,) int32, that key's global index, -1 for the others (no
      positive pair: ``terms.shard_positives`` never finds it).
    q_ids, k_ids: the tiles' ids (queries (b_q,), all keys): pair (i, j) is
      left out iff j is query i's one related key (labels and key indices,
      -1 and -2 where nothing is left out).
    masked_k: all keys, bool: those whose related pairs the tiles leave out
      (the only key of their id).
    w_q, w_k: ``positives_term``'s weights, 0 for what is taken outside.
    labels_all, n_q: with columns, ``labels`` of all queries and each key's
      number of related queries (float32).
    nan: 0.0, or NaN when a query (with columns, a key) has no related
      partner (``weights``).
  """

  def __init__(self, g_q, g_k_all, g_q_all, row_w, col_w, me):
    n_k = g_k_all.shape[0]
    b_q = g_q.shape[0]
    keys = jnp.arange(n_k, dtype=jnp.int32)

    def labels_of(g):
      one = count(g, g_k_all) == 1
      return one, jnp.where(one, related_sum(g, g_k_all, keys), -1)

    self.w_q, w_k, self.nan = weights(g_q, g_k_all, g_q_all, g_k_all, row_w,
                                      col_w)
    if col_w:
      _, self.labels_all = labels_of(g_q_all)
      self.labels = lax.dynamic_slice_in_dim(self.labels_all, me * b_q, b_q)
      self.one = self.labels >= 0
      self.n_q = count(g_k_all, g_q_all)
    else:
      self.one, self.labels = labels_of(g_q)
      self.labels_all = self.n_q = None
    self.masked_k = count(g_k_all, g_k_all) == 1
    self.q_ids = self.labels
    self.k_ids = jnp.where(self.masked_k, keys, -2)
    self.w_q = jnp.where(self.one, 0.0, self.w_q)
    self.w_k = jnp.where(self.masked_k, 0.0, w_k)


def column_positives(s_all, labels_all, n_keys):
  """(R', mean'), each (n_keys,) float32: per key, the LSE and the mean of
  the positive logits ``s_all`` of the queries whose one related key it is
  (``Positives.labels_all``; -inf and 0 for a key without such queries).
  R' is exactly s and R' - mean' exactly 0 for a key with one of them."""
  seg = jnp.where(labels_all >= 0, labels_all, n_keys)  # n_keys: dropped
  at = jnp.minimum(seg, n_keys - 1)
  shift = _math.safe_max(jax.ops.segment_max(s_all, seg,
                                             num_segments=n_keys))
  tot = jax.ops.segment_sum(jnp.exp(s_all - shift[at]), seg,
                            num_segments=n_keys)
  cnt = jax.ops.segment_sum(jnp.ones_like(s_all), seg, num_segments=n_keys)
  mean = jax.ops.segment_sum(s_all, seg, num_segments=n_keys) / jnp.maximum(
      cnt, 1.0)
  return shift + jnp.log(tot), mean


def column_pair_weight(s_pos, labels, col_r, u_c_all, n_q):
  """Per local query with one related key j: minus the column part of
  d loss / d s_ij (per unit column weight), float32:

      (1 / k'_j - q') + q' sigmoid(u'_j),   q' = exp(s_ij - R'_j),

  k'_j = ``n_q[j]``, u' = N' - R' (``terms.confident_group``). With k' = 1,
  q' = 1 exactly and it is sigmoid(u'), the confident form's. 0 for the
  other queries."""
  j = jnp.maximum(labels, 0)
  q = jnp.exp(s_pos - col_r[j])
  w = (1.0 / jnp.maximum(n_q[j], 1.0) - q) + q * jnp.exp(
      -_math.softplus(-u_c_all[j]))
  return jnp.where(labels >= 0, w, 0.0)
