"""What the two Flax heads share: options, defaults and the loss call.

``infcl_jax.flax.ContrastiveLoss`` (linen) and ``infcl_jax.nnx.ContrastiveLoss``
(NNX) hold their parameters each in its framework's way and read everything
else from here, so that given the same parameter values they compute the
same loss. Needs neither flax nor any framework: a head is any object with
the options as attributes and a ``_scalars()`` method that returns
``(scale, bias or None)``.
"""
from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp

from infcl_jax.api import contrastive_loss
from infcl_jax.api import sigmoid_loss

LOSSES = ("softmax", "sigmoid")
_DEFAULT_LOG_SCALE = {"softmax": math.log(1 / 0.07), "sigmoid": math.log(10.0)}
_DEFAULT_BIAS = {"softmax": 0.0, "sigmoid": -10.0}
_DEFAULT_USE_BIAS = {"softmax": False, "sigmoid": True}


def import_flax(module, head):
  """flax's ``module`` (flax.linen or flax.nnx) for the head module
  ``head``, or one ImportError that names the extra to install: the library
  itself needs only jax."""
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f"{head} needs flax ({e}); install the extra: "
                      f"pip install \"infcl-jax[flax]\"") from e


def l2_normalize(x, eps=1e-6):
  """x / ||x|| row-wise; the norm is taken in float32 for low-precision x."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps * eps)
  return (x32 * inv).astype(x.dtype)


def check_options(head):
  """The head's options make sense together, else one ValueError."""
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


# The two methods both heads have. Each head's class names them in its own
# body (``__call__ = _head.call``), where linen wraps its methods.


def call(self, image_emb, text_emb, labels=None, groups=None):
  """Returns the scalar float32 loss of the (local shard of the) batch.

  ``labels``: softmax with a one-way ``direction`` only; see
  ``contrastive_loss``. ``groups``: optional group ids (one array, or an
  (image, text) pair) of the (local shard of the) batch, handled by
  ``group_mode``.
  """
  scale, bias = self._scalars()  # pylint: disable=protected-access
  return head_loss(self, scale, bias, image_emb, text_emb, labels, groups)


def scale_and_bias(self):
  """The clamped scale ``t`` and the bias (0 when there is none).

  On the linen head, call it as
  ``head.apply(variables, method=ContrastiveLoss.scale_and_bias)``.
  """
  scale, bias = self._scalars()  # pylint: disable=protected-access
  return scale, jnp.zeros((), jnp.float32) if bias is None else bias
