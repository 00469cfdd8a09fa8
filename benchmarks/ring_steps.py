"""The jitted steps that ``bench_ring.py`` times, on a mesh of n devices.

Every step takes the global (sharded) image and text embeddings and the
logit scale and runs one fwd+bwd over the mesh axis "data":

* ``ring`` / ``gather``: the library's ``sharded_contrastive_loss`` with
  that strategy (value and the gradients of both embeddings and the scale).
* ``plain``: the baseline most CLIP code bases use (OpenCLIP's
  ``gather_with_grad=True, local_loss=True``): all-gather both towers with
  gradients, form this device's b x B logits of each direction fully in
  memory, cross-entropy with labels ``rank * b + arange(b)``.
* ``compute_only`` and ``transfer_only``: the ring's two halves apart, to
  check that the ring overlaps them (see ``overlap_steps``).

Inputs are generated on the devices, shard by shard in row chunks, so that
generating them does not raise the peak-memory counter above the step's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import sharded_contrastive_loss
from infcl_jax.backends import registry

F32 = jnp.float32
AXIS = "data"
STRATEGIES = ("ring", "gather", "plain")
LOGIT_SCALE = 20.0
_CHUNK = 4096


def make_mesh(n):
  """A 1-D mesh of the first n devices."""
  devices = jax.devices()
  if n > len(devices):
    raise ValueError(f"asked for {n} devices, {len(devices)} are visible")
  return Mesh(np.array(devices[:n]), (AXIS,))


def make_inputs(mesh, b_local, d, dtype, seed=0):
  """Two (n * b_local, d) arrays of ~unit rows, sharded over the mesh.

  Rows are N(0, 1/d) (norm ~1 without a normalization pass): logits then
  have the spread of cosine similarities, which keeps the Pallas kernels on
  their fast single-exponential path, as in training.
  """
  n = mesh.shape[AXIS]
  chunk = min(_CHUNK, b_local)
  while b_local % chunk:
    chunk //= 2

  def local(key):
    key = jax.random.fold_in(key, lax.axis_index(AXIS))

    def one(i):  # One chunk at a time: small temporaries.
      v = jax.random.normal(jax.random.fold_in(key, i), (chunk, d), F32)
      return (v * (1.0 / np.sqrt(d))).astype(dtype)
    return lax.map(one, jnp.arange(b_local // chunk)).reshape(b_local, d)

  gen = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(),
                              out_specs=P(AXIS), check_vma=False))
  # Raw uint32 keys: they pass through shard_map as ordinary arrays.
  out = [gen(jax.random.PRNGKey(seed * 2 + i)) for i in range(2)]
  return jax.block_until_ready(tuple(out))


def plain_local_loss(x, y, t):
  """The all-gather + full local rows loss; call inside shard_map over AXIS.

  ``lax.all_gather`` is differentiable (its transpose is a reduce-scatter),
  which is ``gather_with_grad``. Scaling convention: OpenCLIP's loss on a
  rank is the mean over its b local rows, and DDP averages the ranks'
  gradients; since the gathered copies carry every rank's gradient back
  home, each rank's gradient of its own loss is N x the gradient of the
  global loss, and DDP's 1/N cancels it. Here the returned value is the
  global loss itself (psum of the local means / N), so ``jax.grad`` gives
  the global gradient directly and the value equals the ring's.
  """
  n = lax.axis_size(AXIS)
  b = x.shape[0]
  xs = lax.all_gather(x, AXIS, axis=0, tiled=True)
  ys = lax.all_gather(y, AXIS, axis=0, tiled=True)
  labels = lax.axis_index(AXIS) * b + jnp.arange(b)

  def ce(q, keys):  # Mean cross-entropy of the local rows, (b, N b) logits.
    logits = t * jnp.dot(q, keys.T, preferred_element_type=F32)
    pos = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - pos)

  local = 0.5 * (ce(x, ys) + ce(y, xs))
  return lax.psum(local, AXIS) / n


def loss_fn(strategy, mesh, backend, block_sizes):
  """(x, y, t) -> the global loss, for one of STRATEGIES."""
  if strategy in ("ring", "gather"):
    return functools.partial(sharded_contrastive_loss, mesh=mesh,
                             axis_name=AXIS, strategy=strategy,
                             backend=backend, block_sizes=block_sizes)
  if strategy == "plain":
    return jax.shard_map(plain_local_loss, mesh=mesh,
                         in_specs=(P(AXIS), P(AXIS), P()), out_specs=P())
  raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def train_step(strategy, mesh, backend, block_sizes):
  """jit of (x, y, t) -> (loss, (dx, dy, dt))."""
  return jax.jit(jax.value_and_grad(
      loss_fn(strategy, mesh, backend, block_sizes), argnums=(0, 1, 2)))


def overlap_steps(mesh, backend, block_sizes):
  """The ring's compute and its transfers, each without the other.

  ``compute_only``: the tile work of one ring fwd+bwd on each device -- N
  ``lse`` tiles (b x b, rows and columns) merged as the ring merges them,
  then N ``lse_grad`` tiles with the global statistics, accumulating dq and
  a travelling dk -- with every ``ppermute`` replaced by a local roll of the
  same array by one row. The roll costs a copy of the array (small beside a
  tile) and keeps XLA from hoisting a loop-invariant tile out of the loop.

  ``transfer_only``: the ring's ``ppermute``s alone, same sizes and order:
  forward N-1 hops of the key shard (b x D) with its column statistics (b
  float32) plus the statistics' last hop home; backward N-1 hops of the key
  shard and its statistics with the float32 dk accumulator (b x D) plus the
  accumulator's last hop. No tile work.

  If the ring overlaps transfer with compute, t(ring) is near
  max(t(compute_only), t(transfer_only)) rather than their sum.

  Returns:
    {"compute_only": jit(x, y, t), "transfer_only": jit(x, y, t)}.
  """
  n = mesh.shape[AXIS]
  kernel = registry.get(registry.resolve(backend, "softmax"), "softmax")
  perm = [(i, (i + 1) % n) for i in range(n)]
  send = lambda a: lax.ppermute(a, AXIS, perm)
  hop = lambda a: jnp.roll(a, 1, axis=0)

  def compute(q, k, t):
    b = q.shape[0]
    scale, bias = t.astype(F32), jnp.zeros((), F32)
    w = 0.5 / (n * b)
    ninf = jnp.full((b,), -jnp.inf, F32)

    def fwd(carry, _):
      kc, r, c = carry
      row, col = kernel.lse(q, kc, scale, bias, rows=True, cols=True,
                            block_sizes=block_sizes)
      return (hop(kc), jnp.logaddexp(r, row), hop(jnp.logaddexp(c, col))), None
    (_, r, c), _ = lax.scan(fwd, (k, ninf, ninf), None, length=n)

    def bwd(carry, _):
      kc, cc, dq, dk = carry
      dq_t, dk_t, _, _ = kernel.lse_grad(q, kc, scale, bias, r, cc, w, w,
                                         block_sizes=block_sizes)
      return (hop(kc), hop(cc), dq + dq_t, hop(dk + dk_t)), None
    zeros = jnp.zeros(q.shape, F32)
    (_, _, dq, dk), _ = lax.scan(bwd, (k, c, zeros, zeros), None, length=n)
    return dq.astype(q.dtype), dk.astype(k.dtype)

  def transfer(q, k, t):
    del t
    b = q.shape[0]
    c = jnp.zeros((b,), F32)
    dk = jnp.zeros(k.shape, F32)

    def fwd(carry, _):
      return tuple(send(a) for a in carry), None
    (kc, c), _ = lax.scan(fwd, (k, c), None, length=n - 1)
    c = send(c)

    def bwd(carry, _):
      return tuple(send(a) for a in carry), None
    (kc, c, dk), _ = lax.scan(bwd, (kc, c, dk + q[:1].astype(F32)), None,
                              length=n - 1)
    dk = send(dk)
    return kc, dk.astype(k.dtype) + c[:, None].astype(k.dtype)

  def wrap(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P()),
                                 out_specs=(P(AXIS), P(AXIS)), check_vma=False))
  return {"compute_only": wrap(compute), "transfer_only": wrap(transfer)}
