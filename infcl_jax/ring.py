"""The exact CLIP loss across devices as a ring of ``ppermute`` steps.

Runs inside ``jax.shard_map``. Device k of the N devices on the axis holds a
query shard q^(k) (b_q rows) and a key shard k^(k) (b_k rows); the global
batch is the concatenation of the shards in axis order. The key shards walk
around the ring: at step n device k holds the key shard of device
(k - n) mod N and runs one tile (b_q x b_k, through the tile backend, so any
registered backend -- ``xla``, ``pallas`` -- works unchanged).

Forward (N steps). The row LSE of the local queries merges across steps and
stays local. The column LSE belongs to the travelling key shard: it travels
with it (one O(b_k) ``ppermute`` per step) and, after the N-th hop, arrives
home complete. The ``ppermute`` of the next key shard (and of the previous
step's column statistics) is issued before the current tile's compute; the
two are independent, so the scheduler may overlap them.

Backward (N steps). The same ring, recomputing every tile from the residuals
(q, k, scale, bias and the O(b) global statistics): ``lse_grad`` is given
the *global* row / column LSE, so each tile's output is exactly that tile's
share of the global gradient. dq accumulates locally; the dk accumulator
travels with its key shard (sent at the start of the next step, so the
transfer overlaps that step's tile) and arrives home after N hops.

Memory per device is O((b_q + b_k) * D) plus the backend's tile workspace:
it does not depend on N.

Positives. Global query i pairs with global key i. When b_q == b_k they all
sit in the home tile; when b_q < b_k (a one-way loss with extra keys) the
positive of local query r on device k is global key k * b_q + r, which lives
on device (k * b_q + r) // b_k: each step picks the pairs whose key is in
the shard it holds (an O(b_q * D) gather), so no reordering is needed.

Gradient convention. The forward returns the global loss L on every device
(a ``psum``). The backward gives each device the exact partial derivative of
L with respect to its own shards q^(k), k^(k), and, for the replicated
scale and bias, this device's share of dL/dscale and dL/dbias (its tiles),
so that the sum over devices is the full derivative. The scalars are cast to
device-varying before the ``custom_vjp``; under ``shard_map``'s default
``check_vma=True`` JAX transposes that cast into the ``psum``, so a
replicated input receives the full gradient. The same holds for any
replicated parameter that produced the shards: its gradient is the SUM of
the devices' contributions (JAX adds it for replicated inputs under
``check_vma=True``; with ``check_vma=False`` call ``lax.psum`` yourself). A
DDP-style ``pmean`` would be N times too small.

Overlap on GPU. XLA turns each ``ppermute`` into an asynchronous
collective-permute-start / -done pair; the latency hiding scheduler then
places the tile's fusions and matmuls between them. Set

  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true"

(the default in recent jaxlib builds, and in NVIDIA's JAX containers) and do
not list ``collectivepermute`` in ``--xla_gpu_disable_async_collectives``.
``benchmarks/ring_hlo.py`` prints the scheduled HLO's collective-permutes and
what runs between their start and done.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import contrastive
from infcl_jax import tile_backend

F32 = jnp.float32


def _ring_perm(n):
  """Device i sends to i + 1: after s hops device k holds shard k - s."""
  return [(i, (i + 1) % n) for i in range(n)]


def run_ring(n_dev, state, step):
  """Runs ``state = step(n, state, last)`` for the ring steps n = 1 .. N-1.

  Step 0 (the home tile) is the caller's, unrolled, so that its outputs give
  the loop state its shapes and device-varying types. The middle steps are
  one ``lax.scan`` (the program does not grow with N); the last step is
  unrolled too, since it sends no next shard (``last=True``).
  """
  if n_dev > 2:
    def body(state, n):
      return step(n, state, False), None
    state, _ = lax.scan(body, state, jnp.arange(1, n_dev - 1))
  if n_dev > 1:
    state = step(n_dev - 1, state, True)
  return state


def _weights(mode, n_q, n_k):
  direction = "both" if mode == "both" else "image_to_text"
  return contrastive.direction_weights(direction, n_q, n_k)


def offshard_positives(me, src, b_q, b_k):
  """Positive pairs between local queries and the key shard of device src.

  Global query me * b_q + r pairs with global key me * b_q + r, which sits at
  row (me * b_q + r) - src * b_k of shard src when that is in [0, b_k).

  Returns:
    (idx, valid): (b_q,) int32 key rows (clipped, so always in range) and a
    (b_q,) bool mask of the queries whose positive is in this shard.
  """
  idx = me * b_q + jnp.arange(b_q, dtype=jnp.int32) - src * b_k
  valid = (idx >= 0) & (idx < b_k)
  return jnp.clip(idx, 0, b_k - 1), valid


def _pos_gathered(q, kc, idx, valid):
  """(sum_r valid_r <q_r, kc[idx_r]>, count, kc rows as float32 masked)."""
  k_rows = jnp.where(valid[:, None], kc[idx].astype(F32), 0.0)
  dots = jnp.sum(q.astype(F32) * k_rows, axis=-1)
  return jnp.sum(dots), jnp.sum(valid.astype(F32)), k_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def ring_loss(q, k, scale, bias, backend, mode, block_sizes, axes):
  """Global CLIP loss over the ring; see the module docstring.

  Args:
    q: (b_q, D) local queries (images, or texts for ``text_to_image``).
    k: (b_k, D) local keys, b_k == b_q for mode "both", b_k >= b_q for
      mode "rows".
    scale, bias: float32 scalars, device-varying over ``axes``.
    backend: a registered softmax tile backend name (not "auto").
    mode: "both" (row and column cross-entropies) or "rows" (queries only).
    block_sizes: ``BlockSizes`` or None, passed to every tile.
    axes: tuple of mesh axis names the batch is sharded over.
  """
  loss, _ = _fwd(q, k, scale, bias, backend, mode, block_sizes, axes)
  return loss


def _fwd(q, k, scale, bias, backend, mode, block_sizes, axes):
  kernel = tile_backend.get_backend(backend)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q, b_k = q.shape[0], k.shape[0]
  cols = mode == "both"
  row_w, col_w, pos_w = _weights(mode, n_dev * b_q, n_dev * b_k)
  home_pos = b_q == b_k
  perm = _ring_perm(n_dev)
  send = lambda a: lax.ppermute(a, axes, perm)

  def tile(kc, src):
    row, col = kernel.lse(q, kc, scale, bias, rows=True, cols=cols,
                          block_sizes=block_sizes)
    if home_pos:
      pos = jnp.zeros((), F32)
    else:
      idx, valid = offshard_positives(me, src, b_q, b_k)
      dots, count, _ = _pos_gathered(q, kc, idx, valid)
      pos = scale * dots + bias * count
    return row, col, pos

  def step(n, state, last):
    """One ring step: start the transfers, then compute the held tile."""
    kc, (r, c_prev, pos) = state
    k_next = send(kc) if not last else None
    c_in = send(c_prev) if cols else None
    row, col, pos_t = tile(kc, (me - n) % n_dev)
    c_out = jnp.logaddexp(c_in, col) if cols else None
    return k_next, (jnp.logaddexp(r, row), c_out, pos + pos_t)

  k_next = send(k) if n_dev > 1 else None  # Issued before the home tile.
  _, (r, c_out, pos) = run_ring(n_dev, (k_next, tile(k, me)), step)
  # After N - 1 hops the column statistics held here belong to shard k + 1;
  # one more hop takes every shard's statistics home.
  c_home = (send(c_out) if n_dev > 1 else c_out) if cols else None

  if home_pos:
    pos_logits, _, _ = contrastive.positive_logits(q, k, scale, bias)
    pos = jnp.sum(pos_logits)
  local = row_w * jnp.sum(r) - pos_w * pos
  if cols:
    local = local + col_w * jnp.sum(c_home)
  loss = lax.psum(local, axes)
  return loss, (q, k, scale, bias, r, c_home)


def _bwd(backend, mode, block_sizes, axes, res, g):
  q, k, scale, bias, r, c_home = res
  kernel = tile_backend.get_backend(backend)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q, b_k = q.shape[0], k.shape[0]
  row_w, col_w, pos_w = _weights(mode, n_dev * b_q, n_dev * b_k)
  home_pos = b_q == b_k
  perm = _ring_perm(n_dev)
  send = lambda a: lax.ppermute(a, axes, perm)
  g = g.astype(F32)
  w_pos = g * pos_w

  def tile(kc, cc, src):
    dq, dk, dsc, dbi = kernel.lse_grad(q, kc, scale, bias, r, cc,
                                       g * row_w, g * col_w,
                                       block_sizes=block_sizes)
    if not home_pos:
      # The positive term -w_pos * s_ii of the pairs whose key is here.
      idx, valid = offshard_positives(me, src, b_q, b_k)
      dots, count, k_rows = _pos_gathered(q, kc, idx, valid)
      dq = dq - (w_pos * scale) * k_rows
      q_rows = jnp.where(valid[:, None], q.astype(F32), 0.0)
      dk = dk.at[idx].add(-(w_pos * scale) * q_rows)
      dsc = dsc - w_pos * dots
      dbi = dbi - w_pos * count
    return dq, dk, dsc, dbi

  def step(n, state, last):
    """Start the next shard's and the previous accumulator's transfers."""
    kv, (dq, dk_prev, dsc, dbi) = state
    kv_next = send(kv) if not last else None
    dk_in = send(dk_prev)
    kc, cc = kv
    dq_t, dk_t, dsc_t, dbi_t = tile(kc, cc, (me - n) % n_dev)
    return kv_next, (dq + dq_t, dk_in + dk_t, dsc + dsc_t, dbi + dbi_t)

  kv_next = send((k, c_home)) if n_dev > 1 else None
  _, (dq, dk, dsc, dbi) = run_ring(n_dev, (kv_next, tile(k, c_home, me)), step)
  if n_dev > 1:
    dk = send(dk)  # The accumulator of shard k + 1 goes home.
  if home_pos:
    pq, pk, psc, pbi = contrastive.positive_grads(q, k, scale, bias, w_pos)
    dq, dk, dsc, dbi = dq + pq, dk + pk, dsc + psc, dbi + pbi
  return (dq.astype(q.dtype), dk.astype(k.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype))


ring_loss.defvjp(_fwd, _bwd)
