"""The exact SigLIP sigmoid loss over a ring of N >= 1 devices.

    L = -(1/B) sum_ij log sigmoid(z_ij * (t * <x_i, y_j> + b))
      = (1/B) sum_k sum_n sigmoid_sum(x^(k), y^((k - n) mod N)),

with z_ij = +1 for the matching pair (i == j), -1 otherwise, and B the
global batch. One ``jax.custom_vjp`` for every case: a single device is the
ring with N = 1 (``axes == ()``).

Forward (N steps of ``schedule.Ring``): the text shards walk round the
ring; step n adds the tile sum of the local images against the shard of
device (k - n) mod N. Positives exist only in the home tile (the tile op's
``has_diagonal=True``); every other tile is all negatives. There are no
statistics: the residuals are the inputs and the text shard held at the
last step (device k + 1's), where the backward starts.

Backward (N steps, recomputing every tile, walking the ring the other way
from the text shard the forward ended with, home tile last:
``Ring.source_back``): dx accumulates locally; the dy accumulator travels with
its text shard, its last hop issued before the home tile (N - 1 hops).

Groups: every device holds all text group ids (O(B) integers) and each
tile takes those of the shard it holds; related pairs are dropped
("mask") or positives ("positives") in every tile, home or not.

Memory per device is O(b * D) plus one tile's workspace, for any N; nothing
but the travelling shard and its gradient accumulator is alive at a time.

Gradient convention: as for the softmax loss (``losses.softmax``).

Parameter convention (SigLIP, Zhai et al. 2023): the loss takes the scale
``t`` itself and the bias ``b``. A model learns ``t'`` with ``t = exp(t')``,
initialised at ``t' = log 10`` and ``b = -10``: the negative bias starts the
B^2 - B negative pairs near zero loss, so the first steps are not spent
pushing every logit down.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from infcl_jax.backends import registry
from infcl_jax.losses import groups as groups_lib
from infcl_jax.losses.schedule import Ring

F32 = jnp.float32
FAMILY = "sigmoid"


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def sigmoid_loss(x, y, scale, bias, groups, backend, group_mode, block_sizes,
                 axes):
  """Global sigmoid loss of the local (b, D) shards x and y.

  Args:
    x, y: local image and text shards, same shape.
    scale, bias: float32 scalars (device-varying over ``axes``).
    groups: None, or ((b,), (b,)) int32 group ids of the local images and
      texts.
    backend: a registered tile backend name (not "auto").
    group_mode: "mask" or "positives" (used with ``groups`` only).
    block_sizes: ``BlockSizes`` or None, passed to every tile.
    axes: tuple of mesh axis names; () for one device.
  """
  loss, _ = _fwd(x, y, scale, bias, groups, backend, group_mode, block_sizes,
                 axes)
  return loss


def _tile_groups(groups, ring, b):
  """src -> the ``groups=`` of the tile against the text shard of src."""
  if groups is None:
    return lambda src: None
  g_x, g_y = groups
  g_y_all = groups_lib.gather_ids(g_y, ring.axes)
  return lambda src: (g_x, groups_lib.shard(g_y_all, src, b))


def _fwd(x, y, scale, bias, groups, backend, group_mode, block_sizes, axes):
  tiles = registry.get(backend, FAMILY)
  ring = Ring(axes)
  tile_groups = _tile_groups(groups, ring, y.shape[0])

  def tile(yc, home, src):
    return tiles.sigmoid_sum(x, yc, scale, bias, has_diagonal=home,
                             block_sizes=block_sizes,
                             groups=tile_groups(src), group_mode=group_mode)

  def step(n, state, last):
    # Every tile but the home one has no diagonal.
    yc, total = state
    # Unlike softmax, no statistics travel forward (the sigmoid loss has
    # none), so there is no accumulator to tie. The last step keeps its
    # shard (device me + 1's): the backward's first.
    y_held, _, y_next = ring.pass_on(ring.send, None if last else yc, yc,
                                     None)
    return (yc if last else y_next), total + tile(y_held, False,
                                                   ring.source(n))

  y_next = ring.send_next(y)  # Issued before the home tile.
  y_last, total = ring.run((y_next, tile(y, True, ring.me)), step)
  loss = ring.psum(total) / (ring.size * x.shape[0])
  return loss, (x, y, scale, bias, groups, y_last)


def _bwd(backend, group_mode, block_sizes, axes, res, g):
  x, y, scale, bias, groups, y_last = res
  tiles = registry.get(backend, FAMILY)
  ring = Ring(axes)
  coef = g.astype(F32) / (ring.size * x.shape[0])
  tile_groups = _tile_groups(groups, ring, y.shape[0])

  def tile(yc, home, src):
    return tiles.sigmoid_grad(x, yc, scale, bias, coef, has_diagonal=home,
                              block_sizes=block_sizes,
                              groups=tile_groups(src), group_mode=group_mode)

  def step(n, state, home):
    """Start the previous accumulator's (and the shard's) transfers, then
    compute the held tile; the home tile comes last (``Ring.source_back``)."""
    yc, (dx, dy_prev, dsc, dbi) = state
    # As in softmax: the dy accumulator's send is tied to the held shard.
    y_held, dy_in, y_next = ring.pass_on(
        ring.send_back, None if home else yc, y if home else yc, dy_prev)
    dx_t, dy_t, dsc_t, dbi_t = tile(y_held, home, ring.source_back(n))
    return y_next, (dx + dx_t, dy_in + dy_t, dsc + dsc_t, dbi + dbi_t)

  if ring.size == 1:
    dx, dy, dsc, dbi = tile(y, True, ring.me)
  else:
    # Step 0: the shard the forward ended with, no transfer (see
    # ``Ring.source_back``); the dy accumulator's last hop (N - 1 in all) is
    # issued before the home tile.
    y_next = ring.send_back(y_last) if ring.size > 2 else None
    _, (dx, dy, dsc, dbi) = ring.run(
        (y_next, tile(y_last, False, ring.source_back(0))), step)
  return (dx.astype(x.dtype), dy.astype(y.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype), None)


sigmoid_loss.defvjp(_fwd, _bwd)
