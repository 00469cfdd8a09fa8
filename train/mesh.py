"""The trainer's device mesh: one axis, "data", over the devices.

Every array of the trainer is either split by rows over that axis (a batch,
its embeddings: ``rows``) or the same on every device (the params, the
loss: ``replicated``). The train step, the streamed image tower, evaluation,
the precompute and the batch decoders' placement all shard on it; this
module is the one place that names it, below the trainer and its packages
(train/data, train/eval), which may all import it.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"


def make_mesh(devices=None) -> Mesh:
  """The 1-D mesh over ``devices``; default: every device of every
  process, in ``jax.devices()`` order (the trainer's)."""
  return Mesh(np.array(jax.devices() if devices is None else devices),
              (AXIS,))


def rows(mesh) -> NamedSharding:
  """Rows split over the mesh's devices, in order (a batch)."""
  return NamedSharding(mesh, P(AXIS))


def replicated(mesh) -> NamedSharding:
  """The whole array on every device of the mesh (params, results)."""
  return NamedSharding(mesh, P())
