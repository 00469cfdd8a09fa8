"""The SigLIP sigmoid loss on tiles, without the B x B logit matrix.

    L = -(1/B) sum_i sum_j log sigmoid(z_ij * (t * <x_i, y_j> + b)),

with z_ij = +1 for the matching pair (i == j) and -1 otherwise, and B the
global batch. ``tiled_sigmoid_loss`` is a ``jax.custom_vjp`` over the sigmoid
family of a tile backend (``tile_backend``): the forward is a sum over tiles
and keeps only its inputs as residuals (O(B * D)); the backward recomputes
each tile once to form the gradient.

Parameter convention (SigLIP, Zhai et al. 2023)
-----------------------------------------------
The loss takes the scale ``t`` itself (a multiplier, not its log) and the
bias ``b``. A model learns them as two scalars, ``t'`` and ``b``, with
``t = exp(t')`` so that the scale stays positive, initialised at
``t' = log 10`` (t = 10) and ``b = -10``. The negative bias starts the
B^2 - B negative pairs near zero loss, so the first steps are not spent
pushing every logit down. The trainer's Flax module holds ``t'`` and ``b``
as parameters and calls::

    loss = sigmoid_loss(img, txt, jnp.exp(t_prime), b)

Gradients reach ``t'`` through ``exp`` by ordinary autodiff.
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from infcl_jax import _checks
from infcl_jax import reference
from infcl_jax import tile_backend
from infcl_jax import xla_sigmoid_tiles as _xla_sigmoid_tiles  # noqa: F401  Registers ("xla", "sigmoid").

F32 = jnp.float32
FAMILY = "sigmoid"


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def tiled_sigmoid_loss(x, y, scale, bias, backend, block_sizes):
  """The single-device sigmoid loss of (B, D) x and y over a tile backend."""
  loss, _ = _fwd(x, y, scale, bias, backend, block_sizes)
  return loss


def _fwd(x, y, scale, bias, backend, block_sizes):
  kernel = tile_backend.get_backend(backend, FAMILY)
  total = kernel.sigmoid_sum(x, y, scale.astype(F32), bias.astype(F32),
                             has_diagonal=True, block_sizes=block_sizes)
  return total / x.shape[0], (x, y, scale, bias)


def _bwd(backend, block_sizes, res, g):
  x, y, scale, bias = res
  kernel = tile_backend.get_backend(backend, FAMILY)
  coef = g.astype(F32) / x.shape[0]
  dx, dy, dsc, dbi = kernel.sigmoid_grad(
      x, y, scale.astype(F32), bias.astype(F32), coef, has_diagonal=True,
      block_sizes=block_sizes)
  return (dx.astype(x.dtype), dy.astype(y.dtype), dsc.astype(scale.dtype),
          dbi.astype(bias.dtype))


tiled_sigmoid_loss.defvjp(_fwd, _bwd)


def _tiled_backend_name(backend):
  """Resolves "auto" and checks that the sigmoid family has that backend."""
  name = tile_backend.resolve_name(backend, family=FAMILY)
  try:
    tile_backend.get_backend(name, FAMILY)
  except ValueError as e:
    if name == "pallas":
      raise NotImplementedError(
          "backend='pallas' has no sigmoid kernels registered in this build; "
          "use backend='xla' (or 'auto', which picks the best available)"
      ) from e
    raise
  return name


def _ring_loss(x, y, scale, bias, axis_name, backend, block_sizes):
  """Hands the cross-device case to ``infcl_jax.sigmoid_ring`` if present."""
  try:
    ring = importlib.import_module("infcl_jax.sigmoid_ring")
  except ModuleNotFoundError as e:
    if e.name != "infcl_jax.sigmoid_ring":
      raise
    raise NotImplementedError(
        "sigmoid_loss(axis_name=...) needs the sigmoid ring "
        "(infcl_jax.sigmoid_ring), which is not available yet") from e
  return ring.ring_sigmoid_loss(x, y, scale, bias, axis_name=axis_name,
                                backend=backend, block_sizes=block_sizes)


@functools.partial(jax.jit,
                   static_argnames=("axis_name", "backend", "block_sizes"))
def sigmoid_loss(image_emb, text_emb, logit_scale, logit_bias, *,
                 axis_name=None, backend="auto", block_sizes=None):
  """Exact SigLIP sigmoid loss without the B x B logit matrix.

  ``L = -(1/B) sum_ij log sigmoid(z_ij * s_ij)`` with
  ``s_ij = logit_scale * <image_emb_i, text_emb_j> + logit_bias``,
  ``z_ij = +1`` if ``i == j`` and ``-1`` otherwise, and B the global batch.
  The embeddings are used as given (normalize them first for cosine
  similarities) and ``logit_scale`` is the multiplier, not its log; see the
  module docstring for the ``t = exp(t')``, ``t' = log 10``, ``b = -10``
  convention.

  Args:
    image_emb: (B, D) float16 / bfloat16 / float32.
    text_emb: (B, D), same B and D.
    logit_scale: scalar multiplier of the logits.
    logit_bias: scalar added to every logit (required: SigLIP learns it).
    axis_name: mesh axis name (or tuple) when called inside ``shard_map``;
      the loss is then the global loss over all shards, computed by the
      sigmoid ring.
    backend: "auto", "reference" (full matrix, O(B^2) memory), "xla" (tiled)
      or "pallas" (fused kernels, when registered).
    block_sizes: optional ``BlockSizes`` for the tiled backends.

  Returns:
    The scalar float32 loss. Gradients flow to the embeddings, the scale and
    the bias; each is computed per element with the stable identity
    ``-log sigmoid(u) = max(-u, 0) + log1p(exp(-|u|))``.
  """
  dtype = _checks.check_embeddings(image_emb, text_emb)
  _checks.check_equal_batch(image_emb, text_emb, loss="sigmoid")
  _checks.check_backend(backend)
  scale = _checks.check_scalar("logit_scale", logit_scale)
  bias = _checks.check_scalar("logit_bias", logit_bias)
  x = image_emb.astype(dtype)
  y = text_emb.astype(dtype)
  if axis_name is not None:
    name = backend if backend == "reference" else _tiled_backend_name(backend)
    return _ring_loss(x, y, scale, bias, axis_name, name, block_sizes)
  if backend == "reference":
    return reference.sigmoid_loss_reference(x, y, scale,
                                            bias).astype(jnp.float32)
  name = _tiled_backend_name(backend)
  return tiled_sigmoid_loss(x, y, scale, bias, name, block_sizes)
