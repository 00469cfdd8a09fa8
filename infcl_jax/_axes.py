"""Named-axis helpers shared by the cross-device losses (ring and gather).

A loss called with ``axis_name`` runs inside ``jax.shard_map``: every array
it sees is one device's shard, and the axis (or tuple of axes, linearised in
mesh order the way ``PartitionSpec(("a", "b"))`` shards) names the devices
the global batch is split over.
"""
from __future__ import annotations

from jax import lax

from infcl_jax import tile_backend


def normalize(axis_name):
  """Returns ``axis_name`` as a non-empty tuple of axis names."""
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
  """Number of devices along ``axes``; a clear ValueError when unbound.

  ``lax.axis_size`` raises a NameError for an axis that no enclosing
  ``shard_map`` (or ``pmap``) binds: either the name is wrong or the loss is
  called outside ``shard_map``. Both are user errors, so they become a
  ValueError that says which.
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


def to_varying(a, axes):
  """Marks ``a`` as device-varying over ``axes`` (no data movement).

  Under shard_map's type checking (``check_vma=True``, the default), a value
  replicated over the axis (such as the logit scale) must be cast before it
  meets per-device values in a ``custom_vjp``, whose backward then returns
  this device's partial derivative; JAX transposes the cast into the ``psum``
  that adds the devices' partials up. Axes ``a`` already varies over are
  left alone (casting them again is an error).
  """
  have = tile_backend.varying_axes(a)
  missing = tuple(x for x in axes if x not in have)
  if not missing:
    return a
  return lax.pcast(a, missing, to="varying")
