"""Named mesh axes: checking them, and typing values across them.

A loss called with ``axis_name`` runs inside ``jax.shard_map``: every array
it sees is one device's shard, and the axis (or tuple of axes, linearised in
mesh order the way ``PartitionSpec(("a", "b"))`` shards) names the devices
the global batch is split over. A single-device loss is the same code with
no axes: ``axes == ()``.

Inside ``shard_map`` JAX types every value as varying or not over each mesh
axis (``check_vma=True``, the default). A loop carry started from a constant
must get the inputs' varying axes, or ``lax.scan`` rejects it
(``vary_like``), and a ``pallas_call`` needs its outputs' varying axes
(``out_struct``). Both are no-ops outside ``shard_map``.
"""
from __future__ import annotations

import jax
from jax import lax


def normalize(axis_name):
  """``axis_name`` as a tuple of axis names; ``None`` means no axis, ``()``."""
  if axis_name is None:
    return ()
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not axes:
    raise ValueError("axis_name must be an axis name or a non-empty tuple of "
                     "axis names, got ()")
  if len(set(axes)) != len(axes):
    raise ValueError(f"axis_name repeats an axis: {axis_name!r}")
  return axes


def _bound_axis_names():
  """The axis names bound here, or None when JAX does not tell us."""
  try:
    from jax._src import core  # Private: only used to word an error.
    return tuple(core.get_axis_env().axis_names())
  except Exception:  # pylint: disable=broad-except
    return None


def axis_size(axes) -> int:
  """Number of devices along ``axes`` (1 for ``()``); a clear ValueError when
  an axis is unbound.

  ``lax.axis_size`` raises a NameError for an axis that no enclosing
  ``shard_map`` binds: either the name is wrong or the loss is called outside
  ``shard_map``. Both are user errors, so they become a ValueError that says
  which.
  """
  n = 1
  for a in axes:
    try:
      n *= lax.axis_size(a)
    except NameError:
      bound = _bound_axis_names()
      if not bound:
        raise ValueError(
            f"axis_name={a!r} is not bound: a loss with axis_name must be "
            "called inside jax.shard_map over a mesh with that axis (no mesh "
            "axis is bound here, so this call is outside shard_map). For "
            "globally sharded arrays, use infcl_jax.sharded_contrastive_loss"
        ) from None
      raise ValueError(
          f"unknown axis name {a!r} in axis_name={axes if len(axes) > 1 else a!r}; "
          f"the enclosing shard_map binds {list(bound)}") from None
  return n


def varying_axes(a) -> frozenset:
  """The mesh axes over which ``a`` is typed device-varying (in shard_map)."""
  t = jax.typeof(a)
  mat = getattr(t, "manual_axis_type", None)  # jax >= 0.11
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(t, "vma", ()))  # Older spelling.


def _union(refs) -> frozenset:
  want = frozenset()
  for r in jax.tree_util.tree_leaves(refs):
    want |= varying_axes(r)
  return want


def to_varying(a, axes):
  """Marks ``a`` as device-varying over ``axes`` (no data movement).

  A value replicated over the axis (such as the logit scale) must be cast
  before it meets per-device values in a ``custom_vjp``, whose backward then
  returns this device's partial derivative; under ``check_vma=True`` JAX
  transposes the cast into the ``psum`` that adds the devices' partials up.
  Axes ``a`` already varies over are left alone (casting again is an error).
  """
  have = varying_axes(a)
  missing = tuple(x for x in axes if x not in have)
  if not missing:
    return a
  return lax.pcast(a, missing, to="varying")


def vary_like(tree, *refs):
  """Casts every leaf of ``tree`` to device-varying over the mesh axes that
  any of ``refs`` varies over (no data movement; a no-op outside shard_map).
  """
  want = _union(refs)
  if not want:
    return tree

  def cast(a):
    missing = tuple(sorted(want - varying_axes(a)))
    return lax.pcast(a, missing, to="varying") if missing else a
  return jax.tree_util.tree_map(cast, tree)


def drop_varying(*arrays):
  """The same arrays, typed replicated rather than device-varying.

  For a Pallas kernel whose body uses ``plgpu.warp_map`` (per-warp code):
  its ``mpmd_map`` refuses refs typed device-varying, which every operand of
  a kernel inside ``shard_map`` (with ``check_vma=True``) is. A bitcast to
  the array's own dtype moves no data (XLA removes it); traced with JAX's
  varying-axes check off -- as ``plgpu.kernel`` traces its own body -- it
  carries no varying type. The kernel's outputs must be re-typed with
  ``vary_like`` from the original inputs, or JAX would treat per-device
  results as replicated.
  """
  if not _union(arrays):
    return arrays
  from jax._src import config as jax_config  # pylint: disable=g-import-not-at-top
  with jax_config._check_vma(False):  # pylint: disable=protected-access
    return tuple(lax.bitcast_convert_type(a, a.dtype) for a in arrays)


def out_struct(shape, dtype, *refs):
  """``jax.ShapeDtypeStruct`` for a kernel output computed from ``refs``:
  inside ``shard_map`` it carries the inputs' varying mesh axes.
  """
  want = _union(refs)
  mat_type = getattr(jax.sharding, "ManualAxisType", None)
  if mat_type is None:  # Older JAX: no manual axis types on the struct.
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=mat_type(varying=want))
