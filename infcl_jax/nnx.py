"""A Flax NNX module that owns the temperature (and bias) and calls the loss.

The NNX twin of ``infcl_jax.flax.ContrastiveLoss`` (linen): the same options,
defaults and loss, with the learnable log-scale ``t'`` and bias as
``nnx.Param``::

    head = ContrastiveLoss(loss="softmax")      # or "sigmoid"
    loss = head(img_emb, txt_emb)              # head.log_scale, head.bias

Put it in any ``nnx.Module`` (an attribute of your two-tower model) and train
with ``nnx.jit``, ``nnx.value_and_grad`` and ``nnx.Optimizer``; given the
same parameter values, it computes what the linen head computes.

Inside ``jax.shard_map`` pass ``axis_name`` and give each device its shard of
the embeddings: the loss is the global loss over all shards, and the
gradients are the exact partial derivatives of that global loss with respect
to each device's shard (sum parameter gradients, do not average; see
``infcl_jax.contrastive_loss``).

The module holds the *log* of the scale and clamps it to ``[min_log_scale,
max_log_scale]`` in the forward pass (CLIP caps the scale at 100). Defaults
follow the papers: softmax (CLIP) ``t' = log(1 / 0.07)``, no bias; sigmoid
(SigLIP) ``t' = log 10``, bias ``b = -10``.

This module needs flax (``pip install "infcl-jax[flax]"``), so
``infcl_jax/__init__.py`` does not import it.
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

# The options' checks and defaults, and the loss call, are the linen
# head's, from infcl_jax._head (not from the linen module).
from infcl_jax import _head
from infcl_jax.block_sizes import BlockSizes

nnx = _head.import_flax("flax.nnx", "infcl_jax.nnx")


class ContrastiveLoss(nnx.Module):
  """Learnable log-temperature (+ optional bias) in front of an exact loss.

  Args: the linen head's attributes, with the same names, meanings and
    defaults (``infcl_jax.flax.ContrastiveLoss``: ``loss``, the initial
    log-scale and bias, the log-scale's clamp, ``normalize`` and the
    options passed on to the loss); all but ``loss`` keyword-only.

  Attributes:
    log_scale: ``nnx.Param``, the float32 scalar ``t'``.
    bias: ``nnx.Param``, the float32 scalar bias, or None without one.
  """

  def __init__(self, loss: str = "softmax", *,
               init_log_scale: float | None = None,
               use_bias: bool | None = None,
               init_bias: float | None = None,
               min_log_scale: float = 0.0,
               max_log_scale: float = math.log(100.0),
               normalize: bool = True,
               direction: str = "both",
               axis_name: Any = None,
               strategy: str = "auto",
               backend: str = "auto",
               block_sizes: BlockSizes | None = None,
               group_mode: str = "mask",
               precision: str | None = None):
    self.loss = loss
    self.init_log_scale = init_log_scale
    self.use_bias = use_bias
    self.init_bias = init_bias
    self.min_log_scale = min_log_scale
    self.max_log_scale = max_log_scale
    self.normalize = normalize
    self.direction = direction
    self.axis_name = axis_name
    self.strategy = strategy
    self.backend = backend
    self.block_sizes = block_sizes
    self.group_mode = group_mode
    self.precision = precision
    _head.check_options(self)
    init_t, init_b = _head.initial_values(self)
    self.log_scale = nnx.Param(jnp.asarray(init_t, jnp.float32))
    self.bias = (None if init_b is None
                 else nnx.Param(jnp.asarray(init_b, jnp.float32)))

  def _scalars(self):
    """(scale, bias or None); the scale is exp of the clamped log-scale."""
    bias = None if self.bias is None else self.bias[...]
    return _head.scale_of(self, self.log_scale[...]), bias

  __call__ = _head.call
  scale_and_bias = _head.scale_and_bias
