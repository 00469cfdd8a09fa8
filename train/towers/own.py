"""This project's own image towers (a small CNN, or our ViT from scratch),
and their ``.npz`` files (``train.pretrain_image_tower`` writes them).

Their pixels are in [-1, 1] (``SYMMETRIC``), the host pipeline's float
scaling, so ``Tower.apply`` on the pipeline's float images is exact.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from train.towers import vit as vit_lib

Dtype = Any


class SmallCNN(nn.Module):
  """Conv-ReLU-pool stages, global average pooling, a linear embedding."""
  features: Sequence[int]
  embed_dim: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images):
    x = images.astype(self.dtype)
    for i, f in enumerate(self.features):
      x = nn.Conv(f, (3, 3), dtype=self.dtype, name=f"conv{i}a")(x)
      x = nn.relu(x)
      x = nn.Conv(f, (3, 3), dtype=self.dtype, name=f"conv{i}b")(x)
      x = nn.relu(x)
      if i + 1 < len(self.features):
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = jnp.mean(x, axis=(1, 2))
    x = nn.LayerNorm(dtype=self.dtype, name="norm")(x)
    return nn.Dense(self.embed_dim, dtype=self.dtype, name="head")(x)


def make_module(cfg, embed_dim: int, dtype: Dtype) -> nn.Module:
  """The own tower of ``config.model.image`` (kind "cnn" or "vit")."""
  if cfg.kind == "vit":
    # Patch tokens only, mean-pooled, a Dense head: the from-scratch ViT.
    return vit_lib.ViT(patch_size=cfg.patch_size, width=cfg.width,
                       depth=cfg.depth, num_heads=cfg.num_heads,
                       mlp_dim=cfg.mlp_dim, embed_dim=embed_dim, pool="gap",
                       final_norm="tokens", act="gelu_tanh", dtype=dtype)
  if cfg.kind == "cnn":
    return SmallCNN(features=tuple(cfg.cnn_features), embed_dim=embed_dim,
                    dtype=dtype)
  raise ValueError(f"config.model.image.kind must be 'cnn', 'vit' or "
                   f"'pretrained', got {cfg.kind!r}")


def save_npz(path: str, params) -> None:
  """Writes a params tree as an .npz of "a/b/c"-named arrays, atomically."""
  flat = flax.traverse_util.flatten_dict(jax.device_get(params), sep="/")
  tmp = f"{path}.tmp-{os.getpid()}.npz"
  np.savez(tmp, **{k: np.asarray(v) for k, v in flat.items()})
  os.replace(tmp, path)


def load_npz(path: str, reference_params):
  """Own-tower params from an .npz of named arrays or an orbax checkpoint.

  Args:
    path: ``*.npz`` with arrays named like "conv0a/kernel" (the layout of
      ``save_npz``), or an orbax (PyTree) checkpoint directory.
    reference_params: freshly initialized params of the same tower; names and
      shapes must match exactly.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: names or shapes differ from the model of the config.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"image tower checkpoint not found: {path}")
  if os.path.isdir(path):
    with ocp.PyTreeCheckpointer() as ckptr:
      tree = ckptr.restore(os.path.abspath(path))
    flat = flax.traverse_util.flatten_dict(tree, sep="/")
  else:
    with np.load(path, allow_pickle=False) as f:
      flat = {k: f[k] for k in f.files}
  ref = flax.traverse_util.flatten_dict(reference_params, sep="/")
  missing = sorted(set(ref) - set(flat))
  extra = sorted(set(flat) - set(ref))
  if missing or extra:
    raise ValueError(
        f"image tower checkpoint {path} does not match config.model.image "
        "(an own-tower .npz; for a pretrained checkpoint set "
        "config.model.image.kind='pretrained'): "
        f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
        f"unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}")
  out = {}
  for k, r in ref.items():
    v = np.asarray(flat[k])
    if v.shape != tuple(r.shape):
      raise ValueError(
          f"image tower checkpoint {path}: {k} has shape {v.shape}, the model "
          f"of config.model.image wants {tuple(r.shape)}")
    out[k] = jnp.asarray(v, dtype=r.dtype)
  return flax.traverse_util.unflatten_dict(out, sep="/")
