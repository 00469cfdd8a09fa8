"""The exact CLIP / InfoNCE loss over a ring of N >= 1 devices.

One ``jax.custom_vjp`` for every case: a single device is the ring with
N = 1 (``axes == ()``). Inside ``jax.shard_map``, device k of N holds a
query shard q^(k) (b_q rows) and a key shard k^(k) (b_k rows); the global
batch is the shards concatenated in axis order.

Forward (N steps of ``schedule.Ring``). Step n runs the tile of the local
queries against the key shard of device (k - n) mod N through the tile
backend. The row LSE of the local queries merges across steps (logaddexp)
and stays local; the column LSE belongs to the travelling key shard, travels
with it and arrives home complete. Only these O(b) statistics are saved.

Backward (N steps, recomputing every tile, walking the ring the other way:
``Ring.source_back``). ``lse_grad`` is given the *global* row / column LSE, so
each tile's output is exactly that tile's share of the global gradient. The
forward ended holding device k + 1's key shard with its complete column
LSE (kept as residuals, O(b * D)), so the backward starts there without a
transfer and computes the home tile last. dq accumulates locally; the dk
accumulator of a key shard travels with it (sent at the start of the next
step, before that step's tile) and its last hop is issued before the home
tile: N - 1 hops of the float32 accumulator (not N); the key shard takes
N - 1 hops for N > 2, none for N = 2. Whether a send overlaps the tile
after it is up to XLA's scheduler: the last one overlaps the home tile only
with two asynchronous collectives allowed in flight (``infcl_jax.xla_flags``;
with XLA's default of one it waits behind the loss's all-reduce:
https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#ring).

Memory per device is O((b_q + b_k) * D) plus the backend's workspace, for
any N.

Groups (``losses.groups``): every device holds all group ids (O(B)
integers); each tile takes the ids of its rows and of the key shard it
holds. "mask" tiles leave related pairs out, and the positives, which the
ids relate when they are one array without labels and which the tiles
are otherwise given by index (``positives=``, ``outside``: a positive may
then lie outside its query's group); each term is then the confident form,
and the positive is put back into the full LSE: the rows' at the end, the
columns' in the home tile, so that the column statistics that travel are
complete. "positives" (``groups_lib.Positives``)
leaves out the pairs of each query that has one related key, which then
works like "mask" with that key as its positive (the keys of those pairs
get their column terms at the end, when all their queries' logits are
known: an O(B) all_gather); the other related pairs stay in the tiles under
the plain LSE, less the grouped sums of each key shard held.

Positives. Global query i pairs with global key ``labels[i]``, by default
global key i. By default and when b_q == b_k (or on one device) they all
sit in the home tile; otherwise (a one-way loss with extra keys, or
arbitrary labels) each step picks the pairs whose key is in the shard it
holds (an O(b_q * D) gather), so a positive may live on any device.

Gradient convention. The forward returns the global loss L on every device
(a ``psum``). The backward gives each device the exact partial derivative of
L with respect to its own shards and its share of dL/dscale and dL/dbias
(its tiles), so that the sum over devices is the full derivative. The
callers cast the replicated scalars to device-varying before this
``custom_vjp``; under ``shard_map``'s default ``check_vma=True`` JAX
transposes that cast into the ``psum`` that adds the shares up.

Overlap on GPU. XLA turns each ``ppermute`` into an asynchronous
collective-permute-start / -done pair, and its latency hiding scheduler
places the tile's kernels between them
(``--xla_gpu_enable_latency_hiding_scheduler=true``, the default in recent
jaxlib builds). What runs between them on 2 H200s:
https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#ring.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from infcl_jax.backends import registry
from infcl_jax.losses import groups as groups_lib
from infcl_jax.losses import terms
from infcl_jax.losses.schedule import Ring

F32 = jnp.float32
FAMILY = "softmax"


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def softmax_loss(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                 block_sizes, axes, outside=False):
  """Global CLIP loss of the local shards; see the module docstring.

  Args:
    q: (b_q, D) local queries (images, or texts for ``text_to_image``).
    k: (b_k, D) local keys; b_k == b_q for mode "both", b_k >= b_q for
      mode "rows".
    scale, bias: float32 scalars (device-varying over ``axes``).
    labels: None, or (b_q,) int32: the global key index of each local
      query's positive (mode "rows" only). Out of range gives a NaN loss.
    groups: None, or ((b_q,), (b_k,)) int32 group ids of the local queries
      and keys (``losses.groups``).
    backend: a registered tile backend name (not "auto").
    mode: "both" (row and column cross-entropies) or "rows" (queries only).
    group_mode: "mask" or "positives" (used with ``groups`` only).
    block_sizes: ``BlockSizes`` or None, passed to every tile.
    axes: tuple of mesh axis names the batch is sharded over; () for one
      device.
    outside: "mask" groups only: whether a query's positive may lie outside
      its group (``labels``, or a pair of id arrays; static). The tiles
      then leave each positive out by its index (the seam's
      ``positives=``) beside the related pairs; otherwise (one id array,
      positives on the diagonal) every positive is related, and the
      groups alone leave it out.
  """
  loss, _ = _fwd(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                 block_sizes, axes, outside)
  return loss


def _positive_labels(ring, labels, b_q, b_k):
  """None when every positive pair is (r, r) of the home tile; otherwise
  the local queries' global key indices."""
  if labels is None and (b_q == b_k or ring.size == 1):
    return None
  return terms.default_labels(ring.me, b_q) if labels is None else labels


class _Groups:
  """What the tiles and the positive terms of one device need from
  ``groups`` (``losses.groups``): the ids of each tile, the positives'
  relatedness ("mask") or the split of ``groups_lib.Positives``
  ("positives")."""

  def __init__(self, groups, group_mode, ring, labels, b_q, b_k, mode,
               outside=False):
    self.multi = groups is not None and group_mode == "positives"
    self.masked = not self.multi
    self.b_k = b_k
    self.outside = groups is not None and self.masked and outside
    # Without groups the positive alone is left out of the tiles. When every
    # positive is (r, r) of the home tile, that tile leaves out its diagonal
    # (the backend masks only the tiles that cross it) and the others need
    # no mask; otherwise as a related pair (``groups_lib.exact_positive_ids``).
    self.diagonal = groups is None and _positive_labels(
        ring, labels, b_q, b_k) is None
    if groups is None:
      self.g_q, self.g_k_all = groups_lib.exact_positive_ids(
          b_q, ring.size * b_k, labels, ring.axes)
      self.rel_pos = jnp.ones((b_q,), bool)
      return
    self.g_q, g_k = groups
    self.g_k_all = groups_lib.gather_ids(g_k, ring.axes)
    if self.outside:
      # Every positive is left out of the tiles by its index, related or
      # not (``tile``), so every row takes the confident form.
      self.pos_labels = _positive_labels(ring, labels, b_q, b_k)
      self.rel_pos = jnp.ones((b_q,), bool)
    elif self.masked:
      pos = (terms.default_labels(ring.me, b_q) if labels is None
             else jnp.clip(labels, 0, self.g_k_all.shape[0] - 1))
      self.rel_pos = self.g_q == self.g_k_all[pos]
    else:
      row_w, col_w, _ = terms.weights(mode, ring.size * b_q, ring.size * b_k)
      g_q_all = groups_lib.gather_ids(self.g_q, ring.axes)
      self.split = groups_lib.Positives(
          self.g_q, self.g_k_all, g_q_all, row_w,
          col_w if mode == "both" else 0.0, ring.me)
      self.w_q, self.w_k_all, self.nan = (self.split.w_q, self.split.w_k,
                                          self.split.nan)

  def tile(self, src, home):
    """The keywords (``groups=``, ``diagonal=``) of the tile against the
    key shard of ``src`` (``home``: this device's own, known statically):
    the pairs that the tiles leave out."""
    if self.diagonal:
      return {"diagonal": home}
    if not self.masked:
      return {"groups": (self.split.q_ids, groups_lib.shard(
          self.split.k_ids, src, self.b_k))}
    kw = {"groups": (self.g_q, groups_lib.shard(self.g_k_all, src,
                                                self.b_k))}
    if self.outside:
      b_q = self.g_q.shape[0]
      if self.pos_labels is None:  # The pairs (r, r) of the home tile.
        if home:
          kw["positives"] = jnp.arange(b_q, dtype=jnp.int32)
      else:
        idx, valid = terms.shard_positives(self.pos_labels, src, self.b_k)
        kw["positives"] = jnp.where(valid, idx, -1)
    return kw

  def term_args(self, src):
    """(g_q, g_k, w_q, w_k) of ``positives_term`` for the shard of src."""
    return (self.g_q, groups_lib.shard(self.g_k_all, src, self.b_k), self.w_q,
            groups_lib.shard(self.w_k_all, src, self.b_k))


def _fwd(q, k, scale, bias, labels, groups, backend, mode, group_mode,
         block_sizes, axes, outside=False):
  tiles = registry.get(backend, FAMILY)
  ring = Ring(axes)
  b_q, b_k = q.shape[0], k.shape[0]
  cols = mode == "both"
  row_w, col_w, _ = terms.weights(mode, ring.size * b_q, ring.size * b_k)
  pos_labels = _positive_labels(ring, labels, b_q, b_k)
  grp = _Groups(groups, group_mode, ring, labels, b_q, b_k, mode, outside)

  def tile(kc, src, home=False):
    row, col = tiles.lse(q, kc, scale, bias, rows=True, cols=cols,
                         block_sizes=block_sizes, **grp.tile(src, home))
    pos = jnp.zeros((), F32)
    if grp.multi:
      # The plain pairs' grouped sums, and the positive logit of each query
      # with one related key, if that key is here.
      idx, valid = terms.shard_positives(grp.split.labels, src, b_k)
      pos = (groups_lib.positives_term(q, kc, scale, bias,
                                       *grp.term_args(src)),
             terms.positive_logits(q, kc, scale, bias, idx, valid)[0])
    elif pos_labels is not None:
      idx, valid = terms.shard_positives(pos_labels, src, b_k)
      if grp.masked:  # Per row: the positive is put back into its LSE.
        pos, _ = terms.positive_logits(q, kc, scale, bias, idx, valid)
      else:
        pos, _ = terms.positive_sum(q, kc, scale, bias, idx, valid)
    return row, col, pos

  def step(n, state, last):
    """One ring step: start the transfers, then compute the held tile."""
    kc, (r, c_prev, pos) = state
    # The column statistics travel with the key shard (mode "both").
    # The last step keeps its shard: the backward starts with it.
    k_held, c_in, k_next = ring.pass_on(ring.send, None if last else kc, kc,
                                        c_prev if cols else None)
    k_next = kc if last else k_next
    row, col, pos_t = tile(k_held, ring.source(n))
    c_out = jnp.logaddexp(c_in, col) if cols else None
    return k_next, (jnp.logaddexp(r, row), c_out,
                    jax.tree.map(jnp.add, pos, pos_t))

  home = tile(k, ring.me, home=True)
  s_home = None
  if grp.masked and pos_labels is None:
    s_home, _ = terms.positive_logits(q, k, scale, bias)
    if cols:
      # The columns' positives are the home tile's (i, i). Their statistics
      # travel as a pair: [the full LSE (positive put back), the negatives'
      # LSE] (``terms.confident``); the tiles elsewhere add to both alike.
      home = (home[0], jnp.stack([groups_lib.put_back(home[1], s_home,
                                                      grp.rel_pos), home[1]]),
              home[2])
  k_next = ring.send_next(k)  # Issued before the home tile.
  k_last, (r, c_out, pos) = ring.run((k_next, home), step)
  # N > 1: the shard of device me + 1 and, before its hop home, its complete
  # column statistics (the backward's first step).
  c_last = c_out if ring.size > 1 else None
  c_home = ring.hop_home(c_out) if cols else None
  if s_home is not None:
    pos = s_home
  if grp.masked:
    # The positive stays out of the log-sum-exp: each term is
    # softplus(negatives' LSE - positive), which keeps its relative accuracy
    # however confident the model (``terms.confident``).
    r, u_r, row_loss = terms.confident(r, pos, grp.rel_pos)
    local = row_w * jnp.sum(row_loss)
    u_c = None
    if cols:
      c_home, u_c, col_loss = terms.confident(c_home[1], pos, grp.rel_pos,
                                              full=c_home[0])
      c_last = None if c_last is None else c_last[0]
      local = local + col_w * jnp.sum(col_loss)
    margins = (u_r, u_c)
  else:
    # "positives": the queries with one related key as in "mask", the
    # others' plain LSEs less the grouped positive terms.
    split = grp.split
    term, pos = pos
    r, u_r, row_loss = terms.confident(r, pos, split.one)
    local = row_w * jnp.sum(row_loss) - term
    u_c = pair_col = None
    if cols:
      # The left-out keys' related queries, from every device.
      col_r, col_mean = groups_lib.column_positives(
          groups_lib.gather_ids(pos, axes), split.labels_all,
          ring.size * b_k)
      mine = lambda v, src: groups_lib.shard(v, src, b_k)
      c_home, u_c, col_loss = terms.confident_group(
          c_home, mine(col_r, ring.me), mine(col_mean, ring.me),
          mine(split.masked_k, ring.me))
      local = local + col_w * jnp.sum(col_loss)
      if c_last is not None:  # The shard of device me + 1, before its hop.
        nxt = ring.source(ring.size - 1)
        c_last = jnp.where(mine(split.masked_k, nxt),
                           jnp.logaddexp(c_last, mine(col_r, nxt)), c_last)
      pair_col = groups_lib.column_pair_weight(
          pos, split.labels, col_r, groups_lib.gather_ids(u_c, axes),
          split.n_q)
    margins = (u_r, u_c, pair_col)
  local = local + terms.nan_if_out_of_range(labels, ring.size * b_k)
  if grp.multi:
    local = local + grp.nan
  return ring.psum(local), (q, k, scale, bias, labels, groups, r, c_home,
                           k_last, c_last, pos, margins)


def _bwd(backend, mode, group_mode, block_sizes, axes, outside, res, g):
  (q, k, scale, bias, labels, groups, r, c_home, k_last, c_last, s_pos,
   margins) = res
  tiles = registry.get(backend, FAMILY)
  ring = Ring(axes)
  b_q, b_k = q.shape[0], k.shape[0]
  row_w, col_w, _ = terms.weights(mode, ring.size * b_q, ring.size * b_k)
  pos_labels = _positive_labels(ring, labels, b_q, b_k)
  grp = _Groups(groups, group_mode, ring, labels, b_q, b_k, mode, outside)
  g = g.astype(F32)
  row_coef, col_coef = g * row_w, g * col_w
  if grp.masked:
    # The positive entries of G, -(1 - p), as sigmoid(negatives' LSE -
    # positive) in float32; the tiles give the rest, scaled so that the
    # largest of them is near 1 (``terms.confident_scale``).
    sig_r, col_pos, log_factor, factor = terms.confident_scale(
        *margins, grp.rel_pos, ring.pmax)
  else:
    # "positives": the pairs left out (one related key) as in "mask", with
    # the column part of each pair's entry (``groups_lib.Positives``).
    u_r, u_c, col_pos = margins
    sig_r, _, log_factor, factor = terms.confident_scale(
        u_r, u_c, grp.split.one, ring.pmax,
        rel_c=groups_lib.shard(grp.split.masked_k, ring.me, b_k))
  w_pos = g * row_w * sig_r + (0.0 if col_pos is None
                               else g * col_w * col_pos)
  # exp(s - (lse + log factor)) = exp(s - lse) / factor <= 1.
  r = r + log_factor
  c_home = None if c_home is None else c_home + log_factor
  c_last = None if c_last is None else c_last + log_factor
  row_coef, col_coef = row_coef * factor, col_coef * factor
  if grp.multi:
    block_sizes = groups_lib.positives_block_sizes(block_sizes)

  def tile(kc, cc, src, home=False):
    dq, dk, dsc, dbi = tiles.lse_grad(q, kc, scale, bias, r, cc, row_coef,
                                      col_coef, block_sizes=block_sizes,
                                      **grp.tile(src, home))
    if grp.multi:
      pq, pk, psc, pbi = groups_lib.positives_term_grads(
          q, kc, scale, bias, *grp.term_args(src), -g)
      dq, dk, dsc, dbi = dq + pq, dk + pk, dsc + psc, dbi + pbi
      idx, valid = terms.shard_positives(grp.split.labels, src, b_k)
      _, k_rows = terms.positive_sum(q, kc, scale, bias, idx, valid)
      pq, pk, psc, pbi = terms.positive_grads(q, kc, scale, w_pos, k_rows,
                                              idx, valid)
      dq, dk, dsc, dbi = dq + pq, dk + pk, dsc + psc, dbi + pbi
    elif pos_labels is not None:
      # The positive term -w_pos * s_il of the pairs whose key is here.
      idx, valid = terms.shard_positives(pos_labels, src, b_k)
      _, k_rows = terms.positive_sum(q, kc, scale, bias, idx, valid)
      pq, pk, psc, pbi = terms.positive_grads(q, kc, scale, w_pos, k_rows,
                                              idx, valid)
      dq, dk, dsc, dbi = dq + pq, dk + pk, dsc + psc, dbi + pbi
    return dq, dk, dsc, dbi

  def step(n, state, home):
    """Start the previous accumulator's (and the shard's) transfers, then
    compute the held tile; the home tile comes last (``Ring.source_back``).
    """
    kv, (dq, dk_prev, dsc, dbi) = state
    # The held shard travels with its column statistics; the home tile
    # reads the local ones.
    (kc, cc), dk_in, kv_next = ring.pass_on(
        ring.send_back, None if home else kv, (k, c_home) if home else kv,
        dk_prev)
    dq_t, dk_t, dsc_t, dbi_t = tile(kc, cc, ring.source_back(n), home)
    return kv_next, (dq + dq_t, dk_in + dk_t, dsc + dsc_t, dbi + dbi_t)

  if ring.size == 1:
    dq, dk, dsc, dbi = tile(k, c_home, ring.me, home=True)
  else:
    # Step 0: the shard the forward ended with (device me + 1's), no
    # transfer; passed on when a step other than home follows (N > 2).
    kv0 = (k_last, c_last)
    kv_next = ring.send_back(kv0) if ring.size > 2 else None
    _, (dq, dk, dsc, dbi) = ring.run(
        (kv_next, tile(k_last, c_last, ring.source_back(0))), step)
  if pos_labels is None and not grp.multi:
    _, k_rows = terms.positive_sum(q, k, scale, bias)
    pq, pk, psc, pbi = terms.positive_grads(q, k, scale, w_pos, k_rows)
    dq, dk, dsc, dbi = dq + pq, dk + pk, dsc + psc, dbi + pbi
  # Out-of-range labels (or a query without positives): NaN gradients,
  # like the loss.
  dq = dq + terms.nan_if_out_of_range(labels, ring.size * b_k)
  if grp.multi:
    dq = dq + grp.nan
  return (dq.astype(q.dtype), dk.astype(k.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype), None, None)


softmax_loss.defvjp(_fwd, _bwd)
