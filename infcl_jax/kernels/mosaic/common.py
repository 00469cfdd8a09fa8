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

import functools
import math
import os

import jax
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


def check_groups(groups, x, y, *, rows="R"):
  """``groups`` (None or the int32 ids of x's and y's padded rows) must have
  one id per row; ``rows`` names x's padded row count in the error."""
  if groups is not None and (groups[0].shape != (x.shape[0],)
                             or groups[1].shape != (y.shape[0],)):
    raise ValueError(
        f"groups must be (({rows},), (m_pad,)) = (({x.shape[0]},), "
        f"({y.shape[0]},)), got {groups[0].shape}, {groups[1].shape}")


# The Mosaic GPU interpreter runs each CTA's warpgroups, and the producer's
# warps (``warp_map``), as Python threads. A simulated barrier wait blocks
# inside an XLA:CPU host callback, and XLA:CPU runs a program's independent
# operations, callbacks included, on its own thread pool (``PJRT_NPROC``
# threads, by default one per core). Once every pool thread holds such a
# wait, the arrivals that would release them queue behind them and the call
# never returns: with 2 pool threads (a 2-core machine) ``jit(grad)`` of a
# bf16 ``backend="mosaic"`` loss hung in about half the runs at B = 8,
# with 4 or more it never did, and the kernels' barrier protocol passed the
# interpreter's race detector at the GPU's tile sizes. The interpreter runs
# one CTA at a time; a device holds at most its three warpgroups, four
# producer warps and the kernel's own callback, and one pool thread must
# stay free.
INTERPRETER_THREADS_PER_DEVICE = NUM_CONSUMERS + 1 + 4 + 1


def cpu_pool_threads():
  """XLA:CPU's thread pool size as the runtime picks it: ``PJRT_NPROC``,
  else ``NPROC``, else the cores this process may run on."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name, "").strip()
    if value.isdigit():
      return int(value)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # Not Linux.
    return os.cpu_count() or 1


def interpreter_threads_needed():
  """Pool threads the interpreter needs for one kernel call: every device
  of the enclosing ``shard_map`` mesh (1 outside one) interprets its own."""
  mesh = jax.sharding.get_abstract_mesh()
  devices = 1 if mesh.empty else math.prod(mesh.axis_sizes)
  return devices * INTERPRETER_THREADS_PER_DEVICE + 1


def check_interpreter_threads():
  """Refuses, in one line, an interpreted kernel that could hang (see
  ``INTERPRETER_THREADS_PER_DEVICE``)."""
  need, have = interpreter_threads_needed(), cpu_pool_threads()
  if have < need:
    raise RuntimeError(
        f"infcl_jax: backend='mosaic' off the GPU runs the Mosaic GPU "
        f"interpreter, which needs {need} XLA:CPU pool threads here and this "
        f"process has {have}, so it could hang; set PJRT_NPROC={need} (or "
        f"more) before jax starts, or use backend='pallas' or 'xla' on CPU")


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


def my_count(pid, total, nprog):
  """How many of ``total`` round-robin work items CTA ``pid`` of ``nprog``
  owns (items pid, pid + nprog, ...)."""
  return lax.div(total - pid + nprog - 1, nprog)


def tile_coords(pid, u, nprog, ni):
  """(row block, column block) of CTA ``pid``'s u-th tile of a grid with
  ``ni`` row blocks, row blocks fastest (CTAs running together share a y
  tile; the x panel stays in L2)."""
  tile = pid + u * nprog
  return lax.rem(tile, ni), lax.div(tile, ni)


# Registers per thread: the consumers hold a (128, 128) float32 accumulator
# and the epilogue's temporaries; the producer only issues copies.
COMPUTE_REGS = 232
MEMORY_REGS = 40


def persistent_tiles(num_tiles, nprog, ni):
  """This CTA's share of a persistent grid of ``num_tiles`` tiles with
  ``ni`` row blocks: (its program id, how many tiles it owns, ``coords(u)``
  of its u-th tile, from ``tile_coords``)."""
  pid = lax.axis_index("p")
  return (pid, my_count(pid, num_tiles, nprog),
          lambda u: tile_coords(pid, u, nprog, ni))


def specialize(consumer, x_ref, y_ref, x_smem, y_smem, x_full, y_full,
               consumed, **producer_kw):
  """The CTA's warpgroups at work: warpgroup NUM_CONSUMERS runs ``producer``
  (``producer_kw``: its keyword arguments) with few registers, and
  warpgroups 0 .. NUM_CONSUMERS - 1 run ``consumer(wg)`` with the registers
  the producer gives up."""
  wg = lax.axis_index("wg")

  @pl.when(wg == NUM_CONSUMERS)
  def _producer():
    plgpu.set_max_registers(MEMORY_REGS, action="decrease")
    producer(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed,
             **producer_kw)

  @pl.when(wg < NUM_CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(COMPUTE_REGS, action="increase")
    consumer(wg)


def producer(x_ref, y_ref, x_smem, y_smem, x_full, y_full, consumed, *,
             coords, num_tiles, nd, bq, bk, bd, stages, split_rings):
  """The memory warpgroup: TMA copies for ``num_tiles`` tiles of nd chunks.

  ``coords(u)`` maps this program's u-th tile to its (row block, column
  block); chunk k of tile u is ring step u * nd + k, in slot step % stages.

  Shared ring: one stream of (bq, bd) x and (2 * bk, bd) y chunks that both
  consumers read. Split rings (``split_rings``): warp w of the warpgroup
  feeds consumer w's own ring (slots w * stages + s) with the x chunk and
  consumer w's (bk, bd) half of y. x is then fetched once per consumer (4/3
  of the L2 -> SMEM traffic per tile pair), but the consumers are no longer
  tied through shared slots: one can run its wgmmas while the other runs
  its epilogue.
  """
  total = num_tiles * nd

  def stream(warp):
    """The copies of one ring: the shared one (``warp`` None) or consumer
    ``warp``'s own."""
    def slot(g):
      s = lax.rem(g, stages)
      return s if warp is None else warp * stages + s

    @pl.loop(0, total)
    def _(g):
      b = slot(g)
      rb, cb = coords(lax.div(g, nd))
      k = lax.rem(g, nd)

      @pl.when(g >= stages)
      def _():
        plgpu.barrier_wait(consumed.at[b])

      plgpu.copy_gmem_to_smem(
          x_ref.at[pl.ds(rb * bq, bq), pl.ds(k * bd, bd)], x_smem.at[b],
          x_full.at[b])
      if warp is None:
        y_rows = pl.ds(cb * (NUM_CONSUMERS * bk), NUM_CONSUMERS * bk)
      else:
        y_rows = pl.ds(cb * (NUM_CONSUMERS * bk) + warp * bk, bk)
      plgpu.copy_gmem_to_smem(y_ref.at[y_rows, pl.ds(k * bd, bd)],
                              y_smem.at[b], y_full.at[b])

    # Drain: observe the consumers' release of the last slots, so that no
    # barrier completes unobserved (the interpreter checks this) and the CTA
    # does not retire with copies still being read.
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _(g):
      plgpu.barrier_wait(consumed.at[slot(g)])

  if not split_rings:
    stream(None)
    return

  @plgpu.warp_map
  def _(warp):
    @pl.when(warp < NUM_CONSUMERS)
    def _():
      stream(warp)


def mma_tile(x_smem, y_smem, x_full, y_full, consumed, *, g0, nd, wg, bq, bk,
             stages, split_rings=False):
  """One consumer's (bq, bk) float32 tile over nd chunks from ring step g0.

  ``split_rings``: the consumer's own ring (``producer``), slots
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

  def __init__(self, turn, wg):
    self.turn, self.wg = turn, wg

  def wait(self, k):
    @pl.when((self.wg != 0) | (k != 0))
    def _():
      plgpu.barrier_wait(self.turn.at[self.wg])

  def done(self):
    plgpu.barrier_arrive(self.turn.at[1 - self.wg])

  def drain(self, num_tiles):
    """Consumer 0 observes consumer 1's last arrival."""
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


def _x32(body):
  """``body`` traced with ``jax_enable_x64`` off (its operands are never
  64-bit: the backends cast to float32 / int32 first)."""
  @functools.wraps(body)
  def run(*args, **kwargs):
    with jax.enable_x64(False):
      return body(*args, **kwargs)
  return run


def launch(body, *, operands, out_type, scratch, nprog, name, interpret,
           split_rings, reduction_scratch_bytes=None):
  """Runs ``body`` as a persistent kernel of ``nprog`` CTAs of three
  warpgroups (two consumers and the producer), on ``operands``; returns its
  outputs (a list) typed device-varying like the operands. ``body`` is
  traced with x64 off: its index arithmetic (program ids, loop counters,
  Python int constants) is int32 by construction, as with x64 off."""
  params = interpret_params(interpret)
  if params is not None:
    check_interpreter_threads()
  cp = dict(approx_math=True)
  if reduction_scratch_bytes is not None:
    cp["reduction_scratch_bytes"] = reduction_scratch_bytes
  outs = plgpu.kernel(
      _x32(body),
      out_type=out_type,
      scratch_types=scratch,
      grid=(nprog,),
      grid_names=("p",),
      num_threads=NUM_CONSUMERS + 1,
      thread_name="wg",
      kernel_name=name,
      compiler_params=plgpu.CompilerParams(**cp),
      interpret=params,
  )(*kernel_operands(split_rings, *operands))
  return vary_like(list(outs), *operands)
