"""The ring schedule that both loss families run, for N >= 1 devices.

Device k of N holds its own shards. The travelling shards walk round the
ring: device i sends to i + 1, so at step n device k holds the shard of
device (k - n) mod N. At every step the transfer of the *next* shard is
issued before the current tile's compute (the two are independent, so XLA's
scheduler can overlap them), and an accumulator that belongs to the
travelling shard (column statistics in the forward) travels with it and
takes one last hop home after step N - 1. The backward walks the other way
and ends at home (``source_back``), so its gradient accumulator's last hop
is issued before the last (home) tile. ``tie`` keeps XLA from merging a send that can
start early with one that must wait for a tile.

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

  def send_back(self, tree):
    """Every device's ``tree`` to the previous device (i -> i - 1): the
    backward's direction."""
    perm = [(i, (i - 1) % self.size) for i in range(self.size)]
    return lax.ppermute(tree, self.axes, perm)

  @staticmethod
  def tie(held, tree):
    """``(held, tree)`` unchanged, but ``tree`` now depends on ``held``.

    Call it with the shard a step received (``held``) and the accumulator
    it is about to send (``tree``). XLA's GPU pipeline combines independent
    collective-permutes below a size threshold into one transfer, which
    starts only when all its operands exist. Measured at N = 2,
    b = 8,192, D = 768 (H200, jax 0.11.2): the key shard's send, issued
    before the home tile, was combined with the send of that tile's column
    statistics, so the shard waited for the tile instead of overlapping it;
    in the backward the key gradient's send was combined with the column
    statistics the next tile needed, and ran synchronously before it. An
    optimization barrier over both makes the later send depend on the
    earlier transfer, so the two cannot be combined.
    """
    return lax.optimization_barrier((held, tree))

  def pass_on(self, send, sent, held, acc):
    """The transfers that open one ring step, issued before its tile; both
    families' steps, both directions, go through here.

    ``sent`` (the shard held, with whatever travels with it; None at a step
    that keeps its shard) goes on with ``send`` first and untied, so that it
    can start at once. A travelling accumulator ``acc`` (None: nothing
    travels) is then tied to ``held``, what this step's tile reads, and
    sent: its transfer waits for the held shard, so XLA cannot combine it
    with that shard's earlier one (``tie``).

    Returns:
      (held, acc_in, sent_next): the tile's (tied) input, the accumulator
      received (None without one), the shard received (None if kept).
    """
    sent_next = send(sent) if sent is not None else None
    acc_in = None
    if acc is not None:
      held, acc = self.tie(held, acc)
      acc_in = send(acc)
    return held, acc_in, sent_next

  def hop_home(self, acc):
    """After N - 1 steps the accumulator held here belongs to the next
    device's shard; one more hop takes every accumulator home."""
    return self.send(acc) if self.size > 1 else acc

  def psum(self, v):
    return lax.psum(v, self.axes) if self.axes else v

  def pmax(self, v):
    return lax.pmax(v, self.axes) if self.axes else v

  def source(self, n):
    """The device whose shard is held at step ``n``."""
    return (self.me - n) % self.size

  def run(self, state, step):
    """``state = step(n, state, last)`` for the ring steps n = 1 .. N - 1.

    The forward walks with ``send`` / ``source``, the backward with
    ``send_back`` / ``source_back``, which makes its last step the home
    tile (see ``losses.softmax``).

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

  def source_back(self, n):
    """The device whose shard the backward holds at step ``n``.

    The forward ended holding the shard of device me + 1 (its last step
    keeps it, with its complete column statistics), so the backward starts
    there without a transfer, walks the other way (``send_back``) and
    reaches the home shard at step N - 1. An accumulator travelling with the
    shards (the key gradient) then takes N - 1 hops instead of N, the last
    issued before the home tile (it overlaps it under the flags of
    ``infcl_jax.xla_flags``).
    """
    return (self.me + 1 + n) % self.size
