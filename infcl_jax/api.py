"""Public entry point of the CLIP loss: validation and backend dispatch."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from infcl_jax import _checks
from infcl_jax import contrastive
from infcl_jax import reference
from infcl_jax import sharded
from infcl_jax import tile_backend


@functools.partial(
    jax.jit,
    static_argnames=("direction", "axis_name", "strategy", "backend",
                     "block_sizes"))
def contrastive_loss(image_emb, text_emb, logit_scale, *, logit_bias=None,
                     direction="both", axis_name=None, strategy="ring",
                     backend="auto", block_sizes=None):
  """Exact CLIP (softmax / InfoNCE) loss without the B x B logit matrix.

  Logits are ``s_ij = logit_scale * <image_emb_i, text_emb_j> + logit_bias``.
  The embeddings are used as given (normalize them first if you want cosine
  similarities) and ``logit_scale`` is the multiplier itself, not its log.

  Args:
    image_emb: (B_x, D) float16 / bfloat16 / float32.
    text_emb: (B_y, D), same D.
    logit_scale: scalar multiplier of the logits.
    logit_bias: optional scalar added to every logit.
    direction: "both" (CLIP: mean of the two cross-entropies, B_x == B_y),
      "image_to_text" (B_y >= B_x; the first B_x texts are the positives) or
      "text_to_image" (B_x >= B_y; the first B_y images are the positives).
    axis_name: mesh axis name (or tuple) when called inside ``shard_map``;
      the arrays are then this device's shards and the loss is the global
      loss over the shards concatenated in axis order (positives: global
      pairs (i, i)), the same on every device. Each device's gradients are
      the exact partial derivatives of that global loss w.r.t. its own
      shards; a replicated parameter's gradient is the SUM over devices
      (see ``infcl_jax.ring``), not the mean.
    strategy: with ``axis_name``: "ring" (ppermute ring, O(b * D) memory
      per device) or "gather" (all-gather + reduce-scatter, O(B * D)).
    backend: "auto", "reference", "xla" or "pallas".
    block_sizes: optional ``BlockSizes`` for the tiled backends.

  Returns:
    The scalar float32 loss. Gradients flow to the embeddings, the scale and
    the bias.
  """
  dtype = _checks.check_embeddings(image_emb, text_emb)
  _checks.check_direction(direction, image_emb.shape[0], text_emb.shape[0])
  _checks.check_backend(backend)
  scale = _checks.check_scalar("logit_scale", logit_scale)
  bias = _checks.check_scalar("logit_bias", logit_bias, allow_none=True)
  x = image_emb.astype(dtype)
  y = text_emb.astype(dtype)
  sharded.check_strategy(strategy)
  if axis_name is not None:
    return sharded.shard_local_loss(
        x, y, scale, bias, axis_name=axis_name, direction=direction,
        strategy=strategy, backend=backend, block_sizes=block_sizes)
  if backend == "reference":
    return reference.contrastive_loss_reference(
        x, y, scale, logit_bias=bias, direction=direction).astype(jnp.float32)
  if bias is None:
    bias = jnp.zeros((), jnp.float32)
  name = tile_backend.resolve_name(backend)
  return contrastive.tiled_contrastive_loss(x, y, scale, bias, name, direction,
                                            block_sizes)
