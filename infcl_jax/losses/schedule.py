"""The ring schedule that both loss families run, for N >= 1 devices.

Device k of N holds its own shards. The travelling shards walk round the
ring: device i sends to i + 1, so at step n device k holds the shard of
device (k - n) mod N. At every step the transfer of the *next* shard is
issued before the current tile's compute (the two are independent, so XLA's
scheduler can overlap them), and an accumulator that belongs to the
travelling shard (column statistics in the forward, a gradient in the
backward) travels with it and takes one last hop home after step N - 1.

``Ring(())`` is the single-device case: size 1, index 0, no transfers, and
``psum`` is the identity, so one loss definition serves 1..N devices.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from infcl_jax import _axes


class Ring:
  """The devices along ``axes`` (a tuple of mesh axis names, or ``()``)."""

  def __init__(self, axes):
    self.axes = tuple(axes)
    self.size = _axes.axis_size(self.axes)
    self.me = lax.axis_index(self.axes) if self.axes else 0

  def send(self, tree):
    """Every device's ``tree`` to the next device (i -> i + 1)."""
    perm = [(i, (i + 1) % self.size) for i in range(self.size)]
    return lax.ppermute(tree, self.axes, perm)

  def send_next(self, tree):
    """The first transfer, issued before the home tile (None when N = 1)."""
    return self.send(tree) if self.size > 1 else None

  def hop_home(self, acc):
    """After N - 1 steps the accumulator held here belongs to the next
    device's shard; one more hop takes every accumulator home."""
    return self.send(acc) if self.size > 1 else acc

  def psum(self, v):
    return lax.psum(v, self.axes) if self.axes else v

  def source(self, n):
    """The device whose shard is held at step ``n``."""
    return (self.me - n) % self.size

  def run(self, state, step):
    """``state = step(n, state, last)`` for the ring steps n = 1 .. N - 1.

    Step 0 (the home tile) is the caller's, unrolled, so that its outputs
    give the loop state its shapes and device-varying types. The middle
    steps are one ``lax.scan`` (the program does not grow with N); the last
    is unrolled too, since it sends no next shard (``last=True``).
    """
    if self.size > 2:
      def body(state, n):
        return step(n, state, False), None
      state, _ = lax.scan(body, state, jnp.arange(1, self.size - 1))
    if self.size > 1:
      state = step(self.size - 1, state, True)
    return state
