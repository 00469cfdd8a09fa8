"""The text tower: tokens -> [b, embed_dim], from scratch or CLIP-initialised.

Two poolings, one module:

- ``pool="mean"`` (from scratch): bidirectional attention over the non-pad
  tokens, mean over them. Padding is trailing (the ``Tokenizer`` contract),
  so it is given to the attention as per-row lengths, which cuDNN's fused
  kernel takes, rather than as an [L, L] mask.
- ``pool="eos"`` (CLIP's text tower): causal attention, the final LayerNorm,
  and the features at the first EOS token. Causality makes the EOS features
  independent of whatever follows, padding included.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from train.towers import layers

Dtype = Any


class TextTransformer(nn.Module):
  """int32 tokens [b, L] (L <= max_len) -> [b, embed_dim].

  Params: ``token_embedding``, ``pos_embedding`` [1, max_len, W],
  ``encoder/block{i}``, ``norm``, ``head`` (bias unless ``head_bias=False``,
  CLIP's text projection).
  """
  vocab_size: int
  max_len: int
  width: int
  depth: int
  num_heads: int
  mlp_dim: int
  embed_dim: int
  pad_id: int = 0
  eos_id: int = 1
  pool: str = "mean"
  act: str = "gelu"
  ln_eps: float = 1e-6
  head_bias: bool = True
  dtype: Dtype = jnp.float32
  # What each block keeps for the backward pass (layers.REMAT_POLICIES):
  # config.model.text.remat. The params and the embeddings are the same.
  remat: str = "none"

  @nn.compact
  def __call__(self, tokens):
    if self.pool not in ("mean", "eos"):
      raise ValueError(f"TextTransformer.pool must be 'mean' or 'eos', got "
                       f"{self.pool!r}")
    b, length = tokens.shape
    if length > self.max_len:
      raise ValueError(f"text of {length} tokens is longer than the tower's "
                       f"max_len {self.max_len}")
    x = nn.Embed(self.vocab_size, self.width, name="token_embedding")(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                     (1, self.max_len, self.width), jnp.float32)
    x = (x + pos[:, :length]).astype(self.dtype)
    if length % 2:
      # cuDNN's fused attention trains only even lengths once a mask is
      # involved (77, CLIP's, is odd): one more trailing row, which no
      # kept position attends to (it is past every row's length and in
      # every EOS's future) and which is cut off again below.
      x = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))
    blocks = layers.Encoder(self.num_heads, self.mlp_dim, self.act,
                            self.ln_eps, dtype=self.dtype, depth=self.depth,
                            remat=self.remat, name="encoder")
    norm = nn.LayerNorm(self.ln_eps, dtype=self.dtype, name="norm")
    if self.pool == "eos":
      is_eos = tokens == self.eos_id
      # The first EOS; a row without one pools its last token. Only that
      # token leaves the encoder (its last block computes no other).
      idx = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1),
                      length - 1).astype(jnp.int32)
      x = norm(blocks(x, causal=True, query=idx))
    else:
      valid = tokens != self.pad_id
      lengths = jnp.maximum(jnp.sum(valid, axis=1, dtype=jnp.int32), 1)
      x = norm(blocks(x, lengths=lengths))[:, :length]
      w = valid.astype(jnp.float32)[..., None]
      # An all-padding text pools to zeros instead of dividing by zero.
      x = (jnp.sum(x.astype(jnp.float32) * w, axis=1)
           / jnp.maximum(jnp.sum(w, axis=1), 1.0)).astype(self.dtype)
    return nn.Dense(self.embed_dim, use_bias=self.head_bias, dtype=self.dtype,
                    name="head")(x)


def from_scratch(cfg, vocab_size: int, max_len: int, embed_dim: int, dtype,
                 pad_id: int = 0, eos_id: int = 1) -> TextTransformer:
  """The from-scratch tower of ``cfg`` (width, depth, num_heads, mlp_dim,
  and remat when it has one)."""
  return TextTransformer(
      vocab_size=vocab_size, max_len=max_len, width=cfg.width,
      depth=cfg.depth, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
      embed_dim=embed_dim, pad_id=pad_id, eos_id=eos_id, pool="mean",
      act="gelu_tanh", dtype=dtype, remat=getattr(cfg, "remat", "none"))
