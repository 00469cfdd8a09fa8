"""GradCache: exact contrastive gradients with tower memory set by a micro-batch.

A contrastive loss couples every example of the batch with every other, so
plain gradient accumulation over micro-batches is *not* exact. GradCache
(Gao et al., 2021) splits the step into three parts instead:

1. Embed the whole batch chunk by chunk, forward only (``lax.scan``). No
   activations are kept: only the (B, D) embeddings leave each chunk.
2. Compute the loss and its gradient with respect to the embeddings once, on
   the full batch (the tiled loss itself never builds the B x B matrix).
3. Re-run each trainable tower chunk by chunk with ``jax.vjp`` and feed it
   the cached embedding gradients of that chunk; sum the parameter gradients.

The result equals the gradient of the un-chunked step up to float rounding
(the sums are just grouped differently), while the peak activation memory of
a tower is that of one chunk. The price is one extra forward of each
trainable tower.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp


def split_chunks(x, num_chunks: int):
  """(b, ...) -> (num_chunks, b // num_chunks, ...), consecutive rows."""
  b = x.shape[0]
  if b % num_chunks:
    raise ValueError(f"batch of {b} rows does not split into {num_chunks} "
                     "equal chunks")
  return x.reshape(num_chunks, b // num_chunks, *x.shape[1:])


def embed_in_chunks(apply_fn: Callable, params, inputs, num_chunks: int):
  """``apply_fn(params, inputs)`` chunk by chunk, without gradients.

  The scan only carries the outputs, so XLA frees each chunk's activations
  before the next chunk runs.
  """
  params = jax.lax.stop_gradient(params)

  def body(carry, chunk):
    return carry, apply_fn(params, chunk)

  _, out = jax.lax.scan(body, None, split_chunks(inputs, num_chunks))
  return out.reshape(inputs.shape[0], *out.shape[2:])


def backprop_in_chunks(apply_fn: Callable, params, inputs, emb_grads,
                       num_chunks: int):
  """Sum over chunks of ``vjp(apply_fn(., chunk))(emb_grads[chunk])``.

  Each chunk recomputes its forward inside ``jax.vjp``; only that chunk's
  activations are alive at a time. Gradients accumulate in float32.
  """
  acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def body(acc, xs):
    chunk, g = xs
    out, vjp_fn = jax.vjp(lambda p: apply_fn(p, chunk), params)
    (gp,) = vjp_fn(g.astype(out.dtype))
    return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, gp), None

  acc, _ = jax.lax.scan(
      body, acc, (split_chunks(inputs, num_chunks),
                  split_chunks(emb_grads, num_chunks)))
  return jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)


def value_and_grad(loss_fn: Callable, embed_fns: Mapping[str, Callable],
                   loss_params, tower_params: Mapping[str, Any],
                   inputs: Mapping[str, Any], *, num_chunks: int,
                   trainable: Mapping[str, bool]):
  """Loss and gradients of a two-tower contrastive step, via GradCache.

  Args:
    loss_fn: ``loss_fn(loss_params, embs) -> scalar`` where ``embs`` maps each
      tower name to its (b, D) embeddings (e.g. "img", "txt").
    embed_fns: tower name -> ``apply(params, inputs_chunk) -> (chunk, D)``.
      A tower whose inputs already are embeddings (precomputed) is simply
      absent here and present in ``inputs``.
    loss_params: parameters of the loss (temperature, bias).
    tower_params: tower name -> params.
    inputs: tower name -> (b, ...) inputs, or (b, D) embeddings for a tower
      without an ``embed_fn``.
    num_chunks: number of micro-batches the batch is split into.
    trainable: tower name -> whether to compute its gradient (a locked tower
      needs only the forward; its gradient is returned as zeros and the
      optimizer mask keeps it frozen either way).

  Returns:
    (loss, loss_param_grads, {tower name: param grads}).
  """
  embs = {}
  for name, x in inputs.items():
    if name in embed_fns:
      embs[name] = embed_in_chunks(embed_fns[name], tower_params[name], x,
                                   num_chunks)
    else:
      embs[name] = x
  loss, (g_loss, g_embs) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
      loss_params, embs)
  grads = {}
  for name, params in tower_params.items():
    if trainable.get(name, False):
      grads[name] = backprop_in_chunks(embed_fns[name], params, inputs[name],
                                       g_embs[name], num_chunks)
    else:
      grads[name] = jax.tree.map(jnp.zeros_like, params)
  return loss, g_loss, grads
