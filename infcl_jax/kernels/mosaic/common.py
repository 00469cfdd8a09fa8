"""What the Mosaic GPU kernels share: the TMA/wgmma tile layout,
the producer (memory warpgroup) loop, and the interpret switch.

All kernels here use the same structure (one CTA = three warpgroups):

* warpgroup 2, the *producer*, issues TMA copies of (block_q, block_d) chunks
  of x and (2 * block_k, block_d) chunks of y into a ring of ``num_stages``
  shared-memory slots, each completing on its own "full" barrier, and waits on
  a "consumed" barrier before it overwrites a slot;
* warpgroups 0 and 1, the *consumers*, each own one half of the y chunk
  (block_k columns): they wait for a slot, issue ``wgmma`` into a float32
  (block_q, block_k) accumulator, and release the slot (both consumers arrive
  on the consumed barrier) once their wgmma on it has completed.

The step sequence (row block, column block, D chunk) is computed identically
by the producer and the consumers, so the ring needs no other handshake.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from infcl_jax import _axes

F32 = jnp.float32
NUM_CONSUMERS = 2
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def smem_transforms(dtype, block_d):
  """Tiling + swizzle for a (rows, block_d) TMA / wgmma operand tile."""
  swizzle = plgpu.find_swizzle(block_d * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def check_inputs(x, y, block_q, block_k, block_d):
  if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES or x.dtype != y.dtype:
    raise ValueError(f"mosaic kernels take bf16 / f16 inputs of one dtype, "
                     f"got {x.dtype} and {y.dtype}")
  n_pad, d_pad = x.shape
  m_pad, d2 = y.shape
  if d2 != d_pad:
    raise ValueError(f"x and y disagree on D: {x.shape} vs {y.shape}")
  if block_q % 64 or block_k % 64 or block_d % 64:
    raise ValueError("block_q, block_k and block_d must be multiples of 64")
  if n_pad % block_q or m_pad % (NUM_CONSUMERS * block_k) or d_pad % block_d:
    raise ValueError(
        f"padded shapes x {x.shape}, y {y.shape} must be multiples of "
        f"block_q={block_q}, {NUM_CONSUMERS}*block_k={NUM_CONSUMERS * block_k}"
        f", block_d={block_d}")


def interpret_params(interpret):
  """``interpret`` argument of plgpu.kernel: None (compile) or the params."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  if interpret is False or interpret is None:
    return None
  return interpret


def vary_like(outs, *ins):
  """Types kernel outputs device-varying like their inputs inside shard_map.

  ``plgpu.kernel`` traces its body with the varying-axes check off and
  returns outputs typed as invariant over every mesh axis, even when its
  inputs vary (a ring shard). Left so, JAX would treat a per-device result
  as replicated (e.g. fold a ``psum`` of it into a multiplication). The cast
  moves no data; outside shard_map it is a no-op.
  """
  return _axes.vary_like(outs, *ins)


def kernel_operands(warp_map, *arrays):
  """A kernel's operands: inside ``shard_map``, a kernel with per-warp code
  (``warp_map``: the split rings' producer) takes them typed replicated
  (``_axes.drop_varying``: its ``mpmd_map`` refuses device-varying refs);
  its outputs are re-typed by ``vary_like`` from the originals."""
  return _axes.drop_varying(*arrays) if warp_map else arrays


def align_smem(nbytes, alignment=1024):
  """Rounds an SMEM byte count up to Mosaic GPU's allocation alignment."""
  return -(-nbytes // alignment) * alignment


_FLOOR = -1e30


def safe(m):
  """A max usable as a shift: -inf (a fully masked row / column) becomes a
  large finite negative number, so that -inf - shift = -inf (exp2 -> 0) and
  never NaN. A max instead of a select: Mosaic GPU has no implicit scalar
  broadcast in selects."""
  return jnp.maximum(m, _FLOOR)


def logaddexp2(a, b):
  """log2(2^a + 2^b), exact for -inf operands."""
  mx = jnp.maximum(a, b)
  mn = jnp.minimum(a, b)
  sh = safe(mx)
  return sh + jnp.log2(jnp.exp2(mx - sh) + jnp.exp2(mn - sh))


def producer(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed, *,
             coords, num_tiles, nd, bq, bk2, bd, stages):
  """The memory warpgroup: TMA copies for ``num_tiles`` tiles of nd chunks.

  ``coords(u)`` maps this program's u-th tile to its (row block, column
  block); chunk k of tile u is ring step u * nd + k, in slot step % stages.
  """
  total = num_tiles * nd

  @pl.loop(0, total)
  def _(g):
    slot = lax.rem(g, stages)
    rb, cb = coords(lax.div(g, nd))
    k = lax.rem(g, nd)

    @pl.when(g >= stages)
    def _():
      plgpu.barrier_wait(consumed.at[slot])

    plgpu.copy_gmem_to_smem(
        x_ref.at[pl.ds(rb * bq, bq), pl.ds(k * bd, bd)], x_smem.at[slot],
        x_full.at[slot])
    plgpu.copy_gmem_to_smem(
        y_ref.at[pl.ds(cb * bk2, bk2), pl.ds(k * bd, bd)], y_smem.at[slot],
        y_full.at[slot])

  # Drain: observe the consumers' release of the last slots, so that no
  # barrier completes unobserved (the interpreter checks this) and the CTA
  # does not retire with copies still being read.
  @pl.loop(jnp.maximum(total - stages, 0), total)
  def _(g):
    plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])


def producer_split(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed, *,
                   coords, num_tiles, nd, bq, bk, bd, stages):
  """The memory warpgroup for per-consumer rings (``rings="split"``).

  Warp w of the memory warpgroup feeds consumer w's own ring of ``stages``
  slots (slot index w * stages + s): the (bq, bd) x chunk and consumer w's
  (bk, bd) half of the y chunk. The x chunk is fetched once per consumer
  (L2 -> SMEM traffic per tile pair 4/3 of the shared ring's), but the two
  consumers are no longer tied to each other through the slots they share:
  one can run its wgmmas while the other runs its epilogue, as far ahead as
  it likes.
  """
  total = num_tiles * nd

  @plgpu.warp_map
  def _(warp):
    @pl.when(warp < NUM_CONSUMERS)
    def _():
      @pl.loop(0, total)
      def _(g):
        b = warp * stages + lax.rem(g, stages)
        rb, cb = coords(lax.div(g, nd))
        k = lax.rem(g, nd)

        @pl.when(g >= stages)
        def _():
          plgpu.barrier_wait(consumed.at[b])

        plgpu.copy_gmem_to_smem(
            x_ref.at[pl.ds(rb * bq, bq), pl.ds(k * bd, bd)], x_smem.at[b],
            x_full.at[b])
        plgpu.copy_gmem_to_smem(
            y_ref.at[pl.ds(cb * (NUM_CONSUMERS * bk) + warp * bk, bk),
                     pl.ds(k * bd, bd)],
            y_smem.at[b], y_full.at[b])

      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _(g):
        plgpu.barrier_wait(consumed.at[warp * stages + lax.rem(g, stages)])


def mma_tile(x_smem, y_smem, x_full, y_full, consumed, *, g0, nd, wg, bq, bk,
             stages, split_rings=False):
  """One consumer's (bq, bk) float32 tile over nd chunks from ring step g0.

  ``split_rings``: the consumer's own ring (``producer_split``), slots
  wg * stages + s holding its (bk, bd) y half; else the shared ring."""

  def slot_of(g):
    s = lax.rem(g, stages)
    return wg * stages + s if split_rings else s

  def body(acc_ref):
    def step(k, c):
      g = g0 + k
      slot = slot_of(g)
      plgpu.barrier_wait(x_full.at[slot])
      plgpu.barrier_wait(y_full.at[slot])
      y_tile = (y_smem.at[slot] if split_rings
                else y_smem.at[slot, pl.ds(wg * bk, bk)])
      plgpu.wgmma(acc_ref, x_smem.at[slot], y_tile.transpose((1, 0)))
      plgpu.wgmma_wait(1)

      @pl.when(k > 0)
      def _():
        plgpu.barrier_arrive(consumed.at[slot_of(g - 1)])
      return c

    lax.fori_loop(0, nd, step, 0)
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(consumed.at[slot_of(g0 + nd - 1)])
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC((bq, bk), F32))


class Turns:
  """Strict alternation of the two consumers' epilogues (a ping-pong).

  Consumer w waits on ``turn[w]`` before its epilogue of tile k (except
  consumer 0 at k = 0) and arrives on ``turn[1 - w]`` after it. Two reasons:

  * correctness: Mosaic GPU's cross-warp reductions (axis 0 of a wgmma
    tile: the column statistics) use one shared-memory scratch buffer at
    the same offset for every warpgroup; two consumers reducing at once
    would race on it;
  * speed: while one consumer runs its epilogue (exponentials, reductions,
    stores), the other issues its wgmmas, so the tensor cores stay busy.
  """

  def __init__(self, turn, wg, enabled):
    self.turn, self.wg, self.enabled = turn, wg, enabled

  def wait(self, k):
    if not self.enabled:
      return

    @pl.when((self.wg != 0) | (k != 0))
    def _():
      plgpu.barrier_wait(self.turn.at[self.wg])

  def done(self):
    if self.enabled:
      plgpu.barrier_arrive(self.turn.at[1 - self.wg])

  def drain(self, num_tiles):
    """Consumer 0 observes consumer 1's last arrival."""
    if not self.enabled:
      return

    @pl.when((self.wg == 0) & (num_tiles > 0))
    def _():
      plgpu.barrier_wait(self.turn.at[0])


def turn_barrier():
  return plgpu.Barrier(num_arrivals=1, num_barriers=NUM_CONSUMERS)


def ring_scratch(dtype, *, bq, bk, bd, stages, split_rings):
  """SMEM ring + its full / consumed barriers, shared or per consumer.

  Shared: (stages, bq, bd) x and (stages, 2 bk, bd) y slots, consumed by
  both consumers. Split: NUM_CONSUMERS * stages slots of (bq, bd) x and
  (bk, bd) y, each consumed by one consumer."""
  tr = smem_transforms(dtype, bd)
  if split_rings:
    n = NUM_CONSUMERS * stages
    return [
        plgpu.SMEM((n, bq, bd), dtype, transforms=tr),
        plgpu.SMEM((n, bk, bd), dtype, transforms=tr),
        plgpu.Barrier(num_arrivals=1, num_barriers=n),
        plgpu.Barrier(num_arrivals=1, num_barriers=n),
        plgpu.Barrier(num_arrivals=1, num_barriers=n),
    ]
  return [
      plgpu.SMEM((stages, bq, bd), dtype, transforms=tr),
      plgpu.SMEM((stages, NUM_CONSUMERS * bk, bd), dtype, transforms=tr),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
  ]
