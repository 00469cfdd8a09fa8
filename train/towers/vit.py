"""One configurable vision transformer for every checkpoint family.

The families differ only in a few switches, so they are configuration of
one module rather than one class each:

=============  ===========  ========  ========  ======  ==========  ======
family         class token  pos emb.  pre-norm  pool    final norm  head
=============  ===========  ========  ========  ======  ==========  ======
CLIP (HF/OC)   yes          + cls     ln_pre    tok     pooled      proj
SigLIP / bv    no           patches   no        map     tokens      none
bv classifier  yes          patches   no        tok     tokens      none
timm token     yes          + cls     no        tok     tokens      none
timm GAP       yes          + cls     no        gap     pooled      none
this project   no           patches   no        gap     tokens      dense
=============  ===========  ========  ========  ======  ==========  ======

Params (the converters in ``train.towers.convert_*`` map each format here):
``embedding`` (Conv [p, p, 3, W]), ``cls`` [1, 1, W], ``pos_embedding``
[1, N, W], ``pre_norm``, ``encoder/block{i}`` (see ``layers.Block``),
``norm``, ``map_head`` and ``head``.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from train.towers import layers

Dtype = Any

POOLS = ("tok", "gap", "map")
FINAL_NORMS = ("tokens", "pooled", "none")


class MapHead(nn.Module):
  """Multi-head attention pooling: one learned probe attends to the tokens,
  then a residual MLP (SigLIP's and big_vision's ``map`` pooling)."""
  num_heads: int
  mlp_dim: int
  act: str = "gelu_tanh"
  ln_eps: float = 1e-6
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    b, _, d = x.shape
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d))
    probe = jnp.broadcast_to(probe.astype(self.dtype), (b, 1, d))
    x = layers.Attention(self.num_heads, dtype=self.dtype, name="attn")(
        probe, x)
    y = nn.LayerNorm(self.ln_eps, dtype=self.dtype, name="norm")(x)
    x = x + layers.Mlp(self.mlp_dim, self.act, dtype=self.dtype,
                       name="mlp")(y)
    return x[:, 0]


class ViT(nn.Module):
  """Normalised images [b, S, S, 3] -> [b, embed_dim] (or [b, width]).

  Attributes:
    patch_size, width, depth, num_heads, mlp_dim: the transformer.
    embed_dim: output size of the final ``head`` Dense; 0 = no head (the
      pooled features are the embedding).
    head_bias: the head has a bias (False: CLIP's visual projection).
    patch_bias: the patch embedding has a bias (CLIP's has none).
    class_token: a learned token is prepended.
    pos_embed_cls: the position embeddings cover the class token too (CLIP,
      timm) rather than the patches only (big_vision).
    pre_norm: a LayerNorm before the encoder (CLIP's ``ln_pre``).
    pool: "tok" (the class token), "gap" (mean of the patch tokens) or
      "map" (attention pooling, ``MapHead``).
    final_norm: the last LayerNorm on all "tokens" before pooling, on the
      "pooled" vector (CLIP's ``ln_post``, timm's ``fc_norm``), or "none".
    act: "gelu" (erf), "gelu_tanh" or "quick_gelu".
    ln_eps: LayerNorm epsilon of the checkpoint (1e-5 CLIP, 1e-6 others).
    qkv_bias: the attention projections have biases.
    layer_scale: per-channel gains on each residual branch.
    dtype: compute dtype; params stay float32.
  """
  patch_size: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  embed_dim: int = 0
  head_bias: bool = True
  patch_bias: bool = True
  class_token: bool = False
  pos_embed_cls: bool = False
  pre_norm: bool = False
  pool: str = "gap"
  final_norm: str = "tokens"
  act: str = "gelu"
  ln_eps: float = 1e-6
  qkv_bias: bool = True
  layer_scale: bool = False
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, images):
    if self.pool not in POOLS:
      raise ValueError(f"ViT.pool must be one of {POOLS}, got {self.pool!r}")
    if self.final_norm not in FINAL_NORMS:
      raise ValueError(f"ViT.final_norm must be one of {FINAL_NORMS}, got "
                       f"{self.final_norm!r}")
    if self.pool == "tok" and not self.class_token:
      raise ValueError("ViT.pool='tok' needs class_token=True")
    p, dt = self.patch_size, self.dtype
    ln = lambda name: nn.LayerNorm(self.ln_eps, dtype=dt, name=name)  # noqa: E731
    x = nn.Conv(self.width, (p, p), strides=(p, p), padding="VALID",
                use_bias=self.patch_bias, dtype=dt,
                name="embedding")(images.astype(dt))
    b, h, w, c = x.shape
    x = x.reshape(b, h * w, c)
    n_pos = h * w + (1 if self.class_token and self.pos_embed_cls else 0)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                     (1, n_pos, c), jnp.float32).astype(dt)
    if not self.pos_embed_cls:
      x = x + pos
    if self.class_token:
      cls = self.param("cls", nn.initializers.zeros, (1, 1, c), jnp.float32)
      x = jnp.concatenate([jnp.broadcast_to(cls.astype(dt), (b, 1, c)), x],
                          axis=1)
    if self.pos_embed_cls:
      x = x + pos
    if self.pre_norm:
      x = ln("pre_norm")(x)
    encoder = layers.Encoder(self.num_heads, self.mlp_dim, self.act,
                             self.ln_eps, self.qkv_bias, self.layer_scale,
                             dtype=dt, depth=self.depth, name="encoder")
    # With "tok" pooling only the class token leaves the encoder (its last
    # block computes no other token); a per-token final norm of it is the
    # same.
    query = jnp.zeros((b,), jnp.int32) if self.pool == "tok" else None
    x = encoder(x, query=query)
    if self.final_norm == "tokens":
      x = ln("norm")(x)
    if self.pool == "gap":
      x = jnp.mean(x[:, 1 if self.class_token else 0:].astype(jnp.float32),
                   axis=1).astype(dt)
    elif self.pool == "map":
      x = MapHead(self.num_heads, self.mlp_dim, self.act, self.ln_eps,
                  dtype=dt, name="map_head")(x)
    if self.final_norm == "pooled":
      x = ln("norm")(x)
    if self.embed_dim:
      x = nn.Dense(self.embed_dim, use_bias=self.head_bias, dtype=dt,
                   name="head")(x)
    return x


def grid_of(num_patches: int, where: str) -> int:
  """The side of a square patch grid, or a one-line error."""
  g = int(round(num_patches ** 0.5))
  if g * g != num_patches:
    raise ValueError(f"{where}: {num_patches} position embeddings do not form "
                     "a square patch grid")
  return g


def resample_pos_embedding(pos: np.ndarray, num_prefix: int,
                           new_grid: int, where: str = "pos_embedding"):
  """[1, prefix + g*g, W] -> [1, prefix + new_grid^2, W], bilinear over the
  grid; the prefix (class token) rows are kept. The identity when the grid
  is unchanged (returned as is)."""
  pos = np.asarray(pos)
  prefix, grid = pos[:, :num_prefix], pos[:, num_prefix:]
  g = grid_of(grid.shape[1], where)
  if g == new_grid:
    return pos
  w = grid.shape[-1]
  grid = jax.image.resize(jnp.asarray(grid.reshape(g, g, w), jnp.float32),
                          (new_grid, new_grid, w), method="bilinear",
                          antialias=False)
  grid = np.asarray(grid, pos.dtype).reshape(1, new_grid * new_grid, w)
  return np.concatenate([prefix, grid], axis=1)
