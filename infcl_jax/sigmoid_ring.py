"""The exact SigLIP sigmoid loss across devices, as a ring of ``ppermute``s.

Runs inside ``jax.shard_map``; ``sigmoid_loss(..., axis_name=...)`` calls
``ring_sigmoid_loss``. Device k of N holds b images x^(k) and b texts y^(k);
the global batch (B = N * b) is the shards concatenated in axis order, and
global pair (i, i) is the positive.

    L = (1/B) sum_k sum_n sigmoid_sum(x^(k), y^((k - n) mod N))

Forward (N steps, the schedule of ``ring.py``): the text shards walk round
the ring; step n adds the tile sum of the local images against the shard of
device (k - n) mod N. Positives exist only in the home tile (n = 0, the tile
op's ``has_diagonal=True``); every other tile is all negatives. The next
shard's ``ppermute`` is issued before the current tile's compute. There are
no statistics, so the residuals are just the inputs.

Backward (N steps, recomputing every tile): dx accumulates locally; the dy
accumulator travels with its text shard (sent at the start of the next step,
so the transfer overlaps that step's tile) and arrives home after N hops.

Memory per device is O(b * D) plus one tile, in forward and backward, for
any N. OpenCLIP's neighbour-exchange SigLIP keeps every received shard and
its logits for autograd (memory growing with N), and big_vision's chunked
version gathers with ``psum``; here nothing but the travelling shard and
its gradient accumulator is alive at a time.

Gradient convention (as for the CLIP ring, see ``ring.py``): every device
gets the exact partial derivative of the global loss w.r.t. its own shards;
the replicated scale and bias get each device's share, which JAX sums over
devices (``check_vma=True``) -- with ``check_vma=False`` ``psum`` them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes
from infcl_jax import reference
from infcl_jax import tile_backend
from infcl_jax.ring import run_ring

F32 = jnp.float32
FAMILY = "sigmoid"


def ring_sigmoid_loss(x, y, scale, bias, *, axis_name, backend, block_sizes):
  """Global sigmoid loss from this device's (b, D) shards; in ``shard_map``.

  Args:
    x, y: local image and text shards, same shape, validated and cast.
    scale, bias: scalar logit scale and bias.
    axis_name: axis name or tuple of names the batch is sharded over.
    backend: a resolved sigmoid tile backend name, or "reference" (the full
      matrix of the gathered batch on every device; O(B^2), for testing).
    block_sizes: ``BlockSizes`` or None, passed to every tile.

  Returns:
    The global float32 loss, identical on every device.
  """
  axes = _axes.normalize(axis_name)
  _axes.axis_size(axes)  # A clear error for an unbound or unknown axis.
  if backend == "reference":
    xs = lax.all_gather(x, axes, axis=0, tiled=True, to="invarying")
    ys = lax.all_gather(y, axes, axis=0, tiled=True, to="invarying")
    return reference.sigmoid_loss_reference(xs, ys, scale, bias).astype(F32)
  scale = _axes.to_varying(jnp.asarray(scale, F32), axes)
  bias = _axes.to_varying(jnp.asarray(bias, F32), axes)
  x, y = _axes.to_varying(x, axes), _axes.to_varying(y, axes)
  return _ring(x, y, scale, bias, backend, block_sizes, axes)


def _perm(n):
  return [(i, (i + 1) % n) for i in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(x, y, scale, bias, backend, block_sizes, axes):
  loss, _ = _fwd(x, y, scale, bias, backend, block_sizes, axes)
  return loss


def _fwd(x, y, scale, bias, backend, block_sizes, axes):
  kernel = tile_backend.get_backend(backend, FAMILY)
  n_dev = _axes.axis_size(axes)
  send = lambda a: lax.ppermute(a, axes, _perm(n_dev))

  def tile(yc, home):
    return kernel.sigmoid_sum(x, yc, scale, bias, has_diagonal=home,
                              block_sizes=block_sizes)

  def step(n, state, last):
    del n  # Every tile but the home one is all negatives.
    yc, total = state
    y_next = send(yc) if not last else None
    return y_next, total + tile(yc, False)

  y_next = send(y) if n_dev > 1 else None  # Issued before the home tile.
  _, total = run_ring(n_dev, (y_next, tile(y, True)), step)
  loss = lax.psum(total, axes) / (n_dev * x.shape[0])
  return loss, (x, y, scale, bias)


def _bwd(backend, block_sizes, axes, res, g):
  x, y, scale, bias = res
  kernel = tile_backend.get_backend(backend, FAMILY)
  n_dev = _axes.axis_size(axes)
  send = lambda a: lax.ppermute(a, axes, _perm(n_dev))
  coef = g.astype(F32) / (n_dev * x.shape[0])

  def tile(yc, home):
    return kernel.sigmoid_grad(x, yc, scale, bias, coef, has_diagonal=home,
                               block_sizes=block_sizes)

  def step(n, state, last):
    """Start the next shard's and the previous accumulator's transfers."""
    del n
    yc, (dx, dy_prev, dsc, dbi) = state
    y_next = send(yc) if not last else None
    dy_in = send(dy_prev)
    dx_t, dy_t, dsc_t, dbi_t = tile(yc, False)
    return y_next, (dx + dx_t, dy_in + dy_t, dsc + dsc_t, dbi + dbi_t)

  y_next = send(y) if n_dev > 1 else None
  _, (dx, dy, dsc, dbi) = run_ring(n_dev, (y_next, tile(y, True)), step)
  if n_dev > 1:
    dy = send(dy)  # The accumulator of shard k + 1 goes home.
  return (dx.astype(x.dtype), dy.astype(y.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype))


_ring.defvjp(_fwd, _bwd)
