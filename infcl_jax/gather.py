"""The exact CLIP loss across devices by gathering the keys (DisCo-CLIP style).

Runs inside ``jax.shard_map``, with the same shards, global batch,
positives and gradient convention as ``ring.py`` (read its docstring).

Forward: one ``all_gather`` of the key shards (B_k x D per device), then the
local b_q x B_k rows through the tile backend in one sweep. That sweep gives
the local rows' LSE completely and, for every key, the LSE over the local
queries only; the column LSE over all queries is their log-sum-exp across
devices (``pmax`` + ``psum`` of B_k floats, next to nothing beside B_k x D).

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
from infcl_jax import contrastive
from infcl_jax import tile_backend

F32 = jnp.float32


def _weights(mode, n_q, n_k):
  direction = "both" if mode == "both" else "image_to_text"
  return contrastive.direction_weights(direction, n_q, n_k)


def _global_lse(partial_lse, axes):
  """log sum_devices exp(partial_lse), elementwise, stable."""
  m = lax.pmax(partial_lse, axes)
  shift = jnp.where(m == -jnp.inf, 0.0, m)
  return shift + jnp.log(lax.psum(jnp.exp(partial_lse - shift), axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def gather_loss(q, k, scale, bias, backend, mode, block_sizes, axes):
  """Global CLIP loss by all-gather; arguments as ``ring.ring_loss``."""
  loss, _ = _fwd(q, k, scale, bias, backend, mode, block_sizes, axes)
  return loss


def _positive_keys(keys, me, b_q):
  """The gathered keys of the local queries' positives (global i <-> i)."""
  return lax.dynamic_slice_in_dim(keys, me * b_q, b_q, axis=0)


def _fwd(q, k, scale, bias, backend, mode, block_sizes, axes):
  kernel = tile_backend.get_backend(backend)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q = q.shape[0]
  cols = mode == "both"
  row_w, col_w, pos_w = _weights(mode, n_dev * b_q, n_dev * k.shape[0])
  keys = lax.all_gather(k, axes, axis=0, tiled=True)
  row, col_part = kernel.lse(q, keys, scale, bias, rows=True, cols=cols,
                             block_sizes=block_sizes)
  k_pos = _positive_keys(keys, me, b_q).astype(F32)
  pos = scale * jnp.sum(q.astype(F32) * k_pos) + bias * b_q
  loss = lax.psum(row_w * jnp.sum(row) - pos_w * pos, axes)
  col = None
  if cols:
    col = _global_lse(col_part, axes)  # Identical on every device.
    loss = loss + col_w * jnp.sum(col)
  return loss, (q, k, scale, bias, row, col)


def _bwd(backend, mode, block_sizes, axes, res, g):
  q, k, scale, bias, row, col = res
  kernel = tile_backend.get_backend(backend)
  n_dev = _axes.axis_size(axes)
  me = lax.axis_index(axes)
  b_q = q.shape[0]
  row_w, col_w, pos_w = _weights(mode, n_dev * b_q, n_dev * k.shape[0])
  g = g.astype(F32)
  w_pos = g * pos_w
  keys = lax.all_gather(k, axes, axis=0, tiled=True)
  dq, dkeys, dsc, dbi = kernel.lse_grad(q, keys, scale, bias, row, col,
                                        g * row_w, g * col_w,
                                        block_sizes=block_sizes)
  k_pos = _positive_keys(keys, me, b_q).astype(F32)
  q32 = q.astype(F32)
  dq = dq - (w_pos * scale) * k_pos
  dkeys = dkeys.at[me * b_q + jnp.arange(b_q)].add(-(w_pos * scale) * q32)
  dsc = dsc - w_pos * jnp.sum(q32 * k_pos)
  dbi = dbi - w_pos * b_q
  dk = lax.psum_scatter(dkeys, axes, scatter_dimension=0, tiled=True)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype))


gather_loss.defvjp(_fwd, _bwd)
