"""A Flax linen module that owns the temperature (and bias) and calls the loss.

Any Flax train step can drop it in::

    head = ContrastiveLoss(loss="softmax")          # or "sigmoid"
    head_vars = head.init(rng, img_emb, txt_emb)    # {"params": {"log_scale", ...}}
    loss = head.apply(head_vars, img_emb, txt_emb)

Inside ``jax.shard_map`` pass ``axis_name`` and give each device its local
shard of the embeddings: the loss is then the global loss over all shards, and
the embedding gradients are the exact partial derivatives of that global loss
with respect to each device's shard (sum parameter gradients, do not average).

The module holds the *log* of the scale, ``t' = log t``, so that ``t`` stays
positive, and clamps it to ``[min_log_scale, max_log_scale]`` in the forward
(CLIP caps the scale at 100). Defaults follow the papers:

* softmax (CLIP): ``t' = log(1 / 0.07)``, no bias.
* sigmoid (SigLIP): ``t' = log 10``, bias ``b = -10``.

This module needs flax, so ``infcl_jax/__init__.py`` does not import it;
``import infcl_jax`` stays jax/numpy-only.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

# The options' checks and defaults, and the loss call, are shared with the
# NNX head (infcl_jax._head); l2_normalize and LOSSES stay names of this
# module.
from infcl_jax import _head
from infcl_jax._head import l2_normalize  # noqa: F401  (re-exported)
from infcl_jax._head import LOSSES  # noqa: F401  (re-exported)
from infcl_jax.block_sizes import BlockSizes

nn = _head.import_flax("flax.linen", "infcl_jax.flax")


class ContrastiveLoss(nn.Module):
  """Learnable log-temperature (+ optional bias) in front of an exact loss.

  Attributes:
    loss: "softmax" (CLIP, ``infcl_jax.contrastive_loss``) or "sigmoid"
      (SigLIP, ``infcl_jax.sigmoid_loss``).
    init_log_scale: initial ``t'``; None picks the paper default of ``loss``.
    use_bias: learn a bias added to every logit; None: only for "sigmoid".
    init_bias: initial bias; None picks the paper default (-10 for sigmoid).
    min_log_scale, max_log_scale: clamp of ``t'`` in the forward pass.
    normalize: L2-normalize both embeddings first (cosine similarities).
    direction: softmax only; see ``contrastive_loss``.
    axis_name: mesh axis name(s) when called inside ``shard_map``.
    strategy: softmax with ``axis_name`` only: "auto" (default), "ring" or
      "gather"; see ``contrastive_loss``.
    backend: tile backend name, "auto" by default.
    block_sizes: optional ``BlockSizes`` of the tiled backends.
    precision: float32 inputs: "default", "high", "highest" or None (the
      backend's exact default); see ``contrastive_loss``.
    group_mode: "mask" (default) or "positives": what related pairs of the
      ``groups`` given to ``__call__`` are; see ``contrastive_loss`` and
      ``sigmoid_loss``.
  """
  loss: str = "softmax"
  init_log_scale: float | None = None
  use_bias: bool | None = None
  init_bias: float | None = None
  min_log_scale: float = 0.0
  max_log_scale: float = math.log(100.0)
  normalize: bool = True
  direction: str = "both"
  axis_name: Any = None
  strategy: str = "auto"
  backend: str = "auto"
  block_sizes: BlockSizes | None = None
  group_mode: str = "mask"
  precision: str | None = None

  def setup(self):
    _head.check_options(self)
    init_t, init_b = _head.initial_values(self)
    self.log_scale = self.param("log_scale", nn.initializers.constant(init_t),
                                (), jnp.float32)
    self.bias = None
    if init_b is not None:
      self.bias = self.param("bias", nn.initializers.constant(init_b), (),
                             jnp.float32)

  def _scalars(self):
    """(scale, bias or None); the scale is exp of the clamped log-scale."""
    return _head.scale_of(self, self.log_scale), self.bias

  # Named here, in the class body, so that linen wraps them as methods.
  __call__ = _head.call
  scale_and_bias = _head.scale_and_bias
