"""Argument validation shared by every public loss.

Errors name the argument and its shape or dtype, so that a user who passes a
(B, D) tensor where (B, D) was expected for the *other* tower sees which one.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from infcl_jax import _axes
from infcl_jax.backends import registry
from infcl_jax.losses.strategy import STRATEGIES

DIRECTIONS = ("both", "image_to_text", "text_to_image")
_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def _dtype_of(a):
  return jnp.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype


def check_embeddings(image_emb, text_emb):
  """Checks rank, feature dim and dtype of the two embedding arrays.

  Returns:
    The promoted input dtype (float64, under ``jax_enable_x64``, is
    accepted and computed in float32).
  """
  for name, a in (("image_emb", image_emb), ("text_emb", text_emb)):
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if a.ndim != 2:
      raise ValueError(
          f"{name} must have rank 2 (batch, dim), got shape {tuple(a.shape)}")
    if a.dtype not in _FLOAT_DTYPES:
      raise TypeError(
          f"{name} must be float16, bfloat16, float32 or float64 (computed "
          f"in float32), got dtype {a.dtype} (shape {tuple(a.shape)})")
    if a.shape[0] < 1 or a.shape[1] < 1:
      raise ValueError(f"{name} must have a non-empty batch and dim, got "
                       f"shape {tuple(a.shape)}")
  if image_emb.shape[1] != text_emb.shape[1]:
    raise ValueError(
        "image_emb and text_emb must share the feature dimension D, got "
        f"image_emb {tuple(image_emb.shape)} and text_emb "
        f"{tuple(text_emb.shape)}")
  return jnp.promote_types(image_emb.dtype, text_emb.dtype)


def check_direction(direction, n_image, n_text, *, what="batch",
                    labels=False):
  """Checks the direction name and that the batch sizes fit it (with
  ``labels``, a one-way direction needs no more keys than queries)."""
  if direction not in DIRECTIONS:
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
  if direction == "both" and n_image != n_text:
    raise ValueError(
        f"direction='both' needs equal {what} sizes, got image_emb with "
        f"{n_image} rows and text_emb with {n_text} rows; use "
        "'image_to_text' (text may be longer) or 'text_to_image'")
  if direction == "image_to_text" and n_text < n_image and not labels:
    raise ValueError(
        f"direction='image_to_text' needs text_emb to have at least as many "
        f"rows as image_emb (positives are the first {n_image} texts), got "
        f"image_emb with {n_image} and text_emb with {n_text} rows")
  if direction == "text_to_image" and n_image < n_text and not labels:
    raise ValueError(
        f"direction='text_to_image' needs image_emb to have at least as many "
        f"rows as text_emb (positives are the first {n_text} images), got "
        f"image_emb with {n_image} and text_emb with {n_text} rows")


def check_labels(labels, direction, n_queries, *, n_keys=None, what="batch"):
  """Checks ``labels=``: one integer key index per query, one-way only.

  ``n_keys`` (the global number of keys) is used to check the values when
  they are concrete (not traced); traced values are checked by the loss,
  which turns an out-of-range label into a NaN loss.
  """
  if labels is None:
    return None
  if direction == "both":
    raise ValueError(
        "labels= needs direction='image_to_text' or 'text_to_image' (an "
        "arbitrary positive per query); direction='both' pairs i with i")
  queries = "image_emb" if direction == "image_to_text" else "text_emb"
  labels = _int_vector(labels, "labels", "key indices", n_queries,
                       f"one key index per query ({queries} has {n_queries} "
                       f"rows in this {what})")
  if n_keys is not None and not isinstance(labels, jax.core.Tracer):
    values = np.asarray(labels)
    bad = (values < 0) | (values >= n_keys)
    if bad.any():
      keys = "text_emb" if direction == "image_to_text" else "image_emb"
      raise ValueError(
          f"labels must index the {n_keys} rows of {keys}: got "
          f"{values[bad][0]} at position {int(np.argmax(bad))}")
  return _labels_int32(labels)


def _labels_int32(labels):
  """Key indices as int32. Where the dtype is wider, a value outside
  int32 becomes -1 rather than wrapping onto a valid index (2**32 + 3 is
  not key 3): out of range, as it was, so the loss is NaN."""
  if _fits_int32_dtype(labels.dtype):
    return jnp.asarray(labels).astype(jnp.int32)
  xp = jnp if isinstance(labels, jax.core.Tracer) else np
  labels = labels if xp is jnp else np.asarray(labels)
  inside = (labels >= 0) & (labels <= _I32.max)
  return jnp.asarray(xp.where(inside, labels, -1).astype(xp.int32))


def check_scalar(name, value, *, allow_none=False):
  """Checks that a scale or bias is a real scalar; returns it as an array."""
  if value is None:
    if allow_none:
      return None
    raise TypeError(f"{name} must be a scalar, got None")
  arr = value if isinstance(value, jax.Array) else np.asarray(value)
  if getattr(arr, "ndim", None) != 0:
    raise ValueError(
        f"{name} must be a scalar (shape ()), got shape {tuple(arr.shape)}")
  if jnp.issubdtype(arr.dtype, jnp.integer):
    arr = arr.astype(np.float32)  # An integer literal such as 10 is fine.
  elif not jnp.issubdtype(arr.dtype, jnp.floating):
    raise TypeError(f"{name} must be a real float scalar, got dtype {arr.dtype}")
  return jnp.asarray(arr)


def backends():
  """Every accepted ``backend=``: "auto", "reference" and the registered."""
  return ("auto", "reference") + registry.names()


def check_backend(backend):
  if backend not in backends():
    raise ValueError(f"backend must be one of {backends()}, got {backend!r}")


def check_block_sizes(block_sizes):
  """``block_sizes`` must be None or a ``BlockSizes`` (a static, hashable
  argument of the jitted loss: a dict would reach jit as an unhashable
  static argument)."""
  from infcl_jax.block_sizes import BlockSizes  # pylint: disable=import-outside-toplevel
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    hint = ""
    if isinstance(block_sizes, dict):
      hint = f": use infcl_jax.BlockSizes(**{block_sizes!r})"
    raise TypeError(
        f"block_sizes must be None or an infcl_jax.BlockSizes, got "
        f"{type(block_sizes).__name__}{hint}")


def with_precision(block_sizes, precision):
  """``block_sizes`` carrying the loss's ``precision=`` (float32 inputs:
  "default", "high" or "highest"; ``backends.precision``) as its
  ``f32_precision``; None when neither is given. Two different settings
  are one line."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import precision as precision_lib  # pylint: disable=import-outside-toplevel
  from infcl_jax.block_sizes import BlockSizes  # pylint: disable=import-outside-toplevel
  precision = precision_lib.canonical(precision)
  if precision is None:
    return block_sizes
  if block_sizes is None:
    return BlockSizes(f32_precision=precision)
  if block_sizes.f32_precision not in (None, precision):
    raise ValueError(
        f"precision={precision!r} and block_sizes.f32_precision="
        f"{block_sizes.f32_precision!r} disagree; give one of them")
  return dataclasses.replace(block_sizes, f32_precision=precision)


def check_strategy(strategy):
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def check_mesh_batch(mesh, axis_name, image_emb, text_emb):
  """Validates the mesh axes and the batch split; returns the axis tuple."""
  if getattr(mesh, "axis_names", None) is None:
    raise TypeError(
        f"mesh must be a jax.sharding.Mesh (the devices to shard the batch "
        f"over, e.g. Mesh(jax.devices(), ('data',))), got "
        f"{type(mesh).__name__}")
  axes = _axes.normalize(axis_name)
  if not axes:
    raise ValueError("axis_name must name a mesh axis, got None")
  unknown = [a for a in axes if a not in mesh.axis_names]
  if unknown:
    raise ValueError(f"unknown axis name(s) {unknown} in axis_name="
                     f"{axis_name!r}; the mesh has axes {list(mesh.axis_names)}")
  check_embeddings(image_emb, text_emb)
  n_dev = math.prod(mesh.shape[a] for a in axes)
  for name, a in (("image_emb", image_emb), ("text_emb", text_emb)):
    if a.shape[0] % n_dev:
      raise ValueError(
          f"{name} has global batch {a.shape[0]} (shape {tuple(a.shape)}), "
          f"not divisible by the {n_dev} devices of axis_name={axis_name!r}; "
          "shard_map needs equal shards, so pad or drop rows")
  return axes


def check_equal_batch(image_emb, text_emb, *, loss="sigmoid"):
  """Checks that both towers have the same batch size (one positive each)."""
  if image_emb.shape[0] != text_emb.shape[0]:
    raise ValueError(
        f"the {loss} loss needs equal batch sizes (image i pairs with text i), "
        f"got image_emb {tuple(image_emb.shape)} and text_emb "
        f"{tuple(text_emb.shape)}")


GROUP_MODES = ("mask", "positives")


def _int_vector(v, name, what, n, per):
  """``v`` as an integer array of shape (n,), or a one-line error: its
  elements are ``what``, one ``per`` (labels and group ids alike)."""
  if not hasattr(v, "shape") or not hasattr(v, "dtype"):
    v = np.asarray(v)
  if not jnp.issubdtype(v.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array ({what}), got dtype "
                    f"{v.dtype}")
  if tuple(v.shape) != (n,):
    raise ValueError(f"{name} must have shape ({n},), {per}, got shape "
                     f"{tuple(v.shape)}")
  return v


_I32 = np.iinfo(np.int32)


def _fits_int32_dtype(dtype):
  """Whether every value of integer ``dtype`` is an int32 value."""
  info = np.iinfo(dtype)
  return info.min >= _I32.min and info.max <= _I32.max


def _readable(v):
  """Whether ``v``'s values can be read on the host now: a NumPy array or a
  concrete, fully addressable ``jax.Array`` (not a tracer, not another
  process's shards)."""
  if isinstance(v, jax.core.Tracer):
    return False
  return not isinstance(v, jax.Array) or v.is_fully_addressable


def _fits_int32(v):
  """Whether the ids ``v`` are int32 values: by dtype, else by value
  (read on the host, or reduced on the devices for another process's
  shards). None when they cannot be read (traced)."""
  if _fits_int32_dtype(v.dtype):
    return True
  if isinstance(v, jax.core.Tracer):
    return None
  if v.size == 0:
    return True
  if _readable(v):
    a = np.asarray(v)
    return bool(a.min() >= _I32.min and a.max() <= _I32.max)
  return bool(jnp.min(v) >= _I32.min) and bool(jnp.max(v) <= _I32.max)


def _dense_ids(arrays):
  """The concrete ids ``arrays`` as dense int32 ids 0..K-1 (NumPy), one
  numbering over all of them: equal ids stay equal, across the arrays too,
  and distinct ones stay distinct."""
  values = [np.asarray(a) for a in arrays]
  common = np.result_type(*values)
  if common.kind not in "iu":  # int64 with uint64: NumPy would use floats.
    common = np.dtype(object)
  joined = np.concatenate([v.astype(common).ravel() for v in values])
  _, dense = np.unique(joined, return_inverse=True)
  dense = dense.astype(np.int32)
  return tuple(np.split(dense, np.cumsum([v.size for v in values])[:-1]))


def _group_ids(arrays, names, *, sharded):
  """Group id arrays (already shape-checked) as int32 arrays with the same
  relation: cast where every id is an int32 value; else concrete ids are
  renumbered on the host over all arrays (``_dense_ids``), and ids that
  cannot be renumbered (traced, or one device's shard) are one error."""
  # uint32 ids cast to int32 wrap (2**32 - 1 -> -1): one-to-one as long
  # as no signed id of the other tower can meet a wrapped one.
  all_u32 = all(jnp.dtype(a.dtype) == jnp.uint32 for a in arrays)
  if all_u32 or all(_fits_int32(a) for a in arrays):
    return tuple(jnp.asarray(a).astype(jnp.int32) for a in arrays)
  where = " and ".join(f"{n} ({a.dtype})" for n, a in zip(names, arrays))
  if sharded:
    raise ValueError(
        f"{where} with axis_name: ids beyond int32 (or traced ones of a "
        "wider dtype) cannot be renumbered on one device's shard alone "
        "(equal ids on two devices must stay equal); give int32 ids (e.g. "
        "np.unique(ids, return_inverse=True) over the global batch), or "
        "the global ids to sharded_contrastive_loss / sharded_sigmoid_loss")
  if not all(map(_readable, arrays)):
    raise ValueError(
        f"{where}: ids of a dtype wider than int32 cannot be read here "
        "(traced inside jit, or another process's shards), and casting "
        "them to int32 could merge groups; pass them as a NumPy array, or "
        "as int32 ids (e.g. np.unique(ids, return_inverse=True))")
  return tuple(jnp.asarray(d) for d in _dense_ids(arrays))


def check_groups(groups, group_mode, n_x, n_y, *, labels=False,
                 sharded=False):
  """Checks ``groups=`` / ``group_mode=``; returns None or the (image,
  text) int32 group ids.

  One array when the batch is paired (n_x == n_y), else a pair
  (image_groups, text_groups). Ids of any integer dtype keep their
  relation (equal ids related, distinct ones not): ids that are all int32
  values are cast; other concrete ids (int64 beyond int32) are renumbered
  on the host, over both towers at once. Ids that cannot be renumbered
  here give one ValueError: traced ones of a dtype wider than int32, and
  with ``sharded`` (``axis_name``: one device's shard) any beyond int32.
  """
  if group_mode not in GROUP_MODES:
    raise ValueError(f"group_mode must be one of {GROUP_MODES}, got "
                     f"{group_mode!r}")
  if groups is None:
    if group_mode != "mask":
      raise ValueError(f"group_mode={group_mode!r} needs groups= (the group "
                       f"id of each row)")
    return None
  if labels and group_mode == "positives":
    raise ValueError(
        "groups with group_mode='positives' define every query's positives; "
        "labels= cannot be combined with it (use group_mode='mask', which "
        "keeps each query's labelled positive)")
  if isinstance(groups, (tuple, list)):
    if len(groups) != 2:
      raise ValueError(f"groups must be one array or a pair (image_groups, "
                       f"text_groups), got a sequence of {len(groups)}")
    arrays = (_int_vector(groups[0], "image groups", "group ids", n_x,
                          "one group id per row of image_emb"),
              _int_vector(groups[1], "text groups", "group ids", n_y,
                          "one group id per row of text_emb"))
    return _group_ids(arrays, ("image groups", "text groups"),
                      sharded=sharded)
  if n_x != n_y:
    raise ValueError(
        f"groups as one array needs a paired batch (image_emb and text_emb "
        f"with equal rows, got {n_x} and {n_y}); pass (image_groups, "
        f"text_groups)")
  g = _int_vector(groups, "groups", "group ids", n_x,
                  "one group id per row of image_emb")
  (g,) = _group_ids((g,), ("groups",), sharded=sharded)
  return g, g
