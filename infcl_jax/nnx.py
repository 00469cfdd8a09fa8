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

try:
  from flax import nnx
except ImportError as e:  # The library itself needs only jax.
  raise ImportError(
      f"infcl_jax.nnx needs flax ({e}); install the extra: "
      f"pip install \"infcl-jax[flax]\"") from e
import jax.numpy as jnp

from infcl_jax.block_sizes import BlockSizes
# The option checks, defaults and the loss call are the linen head's.
from infcl_jax.flax import check_options
from infcl_jax.flax import head_loss
from infcl_jax.flax import initial_values
from infcl_jax.flax import l2_normalize  # noqa: F401  (re-exported)
from infcl_jax.flax import LOSSES  # noqa: F401  (re-exported)
from infcl_jax.flax import scale_of


class ContrastiveLoss(nnx.Module):
  """Learnable log-temperature (+ optional bias) in front of an exact loss.

  Args (all but ``loss`` keyword-only; as the linen head's attributes):
    loss: "softmax" (CLIP, ``infcl_jax.contrastive_loss``) or "sigmoid"
      (SigLIP, ``infcl_jax.sigmoid_loss``).
    init_log_scale: initial ``t'``; None picks the paper default of ``loss``.
    use_bias: learn a bias added to every logit; None: only for "sigmoid".
    init_bias: initial bias; None picks the paper default (-10 for sigmoid).
    min_log_scale, max_log_scale: clamp of ``t'`` in the forward pass.
    normalize: L2-normalize both embeddings first (cosine similarities).
    direction: softmax only; see ``contrastive_loss``.
    axis_name: mesh axis name(s) when called inside ``shard_map``.
    strategy: softmax with ``axis_name`` only: "auto", "ring" or "gather".
    backend: tile backend name, "auto" by default.
    block_sizes: optional ``BlockSizes`` of the tiled backends.
    group_mode: "mask" (default) or "positives", for ``groups``.
    precision: float32 inputs: "default", "high", "highest" or None.

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
    check_options(self)
    init_t, init_b = initial_values(self)
    self.log_scale = nnx.Param(jnp.asarray(init_t, jnp.float32))
    self.bias = (None if init_b is None
                 else nnx.Param(jnp.asarray(init_b, jnp.float32)))

  def _scalars(self):
    """(scale, bias or None); the scale is exp of the clamped log-scale."""
    bias = None if self.bias is None else self.bias[...]
    return scale_of(self, self.log_scale[...]), bias

  def __call__(self, image_emb, text_emb, labels=None, groups=None):
    """Returns the scalar float32 loss of the (local shard of the) batch.

    ``labels``: softmax with a one-way ``direction`` only; see
    ``contrastive_loss``. ``groups``: optional group ids (one array, or an
    (image, text) pair) of the (local shard of the) batch, handled by
    ``group_mode``.
    """
    scale, bias = self._scalars()
    return head_loss(self, scale, bias, image_emb, text_emb, labels, groups)

  def scale_and_bias(self):
    """The clamped scale ``t`` and the bias (0 when there is none)."""
    scale, bias = self._scalars()
    return scale, jnp.zeros((), jnp.float32) if bias is None else bias
