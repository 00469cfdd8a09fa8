"""Cross-device entry points of the CLIP loss.

``shard_local_loss`` is what ``contrastive_loss(..., axis_name=...)`` runs
inside ``jax.shard_map``: it checks the axis, maps the direction onto
(queries, keys) and picks the strategy (``ring.py`` or ``gather.py``).
``sharded_contrastive_loss`` takes globally sharded arrays and builds the
``shard_map`` for the caller.

Semantics of both: the loss equals the single-device ``contrastive_loss`` on
the global batch, i.e. the shards concatenated in axis order (the order in
which ``PartitionSpec(axis_name)`` lays them out). Positives are global
pairs (i, i); for a one-way direction with more keys than queries, device k
holds b_q queries and b_k keys and the positive of global query i is global
key i, wherever it lives.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from infcl_jax import _axes
from infcl_jax import _checks
from infcl_jax import gather
from infcl_jax import reference
from infcl_jax import ring
from infcl_jax import tile_backend

F32 = jnp.float32
STRATEGIES = ("ring", "gather")


def check_strategy(strategy):
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def shard_local_loss(x, y, scale, bias, *, axis_name, direction, strategy,
                     backend, block_sizes):
  """The global loss from this device's shards; call inside ``shard_map``.

  Args:
    x: (b_x, D) local image embeddings, y: (b_y, D) local text embeddings
      (already validated and cast to their common dtype).
    scale: scalar logit scale; bias: scalar logit bias or None.
    axis_name: axis name or tuple of names the batch is sharded over.
    direction, backend, block_sizes: as in ``contrastive_loss``.
    strategy: "ring" (O(b * D) memory, N ppermute steps) or "gather"
      (all-gather + reduce-scatter, O(B * D) memory).

  Returns:
    The global float32 loss, the same on every device. Gradients: see
    ``ring.py`` (each device gets dL/d(its shards); replicated parameters
    get the sum over devices).
  """
  axes = _axes.normalize(axis_name)
  _axes.axis_size(axes)  # A clear error for an unbound or unknown axis.
  check_strategy(strategy)
  if backend == "reference":
    return _reference_loss(x, y, scale, bias, axes, direction)
  name = tile_backend.resolve_name(backend)
  scale = _axes.to_varying(jnp.asarray(scale, F32), axes)
  bias = jnp.zeros((), F32) if bias is None else jnp.asarray(bias, F32)
  bias = _axes.to_varying(bias, axes)
  x, y = _axes.to_varying(x, axes), _axes.to_varying(y, axes)
  # text_to_image is image_to_text with the towers swapped: the texts are
  # the queries, the (at least as many) images the keys.
  if direction == "text_to_image":
    q, k, mode = y, x, "rows"
  else:
    q, k, mode = x, y, ("both" if direction == "both" else "rows")
  loss_fn = ring.ring_loss if strategy == "ring" else gather.gather_loss
  return loss_fn(q, k, scale, bias, name, mode, block_sizes, axes)


def _reference_loss(x, y, scale, bias, axes, direction):
  """Full-matrix loss on the gathered batch (O(B^2) memory; for testing).

  Every device computes the same loss from invariant (all-gathered) copies;
  the transpose of an invariant all_gather hands each device the gradient of
  its own slice, which is the convention of the tiled strategies.
  """
  xs = jax.lax.all_gather(x, axes, axis=0, tiled=True, to="invarying")
  ys = jax.lax.all_gather(y, axes, axis=0, tiled=True, to="invarying")
  return reference.contrastive_loss_reference(
      xs, ys, scale, logit_bias=bias, direction=direction).astype(F32)


def _spec_entry(axes):
  return axes[0] if len(axes) == 1 else axes


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "axis_name", "direction", "strategy", "backend",
                     "block_sizes"))
def sharded_contrastive_loss(image_emb, text_emb, logit_scale, *, mesh,
                             axis_name="data", logit_bias=None,
                             direction="both", strategy="ring",
                             backend="auto", block_sizes=None):
  """``contrastive_loss`` on globally sharded arrays, across the mesh.

  Shards the batch dimension of both embedding arrays over ``axis_name``
  (other mesh axes, e.g. "model", see replicated copies), runs the chosen
  cross-device strategy under ``jax.shard_map`` and returns the replicated
  scalar loss. The value equals ``contrastive_loss`` on the whole arrays,
  and ``jax.grad`` of it gives the ordinary gradients of the global arrays.

  Args:
    image_emb: (B_x, D) global image embeddings (any sharding; resharded
      over ``axis_name`` along the batch if needed).
    text_emb: (B_y, D) global text embeddings.
    logit_scale: scalar multiplier of the logits.
    mesh: the ``jax.sharding.Mesh``.
    axis_name: mesh axis name, or tuple of names, to shard the batch over.
    logit_bias, direction, backend, block_sizes: as in ``contrastive_loss``.
    strategy: "ring" (default) or "gather".

  Returns:
    The scalar float32 loss.

  Raises:
    ValueError: an axis name not in the mesh, or a global batch that the
      number of devices on the axis does not divide.
  """
  axes = _check_mesh_batch(mesh, axis_name, image_emb, text_emb)
  check_strategy(strategy)
  _checks.check_direction(direction, image_emb.shape[0], text_emb.shape[0])
  scale = _checks.check_scalar("logit_scale", logit_scale)
  bias = _checks.check_scalar("logit_bias", logit_bias, allow_none=True)

  from infcl_jax import api  # api imports this module.

  def local(x, y, s, *b):
    return api.contrastive_loss(
        x, y, s, logit_bias=b[0] if b else None, direction=direction,
        axis_name=axes if len(axes) > 1 else axes[0], strategy=strategy,
        backend=backend, block_sizes=block_sizes)

  return _run_sharded(local, mesh, axes, image_emb, text_emb, scale, bias)


def _check_mesh_batch(mesh, axis_name, image_emb, text_emb):
  """Validates the mesh axes and the batch split; returns the axis tuple."""
  axes = _axes.normalize(axis_name)
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(f"unknown axis name(s) {unknown} in axis_name="
                     f"{axis_name!r}; the mesh has axes {list(mesh.axis_names)}")
  _checks.check_embeddings(image_emb, text_emb)
  n_dev = math.prod(mesh.shape[a] for a in axes)
  for name, a in (("image_emb", image_emb), ("text_emb", text_emb)):
    if a.shape[0] % n_dev:
      raise ValueError(
          f"{name} has global batch {a.shape[0]} (shape {tuple(a.shape)}), "
          f"not divisible by the {n_dev} devices of axis_name={axis_name!r}; "
          "shard_map needs equal shards, so pad or drop rows")
  return axes


def _run_sharded(local, mesh, axes, image_emb, text_emb, scale, bias):
  """Shards the batch over ``axes`` and runs ``local`` under shard_map."""
  batch = P(_spec_entry(axes))
  x = jax.sharding.reshard(image_emb, NamedSharding(mesh, batch)) \
      if _explicit(mesh) else image_emb
  y = jax.sharding.reshard(text_emb, NamedSharding(mesh, batch)) \
      if _explicit(mesh) else text_emb
  args = (x, y, scale) + (() if bias is None else (bias,))
  in_specs = (batch, batch, P()) + (() if bias is None else (P(),))
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                       out_specs=P())(*args)


@functools.partial(
    jax.jit, static_argnames=("mesh", "axis_name", "backend", "block_sizes"))
def sharded_sigmoid_loss(image_emb, text_emb, logit_scale, logit_bias, *, mesh,
                         axis_name="data", backend="auto", block_sizes=None):
  """``sigmoid_loss`` on globally sharded arrays: the SigLIP ring for you.

  The value equals ``sigmoid_loss`` on the whole arrays; ``jax.grad`` of it
  gives the ordinary gradients of the global arrays. Arguments as in
  ``sharded_contrastive_loss`` and ``sigmoid_loss``.
  """
  axes = _check_mesh_batch(mesh, axis_name, image_emb, text_emb)
  _checks.check_equal_batch(image_emb, text_emb)
  scale = _checks.check_scalar("logit_scale", logit_scale)
  bias = _checks.check_scalar("logit_bias", logit_bias)

  from infcl_jax import sigmoid  # sigmoid imports the ring lazily too.

  def local(x, y, s, b):
    return sigmoid.sigmoid_loss(
        x, y, s, b, axis_name=axes if len(axes) > 1 else axes[0],
        backend=backend, block_sizes=block_sizes)

  return _run_sharded(local, mesh, axes, image_emb, text_emb, scale, bias)


def _explicit(mesh):
  """Whether any mesh axis is in JAX's Explicit sharding mode."""
  types = getattr(mesh, "axis_types", None) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)
