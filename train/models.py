"""The two towers of LiT: an image tower (ViT or small CNN) and a text transformer.

Both towers map their input to an embedding of size ``embed_dim``; the loss
head (``infcl_jax.flax.ContrastiveLoss``) normalizes and compares them. The
image tower is meant to be *locked* (LiT "Lu"): it is loaded from a local
checkpoint (``load_image_tower``) and frozen by the optimizer mask in
``train.train``; its output, the pre-logits of the pretraining classifier, is
the image embedding as is.

All modules are Flax linen, deterministic (no dropout), so a resumed run
reproduces an uninterrupted one bit for bit.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

Dtype = Any


class MlpBlock(nn.Module):
  mlp_dim: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    x = nn.Dense(self.mlp_dim, dtype=self.dtype)(x)
    x = nn.gelu(x)
    return nn.Dense(d, dtype=self.dtype)(x)


class EncoderBlock(nn.Module):
  """Pre-LayerNorm transformer block; ``mask`` is (b, 1, L, L) or None."""
  num_heads: int
  mlp_dim: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    y = nn.LayerNorm(dtype=self.dtype)(x)
    y = nn.MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype)(y, y, mask=mask)
    x = x + y
    y = nn.LayerNorm(dtype=self.dtype)(x)
    return x + MlpBlock(self.mlp_dim, dtype=self.dtype)(y)


class Encoder(nn.Module):
  depth: int
  num_heads: int
  mlp_dim: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, mask=None):
    for i in range(self.depth):
      x = EncoderBlock(self.num_heads, self.mlp_dim, dtype=self.dtype,
                       name=f"block{i}")(x, mask)
    return nn.LayerNorm(dtype=self.dtype, name="final_norm")(x)


class ViT(nn.Module):
  """Vision transformer: patches, learned positions, encoder, mean pooling."""
  patch_size: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  embed_dim: int
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images):
    p = self.patch_size
    x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID",
                dtype=self.dtype, name="embedding")(images.astype(self.dtype))
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                     (1, h * w, c), jnp.float32)
    x = x + pos.astype(self.dtype)
    x = Encoder(self.depth, self.num_heads, self.mlp_dim, dtype=self.dtype,
                name="encoder")(x)
    x = jnp.mean(x, axis=1)
    return nn.Dense(self.embed_dim, dtype=self.dtype, name="head")(x)


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


class TextTransformer(nn.Module):
  """Text tower from scratch: tokens, positions, encoder, masked mean pool.

  Token id ``pad_id`` marks padding; padded positions are masked out of the
  attention and of the pooling, so the embedding does not depend on padding.
  """
  vocab_size: int
  max_len: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  embed_dim: int
  pad_id: int = 0
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    valid = tokens != self.pad_id                                   # (b, L)
    x = nn.Embed(self.vocab_size, self.width, name="token_embedding")(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                     (1, self.max_len, self.width), jnp.float32)
    x = (x + pos[:, :tokens.shape[1]]).astype(self.dtype)
    mask = nn.make_attention_mask(valid, valid)
    x = Encoder(self.depth, self.num_heads, self.mlp_dim, dtype=self.dtype,
                name="encoder")(x, mask)
    w = valid.astype(jnp.float32)[..., None]
    # An all-padding text pools to zeros instead of dividing by zero.
    x = jnp.sum(x.astype(jnp.float32) * w, axis=1) / jnp.maximum(
        jnp.sum(w, axis=1), 1.0)
    return nn.Dense(self.embed_dim, dtype=self.dtype, name="head")(
        x.astype(self.dtype))


def make_image_tower(cfg, embed_dim: int, dtype: Dtype) -> nn.Module:
  """The image tower of ``config.model.image``."""
  if cfg.kind == "vit":
    return ViT(patch_size=cfg.patch_size, width=cfg.width, depth=cfg.depth,
               num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
               embed_dim=embed_dim, dtype=dtype)
  if cfg.kind == "cnn":
    return SmallCNN(features=tuple(cfg.cnn_features), embed_dim=embed_dim,
                    dtype=dtype)
  raise ValueError(
      f"config.model.image.kind must be 'vit' or 'cnn', got {cfg.kind!r}")


def make_text_tower(cfg, vocab_size: int, max_len: int, embed_dim: int,
                    dtype: Dtype, pad_id: int = 0) -> nn.Module:
  """The text tower of ``config.model.text``."""
  return TextTransformer(vocab_size=vocab_size, max_len=max_len,
                         width=cfg.width, depth=cfg.depth,
                         num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
                         embed_dim=embed_dim, pad_id=pad_id, dtype=dtype)


def save_npz(path: str, params) -> None:
  """Writes a params tree as an .npz of "a/b/c"-named arrays, atomically."""
  flat = flax.traverse_util.flatten_dict(jax.device_get(params), sep="/")
  tmp = f"{path}.tmp-{os.getpid()}.npz"
  np.savez(tmp, **{k: np.asarray(v) for k, v in flat.items()})
  os.replace(tmp, path)


def load_image_tower(path: str, reference_params):
  """Loads tower params from an .npz of named arrays or an orbax checkpoint.

  Args:
    path: ``*.npz`` with arrays named like "conv0a/kernel" (the layout of
      ``save_npz``), or an orbax (PyTree) checkpoint directory.
    reference_params: freshly initialized params of the same tower; names and
      shapes must match exactly.

  Returns:
    The loaded params, with the structure of ``reference_params``.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: names or shapes differ from the model of the config.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f"image tower checkpoint not found: {path}")
  if os.path.isdir(path):
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    with ocp.PyTreeCheckpointer() as ckptr:
      tree = ckptr.restore(os.path.abspath(path))
    flat = flax.traverse_util.flatten_dict(tree, sep="/")
  else:
    with np.load(path) as f:
      flat = {k: f[k] for k in f.files}
  ref = flax.traverse_util.flatten_dict(reference_params, sep="/")
  missing = sorted(set(ref) - set(flat))
  extra = sorted(set(flat) - set(ref))
  if missing or extra:
    raise ValueError(
        f"image tower checkpoint {path} does not match config.model.image: "
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
