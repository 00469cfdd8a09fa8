"""The public losses: argument checks, then dispatch to a loss layer.

``contrastive_loss`` and ``sigmoid_loss`` take this device's arrays (the
whole batch, or with ``axis_name`` one shard inside ``jax.shard_map``);
``sharded_contrastive_loss`` and ``sharded_sigmoid_loss`` take globally
sharded arrays and build the ``shard_map`` themselves. Everything below this
module works on validated, cast arrays: ``losses/`` (one ``custom_vjp`` per
family for 1..N devices, plus the gather strategy) over ``backends/`` (the
tiles) over ``kernels/``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from infcl_jax import _axes
from infcl_jax import _checks
from infcl_jax import reference
from infcl_jax.backends import registry
from infcl_jax.losses import gather
from infcl_jax.losses import sigmoid as sigmoid_lib
from infcl_jax.losses import softmax as softmax_lib
from infcl_jax.losses import strategy as strategy_lib

F32 = jnp.float32

_AXIS_NAME_DOC = """\
axis_name: mesh axis name (or tuple) when called inside ``jax.shard_map``.
      The arrays are then this device's shards, and the loss is the global
      loss over the shards concatenated in axis order (positives: global
      pairs (i, i)POSITIVES), the same on every device. Each device's
      gradients are the exact partial derivatives of that global loss
      w.r.t. its own shards, so a replicated parameter's
      gradient is the SUM over devices, never the mean. Under
      ``check_vma=True`` (the default) JAX adds that sum itself, whether
      ``jax.grad`` is taken inside or outside the ``shard_map`` (do not
      ``psum`` again). Under ``check_vma=False``, take the gradient inside
      the ``shard_map`` and ``lax.psum`` the replicated parameters'
      gradients. Do NOT take ``jax.grad`` of a
      ``shard_map(..., check_vma=False)`` from outside it: JAX divides the
      cotangent of the unmapped loss by N there, so every gradient comes out
      N times too small, and the loss cannot detect it. See "Gradient
      convention" in the docs:
      https://github.com/infcl-jax/infcl-jax/blob/main/docs/losses.md#gradient-convention."""


_GROUPS_DOC = """\
groups: optional int group ids: one (B,) array when the batch is paired
      (B_x == B_y), or a pair (image_groups (B_x,), text_groups (B_y,));
      with ``axis_name``, this device's shard of them, like the embeddings.
      Image i and text j are *related* when their ids are equal (the other
      captions of an image, duplicate images). Any integer dtype: concrete
      ids beyond int32 (int64) are renumbered on the host, over both
      towers; traced ones of a wider dtype, and with ``axis_name`` any
      beyond int32, are a ValueError (give int32 ids there). Related pairs
      are handled by ``group_mode`` without any B x B array (ids are O(B)
      and travel with their shard, so a related pair may span devices).
    group_mode: "mask" (default) or "positives"; see each loss. Only with
      ``groups``."""



def backend_names() -> tuple[str, ...]:
  """Every accepted ``backend=``: "auto", "reference" (the full matrix) and
  the registered tiled backends, in registration order. Configs that pass a
  backend on (a trainer's, say) check against this, so that a newly
  registered backend needs no second list."""
  return _checks.backends()


# The accepted ``group_mode=`` values, and the loss families (``softmax``:
# ``contrastive_loss``; ``sigmoid``: ``sigmoid_loss``).
GROUP_MODES = _checks.GROUP_MODES
LOSS_FAMILIES = registry.FAMILIES

def _as_varying(axes, *arrays):
  """Casts replicated values to device-varying over ``axes`` (see _axes)."""
  return tuple(_axes.to_varying(a, axes) for a in arrays)


def _gathered(x, y, axes):
  """Invariant all-gathered copies of the shards (the "reference" backend
  across devices): the transpose of an invariant all_gather hands each
  device the gradient of its own slice, the tiled losses' convention."""
  if not axes:
    return x, y
  return (jax.lax.all_gather(x, axes, axis=0, tiled=True, to="invarying"),
          jax.lax.all_gather(y, axes, axis=0, tiled=True, to="invarying"))


def _n_queries_keys(direction, image_emb, text_emb):
  n_img, n_txt = image_emb.shape[0], text_emb.shape[0]
  return (n_txt, n_img) if direction == "text_to_image" else (n_img, n_txt)


# ------------------------------------------------------------ the spine
#
# Both families enter the same way: ``_checked`` (every argument check,
# once, outside jit, where concrete values can be read; the backend name
# resolved by the capability rule), then one jitted call (``_softmax`` /
# ``_sigmoid``) that casts the validated arrays, types them for shard_map
# and dispatches to the loss layer. The sharded entry points check the same
# way and call the same jitted functions inside their shard_map.


def _checked(family, image_emb, text_emb, logit_scale, logit_bias, *,
             bias_required, backend, block_sizes, precision):
  """The checks both families share; returns (scale, bias, backend name,
  the block sizes with ``precision`` in them)."""
  _checks.check_embeddings(image_emb, text_emb)
  _checks.check_backend(backend)
  _checks.check_block_sizes(block_sizes)
  block_sizes = _checks.with_precision(block_sizes, precision)
  scale = _checks.check_scalar("logit_scale", logit_scale)
  bias = _checks.check_scalar("logit_bias", logit_bias,
                              allow_none=not bias_required)
  name = backend if backend == "reference" else registry.resolve(backend,
                                                                 family)
  return scale, bias, name, block_sizes


def _checked_axes(axis_name):
  axes = _axes.normalize(axis_name)
  _axes.axis_size(axes)  # A clear error for an unbound or unknown axis.
  return axes


def _cast(image_emb, text_emb):
  """Both towers in their promoted dtype; float64 (under
  ``jax_enable_x64``) as float32, the widest dtype the losses compute in
  (the gradients come back in float64, through the cast)."""
  dtype = jnp.promote_types(image_emb.dtype, text_emb.dtype)
  if dtype == jnp.float64:
    dtype = jnp.dtype(F32)
  return image_emb.astype(dtype), text_emb.astype(dtype)


def contrastive_loss(image_emb, text_emb, logit_scale, *, logit_bias=None,
                     direction="both", labels=None, axis_name=None,
                     strategy="auto", backend="auto", block_sizes=None,
                     groups=None, group_mode="mask", precision=None):
  """Exact CLIP (softmax / InfoNCE) loss without the B x B logit matrix.

  Logits are ``s_ij = logit_scale * <image_emb_i, text_emb_j> + logit_bias``.
  The embeddings are used as given (normalize them first if you want cosine
  similarities) and ``logit_scale`` is the multiplier itself, not its log.

  Args:
    image_emb: (B_x, D) float16 / bfloat16 / float32 (float64, under
      ``jax_enable_x64``, is computed in float32; its gradients are float64).
    text_emb: (B_y, D), same D.
    logit_scale: scalar multiplier of the logits.
    logit_bias: optional scalar added to every logit.
    direction: "both" (CLIP: mean of the two cross-entropies, B_x == B_y),
      "image_to_text" (B_y >= B_x; the first B_x texts are the positives) or
      "text_to_image" (B_x >= B_y; the first B_y images are the positives).
    labels: one-way directions only: an int array with one entry per query
      (the image rows for "image_to_text", the text rows for
      "text_to_image"), the index of its positive among the *global* keys
      (with ``axis_name``, this device's queries' labels index the keys of
      all devices, concatenated in axis order). Repeats are allowed. Default:
      query i pairs with key i. Concrete out-of-range values raise a
      ValueError; traced ones (inside your ``jit``) give a NaN loss.
    AXIS_NAME
    GROUPS
      Softmax: "mask" leaves the related pairs other than a query's positive
      out of its log-sum-exp (false-negative masking; with all ids distinct
      and no ``labels`` it is the plain loss up to float rounding); with
      ``labels`` the labelled key stays the positive, related to its query
      or not. "positives" makes every related pair
      a positive: a query's term is its LSE minus the mean of its related
      logits (multi-positive InfoNCE, SupCon's L_out); it cannot take
      ``labels``, and a query with no related key gives a NaN loss. In a
      one-way direction only the queries' terms count, as without groups.
    strategy: with ``axis_name``: "ring" (ppermute ring, O(b * D) memory
      per device), "gather" (all-gather + reduce-scatter, O(B * D)) or
      "auto" (default): the gather while the global key batch is at most
      131,072, the ring above (measured on 2 H200s: see
      ``infcl_jax.losses.strategy``). Exact either way.
    backend: "auto", "reference" (full matrix, O(B^2)) or a registered tiled
      backend: "xla", "pallas", "mosaic" or "triton" ("auto" picks by
      platform: "mosaic" on Hopper, "triton" or "pallas" on other NVIDIA GPUs
      from sm80, "xla" elsewhere).
    block_sizes: optional ``BlockSizes`` for the tiled backends.
    PRECISION

  Returns:
    The scalar float32 loss. Gradients flow to the embeddings, the scale and
    the bias.
  """
  scale, bias, name, block_sizes = _checked(
      softmax_lib.FAMILY, image_emb, text_emb, logit_scale, logit_bias,
      bias_required=False, backend=backend, block_sizes=block_sizes,
      precision=precision)
  _checks.check_strategy(strategy)
  _checks.check_direction(direction, image_emb.shape[0], text_emb.shape[0],
                          labels=labels is not None)
  axes = _checked_axes(axis_name)
  n_q, n_k = _n_queries_keys(direction, image_emb, text_emb)
  labels = _checks.check_labels(labels, direction, n_q,
                                n_keys=None if axes else n_k)
  outside = _outside(groups, group_mode, labels)
  groups = _checks.check_groups(groups, group_mode, image_emb.shape[0],
                                text_emb.shape[0], labels=labels is not None,
                                sharded=bool(axes))
  return _softmax(image_emb, text_emb, scale, bias, labels, groups,
                  direction=direction, axes=axes, strategy=strategy,
                  backend=name, block_sizes=block_sizes,
                  group_mode=group_mode, outside=outside)


def _outside(groups, group_mode, labels):
  """Whether a query's positive may lie outside its group ("mask" with
  ``labels`` or a pair of id arrays): the loss then leaves each positive
  out of its tiles by index (``losses.softmax``). One id array without
  labels relates every positive pair (i, i)."""
  return (groups is not None and group_mode == "mask"
          and (labels is not None or isinstance(groups, (tuple, list))))


@functools.partial(
    jax.jit,
    static_argnames=("direction", "axes", "strategy", "backend",
                     "block_sizes", "group_mode", "outside"))
def _softmax(image_emb, text_emb, scale, bias, labels, groups, *, direction,
             axes, strategy, backend, block_sizes, group_mode="mask",
             outside=False):
  x, y = _cast(image_emb, text_emb)
  # The bias shifts every logit of a row (and of a column) alike, so it
  # cancels in every softmax: it is never added (a large one would only
  # cost float32 its digits) and its gradient is 0. Times 0 it still turns
  # a NaN or infinite bias into a NaN loss.
  bias_nan = jnp.zeros((), F32) if bias is None else 0.0 * jnp.asarray(
      bias, F32)
  if backend == "reference":
    xs, ys = _gathered(x, y, axes)
    ls, gs = _gathered_ids(labels, axes), _gathered_ids(groups, axes)
    return reference.contrastive_loss_reference(
        xs, ys, scale, direction=direction, labels=ls, groups=gs,
        group_mode=group_mode).astype(F32) + bias_nan
  scale, x, y = _as_varying(axes, jnp.asarray(scale, F32), x, y)
  (bias,) = _as_varying(axes, jnp.zeros((), F32))
  if labels is not None:
    (labels,) = _as_varying(axes, labels)
  if groups is not None:
    groups = _as_varying(axes, *groups)
  # text_to_image is image_to_text with the towers swapped: the texts are
  # the queries, the (at least as many) images the keys.
  if direction == "text_to_image":
    q, k, mode = y, x, "rows"
    groups = None if groups is None else groups[::-1]
  else:
    q, k, mode = x, y, ("both" if direction == "both" else "rows")
  # Softmax only: the column statistics make gathering the keys an
  # alternative to the ring (the sigmoid loss has nothing to gather for).
  strategy = strategy_lib.pick(strategy, _axes.axis_size(axes), k.shape[0])
  loss_fn = (gather.gather_loss if strategy == "gather" and axes
             else softmax_lib.softmax_loss)
  return loss_fn(q, k, scale, bias, labels, groups, backend, mode, group_mode,
                 block_sizes, axes, outside) + bias_nan


def sigmoid_loss(image_emb, text_emb, logit_scale, logit_bias, *,
                 axis_name=None, backend="auto", block_sizes=None,
                 groups=None, group_mode="mask", precision=None):
  """Exact SigLIP sigmoid loss without the B x B logit matrix.

  ``L = -(1/B) sum_ij log sigmoid(z_ij * s_ij)`` with
  ``s_ij = logit_scale * <image_emb_i, text_emb_j> + logit_bias``,
  ``z_ij = +1`` if ``i == j`` and ``-1`` otherwise, and B the global batch.
  The embeddings are used as given (normalize them first for cosine
  similarities) and ``logit_scale`` is the multiplier, not its log. SigLIP
  learns ``t'`` with ``logit_scale = exp(t')``, initialised at
  ``t' = log 10`` and ``logit_bias = -10`` (``infcl_jax.flax`` does this).

  Args:
    image_emb: (B, D) float16 / bfloat16 / float32 (float64 is computed in
      float32, as in ``contrastive_loss``).
    text_emb: (B, D), same B and D.
    logit_scale: scalar multiplier of the logits.
    logit_bias: scalar added to every logit (required: SigLIP learns it).
    AXIS_NAME
    GROUPS
      Sigmoid: "mask" leaves the related pairs other than (i, i) out of the
      sum (neither positive nor negative); "positives" gives every related
      pair the label z = +1. The sum stays normalised by B either way.
    backend: "auto", "reference" (full matrix, O(B^2) memory) or a
      registered tiled backend: "xla", "pallas", "mosaic" or "triton"
      ("auto" picks by platform: "mosaic" on Hopper, "triton" or "pallas"
      on other NVIDIA GPUs from sm80, "xla" elsewhere).
    block_sizes: optional ``BlockSizes`` for the tiled backends.
    PRECISION

  Returns:
    The scalar float32 loss. Gradients flow to the embeddings, the scale and
    the bias; each term is computed per element with the stable identity
    ``-log sigmoid(u) = max(-u, 0) + log1p(exp(-|u|))``.
  """
  scale, bias, name, block_sizes = _checked(
      sigmoid_lib.FAMILY, image_emb, text_emb, logit_scale, logit_bias,
      bias_required=True, backend=backend, block_sizes=block_sizes,
      precision=precision)
  # Sigmoid only: one positive per row and column, so equal batches.
  _checks.check_equal_batch(image_emb, text_emb, loss="sigmoid")
  axes = _checked_axes(axis_name)
  groups = _checks.check_groups(groups, group_mode, image_emb.shape[0],
                                text_emb.shape[0], sharded=bool(axes))
  return _sigmoid(image_emb, text_emb, scale, bias, groups, axes=axes,
                  backend=name, block_sizes=block_sizes,
                  group_mode=group_mode)


@functools.partial(jax.jit, static_argnames=("axes", "backend",
                                             "block_sizes", "group_mode"))
def _sigmoid(image_emb, text_emb, scale, bias, groups=None, *, axes, backend,
             block_sizes, group_mode="mask"):
  x, y = _cast(image_emb, text_emb)
  if backend == "reference":
    xs, ys = _gathered(x, y, axes)
    return reference.sigmoid_loss_reference(
        xs, ys, scale, bias, groups=_gathered_ids(groups, axes),
        group_mode=group_mode).astype(F32)
  scale, bias, x, y = _as_varying(axes, jnp.asarray(scale, F32),
                                  jnp.asarray(bias, F32), x, y)
  if groups is not None:
    groups = _as_varying(axes, *groups)
  return sigmoid_lib.sigmoid_loss(x, y, scale, bias, groups, backend,
                                  group_mode, block_sizes, axes)


def _gathered_ids(ids, axes):
  """Labels or group ids of all devices (the reference's global batch)."""
  if ids is None or not axes:
    return ids
  gather = lambda v: jax.lax.all_gather(v, axes, axis=0, tiled=True,
                                        to="invarying")
  return tuple(map(gather, ids)) if isinstance(ids, tuple) else gather(ids)


_PRECISION_DOC = """precision: float32 inputs only, the precision of the matmuls
      (as ``jax.lax.dot``'s): "default" (TF32 tensor cores; the positives
      put back in float32: the fastest, within 1e-3 of float64 on most
      inputs but not on a very confident model at small D and large
      scale), "high" (3-pass TF32: float32-accurate logits) or "highest"
      (IEEE float32, several times slower). None (the default): "highest"
      where ``jax.default_matmul_precision`` asks for "highest" or
      "float32"; else the backend's default: on the kernel backends
      ("pallas", "mosaic", "triton") "default" from D = 64 on and "high"
      below, "highest" on "xla" (``infcl_jax.backends.precision``). Off
      the GPU every precision computes exact float32. The same as
      ``BlockSizes(f32_precision=...)``; no effect on 16-bit inputs."""

# Softmax only: ``labels`` may say otherwise (the sigmoid loss takes none).
_POSITIVES = {contrastive_loss: " unless ``labels`` says otherwise",
              sigmoid_loss: ""}
for _f in (contrastive_loss, sigmoid_loss):  # pylint: disable=invalid-name
  _f.__doc__ = _f.__doc__.replace("AXIS_NAME", _AXIS_NAME_DOC).replace(
      "GROUPS", _GROUPS_DOC).replace("PRECISION", _PRECISION_DOC).replace(
          "POSITIVES", _POSITIVES[_f])


# ------------------------------------------------ globally sharded arrays


def _run_sharded(local, mesh, axes, image_emb, text_emb, scale, bias,
                 labels=None, groups=None):
  """Shards the batch over ``axes`` and runs ``local`` under shard_map, as
  ``local(x, y, scale, labels, bias, groups)`` (labels, bias and groups may
  be None; groups is a pair of arrays, sharded like the batch)."""
  batch = P(axes[0] if len(axes) == 1 else axes)
  if _explicit(mesh):
    on_batch = lambda v: jax.sharding.reshard(v, NamedSharding(mesh, batch))
    image_emb, text_emb = on_batch(image_emb), on_batch(text_emb)
    labels = None if labels is None else on_batch(labels)
    groups = None if groups is None else tuple(map(on_batch, groups))
  return jax.shard_map(
      local, mesh=mesh,
      in_specs=(batch, batch, P(), None if labels is None else batch,
                None if bias is None else P(),
                None if groups is None else (batch, batch)),
      out_specs=P())(image_emb, text_emb, scale, labels, bias, groups)


def _explicit(mesh):
  """Whether any mesh axis is in JAX's Explicit sharding mode."""
  types = getattr(mesh, "axis_types", None) or ()
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def sharded_contrastive_loss(image_emb, text_emb, logit_scale, *, mesh,
                             axis_name="data", logit_bias=None,
                             direction="both", labels=None, strategy="auto",
                             backend="auto", block_sizes=None, groups=None,
                             group_mode="mask", precision=None):
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
    logit_bias, direction, backend, block_sizes, precision: as in
      ``contrastive_loss``.
    labels: as in ``contrastive_loss``: one global key index per global
      query, sharded like the queries.
    groups, group_mode: as in ``contrastive_loss``, the global ids
      (sharded like the embeddings).
    strategy: "auto" (default), "ring" or "gather", as in
      ``contrastive_loss``.

  Returns:
    The scalar float32 loss.

  Raises:
    ValueError: an axis name not in the mesh, or a global batch that the
      number of devices on the axis does not divide.
  """
  scale, bias, name, block_sizes = _checked(
      softmax_lib.FAMILY, image_emb, text_emb, logit_scale, logit_bias,
      bias_required=False, backend=backend, block_sizes=block_sizes,
      precision=precision)
  _checks.check_strategy(strategy)
  axes = _checks.check_mesh_batch(mesh, axis_name, image_emb, text_emb)
  _checks.check_direction(direction, image_emb.shape[0], text_emb.shape[0],
                          labels=labels is not None)
  n_q, n_k = _n_queries_keys(direction, image_emb, text_emb)
  labels = _checks.check_labels(labels, direction, n_q, n_keys=n_k)
  outside = _outside(groups, group_mode, labels)
  groups = _checks.check_groups(groups, group_mode, image_emb.shape[0],
                                text_emb.shape[0], labels=labels is not None)
  return _sharded_softmax(
      image_emb, text_emb, scale, bias, labels, groups, mesh=mesh, axes=axes,
      direction=direction, strategy=strategy, backend=name,
      block_sizes=block_sizes, group_mode=group_mode, outside=outside)


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "axes", "direction", "strategy", "backend",
                     "block_sizes", "group_mode", "outside"))
def _sharded_softmax(image_emb, text_emb, scale, bias, labels, groups, *,
                     mesh, axes, direction, strategy, backend, block_sizes,
                     group_mode, outside=False):
  def local(x, y, s, lab, b, grp):
    return _softmax(x, y, s, b, lab, grp, direction=direction, axes=axes,
                    strategy=strategy, backend=backend,
                    block_sizes=block_sizes, group_mode=group_mode,
                    outside=outside)

  return _run_sharded(local, mesh, axes, image_emb, text_emb, scale, bias,
                      labels, groups)


def sharded_sigmoid_loss(image_emb, text_emb, logit_scale, logit_bias, *, mesh,
                         axis_name="data", backend="auto", block_sizes=None,
                         groups=None, group_mode="mask", precision=None):
  """``sigmoid_loss`` on globally sharded arrays: the SigLIP ring for you.

  The value equals ``sigmoid_loss`` on the whole arrays; ``jax.grad`` of it
  gives the ordinary gradients of the global arrays. Arguments as in
  ``sharded_contrastive_loss`` and ``sigmoid_loss``.
  """
  scale, bias, name, block_sizes = _checked(
      sigmoid_lib.FAMILY, image_emb, text_emb, logit_scale, logit_bias,
      bias_required=True, backend=backend, block_sizes=block_sizes,
      precision=precision)
  _checks.check_equal_batch(image_emb, text_emb, loss="sigmoid")
  axes = _checks.check_mesh_batch(mesh, axis_name, image_emb, text_emb)
  groups = _checks.check_groups(groups, group_mode, image_emb.shape[0],
                                text_emb.shape[0])
  return _sharded_sigmoid(image_emb, text_emb, scale, bias, groups, mesh=mesh,
                          axes=axes, backend=name, block_sizes=block_sizes,
                          group_mode=group_mode)


@functools.partial(
    jax.jit, static_argnames=("mesh", "axes", "backend", "block_sizes",
                              "group_mode"))
def _sharded_sigmoid(image_emb, text_emb, scale, bias, groups, *, mesh, axes,
                     backend, block_sizes, group_mode):
  def local(x, y, s, lab, b, grp):
    del lab
    return _sigmoid(x, y, s, b, grp, axes=axes, backend=backend,
                    block_sizes=block_sizes, group_mode=group_mode)

  return _run_sharded(local, mesh, axes, image_emb, text_emb, scale, bias,
                      groups=groups)
