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

try:
  import flax.linen as nn
except ImportError as e:  # The library itself needs only jax.
  raise ImportError(
      f"infcl_jax.flax needs flax ({e}); install the extra: "
      f"pip install \"infcl-jax[flax]\"") from e
import jax
import jax.numpy as jnp

from infcl_jax.api import contrastive_loss
from infcl_jax.api import sigmoid_loss
from infcl_jax.block_sizes import BlockSizes

LOSSES = ("softmax", "sigmoid")
_DEFAULT_LOG_SCALE = {"softmax": math.log(1 / 0.07), "sigmoid": math.log(10.0)}
_DEFAULT_BIAS = {"softmax": 0.0, "sigmoid": -10.0}
_DEFAULT_USE_BIAS = {"softmax": False, "sigmoid": True}


def l2_normalize(x, eps=1e-6):
  """x / ||x|| row-wise; the norm is taken in float32 for low-precision x."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps * eps)
  return (x32 * inv).astype(x.dtype)


def check_options(head):
  """The head's options (of this module or ``infcl_jax.nnx``'s) make sense
  together, else one ValueError."""
  if head.loss not in LOSSES:
    raise ValueError(f"loss must be one of {LOSSES}, got {head.loss!r}")
  if head.loss == "sigmoid" and head.direction != "both":
    raise ValueError("direction applies to the softmax loss only; the "
                     f"sigmoid loss is symmetric, got {head.direction!r}")
  if head.loss == "sigmoid" and head.strategy != "auto":
    raise ValueError("strategy applies to the softmax loss only; the "
                     f"sigmoid loss always runs the ring, got {head.strategy!r}")
  if head.min_log_scale > head.max_log_scale:
    raise ValueError(f"min_log_scale {head.min_log_scale} > max_log_scale "
                     f"{head.max_log_scale}")


def initial_values(head):
  """(initial log-scale, initial bias or None when the head has none): the
  head's own values, else the paper defaults of its ``loss``."""
  init_t = (_DEFAULT_LOG_SCALE[head.loss] if head.init_log_scale is None
            else float(head.init_log_scale))
  use_bias = (_DEFAULT_USE_BIAS[head.loss] if head.use_bias is None
              else head.use_bias)
  if not use_bias:
    return init_t, None
  return init_t, (_DEFAULT_BIAS[head.loss] if head.init_bias is None
                  else float(head.init_bias))


def scale_of(head, log_scale):
  """The scale: exp of the log-scale clamped to the head's limits."""
  return jnp.exp(jnp.clip(log_scale, head.min_log_scale, head.max_log_scale))


def head_loss(head, scale, bias, image_emb, text_emb, labels, groups):
  """The loss a head with these options computes, given its scale and bias
  (None: no bias)."""
  if labels is not None and head.loss != "softmax":
    raise ValueError("labels= applies to the softmax loss with a one-way "
                     "direction; the sigmoid loss pairs i with i")
  if head.normalize:
    image_emb, text_emb = l2_normalize(image_emb), l2_normalize(text_emb)
  if head.loss == "softmax":
    return contrastive_loss(image_emb, text_emb, scale, logit_bias=bias,
                            direction=head.direction, labels=labels,
                            axis_name=head.axis_name, strategy=head.strategy,
                            backend=head.backend,
                            block_sizes=head.block_sizes, groups=groups,
                            group_mode=head.group_mode,
                            precision=head.precision)
  if bias is None:
    # SigLIP without a learnable bias: a fixed zero bias.
    bias = jnp.zeros((), jnp.float32)
  return sigmoid_loss(image_emb, text_emb, scale, bias,
                      axis_name=head.axis_name, backend=head.backend,
                      block_sizes=head.block_sizes, groups=groups,
                      group_mode=head.group_mode, precision=head.precision)


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
    check_options(self)
    init_t, init_b = initial_values(self)
    self.log_scale = self.param("log_scale", nn.initializers.constant(init_t),
                                (), jnp.float32)
    self.bias = None
    if init_b is not None:
      self.bias = self.param("bias", nn.initializers.constant(init_b), (),
                             jnp.float32)

  def _scalars(self):
    """(scale, bias or None); the scale is exp of the clamped log-scale."""
    return scale_of(self, self.log_scale), self.bias

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
    """The clamped scale ``t`` and the bias (0 when there is none).

    Call with ``head.apply(variables, method=ContrastiveLoss.scale_and_bias)``.
    """
    scale, bias = self._scalars()
    return scale, jnp.zeros((), jnp.float32) if bias is None else bias
