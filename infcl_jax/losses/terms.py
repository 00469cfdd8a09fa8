"""The O(B * D) terms of the softmax loss: direction weights and positives.

Queries q (images, or texts for ``text_to_image``) and keys k. Global query
i pairs with global key ``labels[i]`` (``arange`` unless the caller gives
labels). The tile backends compute the log-sum-exp terms; the positive
logits are computed here, from the rows themselves.
"""
from __future__ import annotations

import jax.numpy as jnp

from infcl_jax import _math

F32 = jnp.float32
MODES = ("both", "rows")


def weights(mode, n_q, n_k):
  """Coefficients (row_w, col_w, pos_w) of the global loss

      L = row_w * sum_i r_i + col_w * sum_j c_j - pos_w * sum_i s_ii

  for ``n_q`` global queries and ``n_k`` global keys. Mode "both" is CLIP
  (n_q == n_k, mean of the two cross-entropies); "rows" is one-way InfoNCE
  over the queries (n_k >= n_q).
  """
  del n_k
  if mode == "both":
    w = 0.5 / n_q
    return w, w, 2 * w
  if mode == "rows":
    return 1.0 / n_q, 0.0, 1.0 / n_q
  raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def default_labels(me, b_q):
  """The global key index of each local query's positive by default: local
  query r of device ``me`` is global query me * b_q + r, paired with the
  global key of the same index."""
  return me * b_q + jnp.arange(b_q, dtype=jnp.int32)


def shard_positives(labels, src, b_k):
  """The positive pairs between local queries and the key shard of ``src``.

  The positive of local query r, global key ``labels[r]``, sits at row
  labels[r] - src * b_k of shard ``src`` when that is in [0, b_k).

  Returns:
    (idx, valid): (b_q,) int32 key rows (clipped, so always in range) and a
    (b_q,) bool mask of the queries whose positive is in this shard.
  """
  idx = labels.astype(jnp.int32) - src * b_k
  valid = (idx >= 0) & (idx < b_k)
  return jnp.clip(idx, 0, b_k - 1), valid


def nan_if_out_of_range(labels, n_keys):
  """0.0, or NaN when any label is outside [0, n_keys): an out-of-range
  positive would otherwise be silently missing from the loss (under ``jit``
  the values cannot be checked when the loss is traced)."""
  if labels is None:
    return jnp.zeros((), F32)
  bad = jnp.any((labels < 0) | (labels >= n_keys))
  return jnp.where(bad, jnp.nan, 0.0).astype(F32)


def positive_sum(q, k, scale, bias, idx=None, valid=None):
  """sum over the pairs (r, idx_r) with valid_r of s = scale <q_r, k_idx> + b.

  ``idx=None`` means the pairs (r, r), r < b_q: the home tile of a ring
  whose query and key shards line up. Returns (sum, k_rows): the float32
  key row of each pair (zero where not valid), reused by the gradient.
  """
  q32 = q.astype(F32)
  if idx is None:
    k_rows = k[:q.shape[0]].astype(F32)
    count = q.shape[0]
  else:
    k_rows = jnp.where(valid[:, None], k[idx].astype(F32), 0.0)
    count = jnp.sum(valid.astype(F32))
  return scale * jnp.sum(q32 * k_rows) + bias * count, k_rows


def positive_logits(q, k, scale, bias, idx=None, valid=None):
  """Per-row ``positive_sum``: (b_q,) positive logits (0 where not valid)
  and the key rows."""
  q32 = q.astype(F32)
  if idx is None:
    k_rows = k[:q.shape[0]].astype(F32)
    return scale * jnp.sum(q32 * k_rows, axis=1) + bias, k_rows
  k_rows = jnp.where(valid[:, None], k[idx].astype(F32), 0.0)
  s = scale * jnp.sum(q32 * k_rows, axis=1) + bias
  return jnp.where(valid, s, 0.0), k_rows


def positive_grads(q, k, scale, weight, k_rows, idx=None, valid=None):
  """Gradients of ``-weight * positive_sum`` w.r.t. (q, k, scale, bias).

  ``k_rows`` comes from ``positive_sum`` with the same ``idx`` / ``valid``.
  ``weight`` is a scalar, or one weight per query ((b_q,): the gradient of
  ``-sum_r weight_r s_r``).
  """
  if jnp.ndim(weight):
    return _weighted_positive_grads(q, k, scale, weight, k_rows, idx, valid)
  q32 = q.astype(F32)
  b_q = q.shape[0]
  if idx is None:
    q_rows = q32
    idx = jnp.arange(b_q, dtype=jnp.int32)
    count = b_q
  else:
    q_rows = jnp.where(valid[:, None], q32, 0.0)
    count = jnp.sum(valid.astype(F32))
  dq = -(weight * scale) * k_rows
  dk = jnp.zeros(k.shape, F32).at[idx].add(-(weight * scale) * q_rows)
  dscale = -weight * jnp.sum(q32 * k_rows)
  dbias = -weight * count
  return dq, dk, dscale, dbias


def _weighted_positive_grads(q, k, scale, weight, k_rows, idx, valid):
  q32 = q.astype(F32)
  b_q = q.shape[0]
  if idx is None:
    idx = jnp.arange(b_q, dtype=jnp.int32)
  else:
    weight = jnp.where(valid, weight, 0.0)
  ws = (weight * scale)[:, None]
  dq = -ws * k_rows
  dk = jnp.zeros(k.shape, F32).at[idx].add(-ws * q32)
  dscale = -jnp.sum(weight * jnp.sum(q32 * k_rows, axis=1))
  return dq, dk, dscale, -jnp.sum(weight)


# ------------------------------------------- the positive outside the LSE
#
# A confident model's positive logit dominates its row: r = LSE_j s_ij and
# s_ii are two numbers near s_ii (~ the scale, 50-100), and r - s_ii and the
# gradient's p_ii - 1 cancel to nothing once p_ii is within the working
# precision of 1. The tiles leave the positive out instead (its pair is
# masked, like a related pair of ``groups``), so they give n = the
# negatives' LSE, and with the float32 positive s (from the embeddings):
#   loss term  softplus(n - s)  (= log1p(sum_{j != i} exp(s_ij - s)))
#   1 - p      sigmoid(n - s)
# neither of which cancels (the algebra:
# https://github.com/infcl-jax/infcl-jax/blob/main/docs/math.md#a-confident-model).


def confident(neg_lse, pos, rel, full=None):
  """(full LSE, margin u = n - s, loss terms) of rows whose tiles left the
  positive out where ``rel`` (elsewhere ``neg_lse`` already holds it: the
  plain r - s, as before).

  ``full`` (optional) is the full LSE when the caller carried it (a column
  statistic that travelled with its positive put back); the backward's
  tiles normalise by it.
  """
  u = neg_lse - pos
  loss = jnp.where(rel, _math.softplus(u), u)
  if full is None:
    full = jnp.where(rel, jnp.logaddexp(neg_lse, pos), neg_lse)
  return full, u, loss


def confident_group(neg_lse, rel_lse, rel_mean, rel):
  """``confident`` for keys (or queries) that may have several related
  partners, all left out of the tiles where ``rel``: with their LSE
  ``rel_lse`` = R and mean logit ``rel_mean``, the term LSE - mean is
  softplus(n - R) + (R - mean), the second part exactly 0 for one partner
  and at least log 2 otherwise (``groups.Positives``). Elsewhere
  ``neg_lse`` is the plain LSE and the term is that LSE (the mean is
  taken elsewhere). Returns (full LSE, u = n - R, terms)."""
  u = neg_lse - rel_lse
  loss = jnp.where(rel, _math.softplus(u) + (rel_lse - rel_mean), neg_lse)
  full = jnp.where(rel, jnp.logaddexp(neg_lse, rel_lse), neg_lse)
  return full, u, loss


def sigmoid(u):
  """1 / (1 + e^-u), to full relative precision for u << 0 (where it is the
  tiny 1 - p of a confident row)."""
  return jnp.exp(-_math.softplus(-u))


def confident_scale(u_r, u_c, rel, pmax, rel_c=None):
  """What the backward needs from the margins of ``confident``.

  Returns (sig_r, sig_c, log_factor, factor):
    sig_r, sig_c: 1 - p of each row's (column's) positive, sigmoid(u), where
      the tiles left it out; 1 elsewhere (there the tiles' own p and the
      positive term -1 make the entry, as without the mask). ``sig_c`` is
      None without columns.
    log_factor, factor: every off-positive entry of G is at most max(sig)
      (its row's exp(s - full LSE) <= sigmoid(u)), which is tiny when the
      whole batch is confident: a 16-bit panel of G would flush it to zero.
      The tiles get the statistics plus ``log_factor`` = log(max sig) and
      the coefficients times ``factor`` = max sig, so that their G is
      scaled to at most 1 and scaled back after the float32-accumulated
      matmuls.
  ``pmax`` is the max across devices (the identity on one). ``rel_c``:
  the columns' own ``rel`` where it is not the rows' (``groups.Positives``;
  the bound holds there too: a column's entries are at most
  sigmoid(N' - R')).
  """
  sig_r = jnp.where(rel, sigmoid(u_r), 1.0)
  top = jnp.max(sig_r, initial=0.0)
  sig_c = None
  if u_c is not None:
    sig_c = jnp.where(rel if rel_c is None else rel_c, sigmoid(u_c), 1.0)
    top = jnp.maximum(top, jnp.max(sig_c, initial=0.0))
  top = pmax(top)
  # No negatives anywhere (all sig 0): nothing to scale.
  factor = jnp.where(top > 0, top, 1.0)
  return sig_r, sig_c, jnp.log(factor), factor
