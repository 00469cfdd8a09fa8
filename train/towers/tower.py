"""The seam between an image tower and the rest of the trainer.

A ``Tower`` is what loading a tower returns (``train.towers.pretrained``,
or the config's own ViT/CNN) and all that the data pipeline, the step,
evaluation and the precomputed-embedding cache see of it:

- ``image_size``: S, the tower's input size;
- ``normalization``: applied on the device to uint8 pixels, so images cross
  the host and the host-to-device transfer as uint8 (4x smaller than float);
- ``embed(params, uint8 [b, C, C, 3]) -> float32 [b, D]``: the step, the
  streamed micro-batches, precompute and evaluation call it, inside or
  outside ``jit``/``shard_map``. At C = S (evaluation, and training without
  ``config.data.decode_size``) the data pipeline has resized and cropped on
  the host; at C > S (``decode_size``) the images are resized to S here
  first, on the device (train/towers/resize.py);
- ``fingerprint``: identifies the params and the preprocessing, so stored
  embeddings are never reused for another tower.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from train.towers import resize as resize_lib


@dataclasses.dataclass(frozen=True)
class Normalization:
  """Per-channel ``(x / 255 - mean) / std``, mean and std in [0, 1] units.

  Computed as ``(x - 255 mean) * (1 / (255 std))`` with float32 constants:
  a subtraction, then a multiplication, each rounded once, so the device
  (where XLA would fuse ``x * a - b`` into one fused multiply-add, rounded
  differently) and the host (``numpy``) give bitwise the same floats.
  ``SYMMETRIC`` (mean = std = 0.5) is the [-1, 1] scaling of big_vision and
  of this project's own towers: ``(x - 127.5) * (1 / 127.5)``, exactly -1
  and 1 at 0 and 255.
  """
  mean: tuple[float, float, float]
  std: tuple[float, float, float]

  def _constants(self):
    shift = np.asarray([255.0 * m for m in self.mean], np.float32)
    scale = np.asarray([1.0 / (255.0 * s) for s in self.std], np.float32)
    return shift, scale

  def __call__(self, images, dtype=jnp.float32):
    """uint8 (or float in [0, 255]) [..., 3] -> ``dtype``, normalised."""
    shift, scale = self._constants()
    x = (images.astype(jnp.float32) - shift) * scale
    return x.astype(dtype)

  def numpy(self, images: np.ndarray) -> np.ndarray:
    """The same on the host, in float32 (bitwise equal to the device)."""
    shift, scale = self._constants()
    return (np.asarray(images, np.float32) - shift) * scale


SYMMETRIC = Normalization((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


def params_digest(params) -> str:
  """blake2b of every leaf's name, dtype, shape and bytes, in name order."""
  h = hashlib.blake2b(digest_size=16)
  flat = flax.traverse_util.flatten_dict(jax.device_get(params), sep="/")
  for name in sorted(flat):
    a = np.ascontiguousarray(np.asarray(flat[name]))
    h.update(f"{name}|{a.dtype}|{a.shape}|".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def castable_params(module, params, image_size: int, dtype):
  """A tree of bools like ``params``: True where every use of the leaf in
  ``module.apply`` on [1, S, S, 3] images is a cast to ``dtype`` (so the
  leaf may be stored in ``dtype`` with no change to any result). Read off
  the traced program, not from names: a use inside a nested call, or any
  other operation, counts as not castable."""
  leaves, treedef = jax.tree.flatten(params)
  x = jnp.zeros((1, image_size, image_size, 3), dtype)
  closed = jax.make_jaxpr(
      lambda p: module.apply({"params": jax.tree.unflatten(treedef, p)}, x))(
          leaves)
  jaxpr = closed.jaxpr
  index = {v: i for i, v in enumerate(jaxpr.invars)}
  ok = [jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves]
  used = [False] * len(leaves)
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      i = index.get(v) if not hasattr(v, "val") else None
      if i is None:
        continue
      used[i] = True
      if not (eqn.primitive.name == "convert_element_type"
              and jnp.dtype(eqn.params["new_dtype"]) == jnp.dtype(dtype)):
        ok[i] = False
  if any(v in index for v in jaxpr.outvars if not hasattr(v, "val")):
    raise ValueError("castable_params: a param is returned as it is")
  return jax.tree.unflatten(treedef, [o and u for o, u in zip(ok, used)])


@dataclasses.dataclass
class Tower:
  """A Flax image tower with its params and its preprocessing contract.

  Attributes:
    module: the Flax module; ``module.apply({"params": p}, x)`` takes
      normalised float images [b, S, S, 3] and returns [b, D].
    params: its parameters.
    image_size: S, the module's input size (the data pipeline delivers S,
      or any larger square size that ``embed`` resizes to S).
    normalization: applied to uint8 pixels on the device.
    embed_dim: D.
    dtype: the compute dtype the normalised images are cast to.
    source: where the params came from (a path and format, or "random").
  """
  module: nn.Module
  params: Any
  image_size: int
  normalization: Normalization
  embed_dim: int
  dtype: Any = jnp.float32
  source: str = "random"

  def preprocess(self, images):
    """uint8 [b, C, C, 3], C >= S -> the module's input [b, S, S, 3]:
    resized to S (when C > S), normalised, cast to ``dtype``. The one home
    of the device preprocessing; traceable."""
    if images.shape[1] != self.image_size:
      images = resize_lib.resize_square(images, self.image_size)
    return self.normalization(images, self.dtype)

  def embed(self, params, images):
    """uint8 [b, C, C, 3] (C >= S) -> float32 [b, D]; traceable (jit,
    shard_map). At C = S: normalisation, the cast and the module only."""
    x = self.preprocess(images)
    return self.module.apply({"params": params}, x).astype(jnp.float32)

  def with_params_in_dtype(self) -> "Tower":
    """This tower with each param stored in ``dtype`` that the module casts
    to ``dtype`` before any other use (matmul and conv weights, biases,
    embeddings), cast once here: a locked tower then holds them in half the
    memory and the step casts nothing. Params the module uses in float32
    (LayerNorm scales and shifts, applied before the output is rounded) stay
    float32, so ``embed`` gives bitwise the same result. The identity for a
    float32 tower."""
    dt = jnp.dtype(self.dtype)
    if dt == jnp.float32:
      return self
    keep = castable_params(self.module, self.params, self.image_size, dt)
    params = jax.tree.map(
        lambda p, c: jnp.asarray(p, dt) if c else p, self.params, keep)
    return dataclasses.replace(self, params=params)

  @functools.cached_property
  def _jitted(self):
    return jax.jit(self.embed)

  def __call__(self, images):
    """The tower's embedding of uint8 images, with its own params."""
    return self._jitted(self.params, images)

  @functools.cached_property
  def fingerprint(self) -> str:
    """Identifies params, architecture and preprocessing (hex string)."""
    meta = json.dumps({"module": repr(self.module),
                       "image_size": self.image_size,
                       "mean": list(self.normalization.mean),
                       "std": list(self.normalization.std),
                       "dtype": str(jnp.dtype(self.dtype))}, sort_keys=True)
    return hashlib.blake2b((meta + params_digest(self.params)).encode(),
                           digest_size=16).hexdigest()


def embed_fn_of(tower):
  """``embed(params, x) -> (b, D)`` of a Tower (uint8 in) or a Flax module."""
  if isinstance(tower, Tower):
    return tower.embed
  return lambda p, x: tower.apply({"params": p}, x)
