"""The LiT train step: the data-parallel GradCache step and its state.

Pure JAX / Flax / optax (no ml_collections, no data pipeline), so the GPU
benchmark can build the exact step the trainer runs; the optimizer and its
schedule are in ``train.optim``.

Parameters are one dict ``{"img": ..., "txt": ..., "head": ...}``: the image
tower, the text tower and the loss head (``infcl_jax.flax.ContrastiveLoss``:
log-temperature and bias). The train state is ``{"step", "params",
"opt_state"}``.

Data parallelism: the whole gradient computation runs inside ``shard_map``
over the 1-D mesh axis ``"data"``; each device embeds its own shard. With more
than one device the loss sees the local shards and ``axis_name="data"`` (the
ring), so it is the *global* loss, and its embedding gradients are the exact
partial derivatives of the global loss with respect to each device's shard;
for the replicated scale and bias each device gets its share (its tiles).
Every parameter gradient is therefore **summed** over devices (``psum``), not
averaged (``shard_map`` runs with ``check_vma=False``, so the sum is explicit
here rather than inserted by JAX).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from train import diagnostics
from train import gradcache
from train import mesh as mesh_lib
from train.mesh import AXIS
from train.towers import tower as tower_lib


# ----------------------------------------------------------------- the loss


def make_loss_fn(head, mesh):
  """``loss(head_params, img_emb_local, txt_emb_local, groups_local=None)``
  inside shard_map.

  With more than one device the head gets ``axis_name`` (the ring): the
  global loss of the local shards. ``groups_local`` (int32 [b]) are the
  group ids of the shard's pairs (the batch is paired): the head's
  ``group_mode`` says what related pairs are.
  """
  if mesh.size > 1:
    head = head.clone(axis_name=AXIS)

  def loss(hp, x, y, groups=None):
    if groups is None:  # The call of a run without groups, unchanged.
      return head.apply({"params": hp}, x, y)
    return head.apply({"params": hp}, x, y, groups=groups)

  return loss


# ----------------------------------------------------------------- the step


def make_grad_fn(*, mesh, image_tower: nn.Module, text_tower: nn.Module,
                 head: nn.Module, microbatch_size: int, global_batch: int,
                 precomputed: bool, image_locked: bool,
                 groups: bool = False, loss_dtype=None):
  """Builds ``grad_fn(params, batch) -> (loss, grads)`` (not jitted).

  Args:
    mesh: 1-D mesh with axis "data" over all devices.
    image_tower: a ``train.towers.Tower`` (batches carry uint8 "image" at
      the tower's size or at data.decode_size, resized, normalised and cast
      on the device by ``Tower.embed``) or a Flax module (float images,
      already normalised).
    text_tower, head: the Flax modules (head without axis_name).
    microbatch_size: global micro-batch of GradCache; 0 or >= global_batch
      runs the plain un-chunked step.
    global_batch: global batch size.
    precomputed: batches carry "image_emb" (b, D) instead of "image".
    image_locked: the image tower gets no gradient (it is frozen by the
      optimizer mask; skipping its backward only saves compute).
    groups: batches carry "group" (int32 (b,), sharded like the pairs):
      the loss gets them as ``groups=`` (``config.loss.groups``).
    loss_dtype: the dtype both embeddings are cast to for the loss
      (``config.loss.dtype``); None: their promoted dtype (the image
      tower's float32 embeddings make the loss float32).

  Returns:
    A function of replicated params and a batch (dict of arrays sharded on
    "data") giving the global loss and the gradients of the global loss.
  """
  n_dev = mesh.size
  if global_batch % n_dev:
    raise ValueError(f"batch_size {global_batch} is not divisible by the "
                     f"{n_dev} devices")
  chunked = 0 < microbatch_size < global_batch
  num_chunks = 1
  if chunked:
    if global_batch % microbatch_size or microbatch_size % n_dev:
      raise ValueError(
          f"microbatch_size {microbatch_size} must divide batch_size "
          f"{global_batch} and be divisible by the {n_dev} devices")
    num_chunks = global_batch // microbatch_size
  head_loss = make_loss_fn(head, mesh)
  if loss_dtype:
    def loss_fn(hp, x, y, groups=None):
      return head_loss(hp, x.astype(loss_dtype), y.astype(loss_dtype), groups)
  else:
    loss_fn = head_loss
  image_key = "image_emb" if precomputed else "image"
  embed_img = tower_lib.embed_fn_of(image_tower)

  def embed_txt(p, t):
    return text_tower.apply({"params": p}, t)

  def local_grads(params, batch):
    """Loss and gradients of one device's shard (inside shard_map)."""
    # The ids are data of the whole batch: GradCache chunks the towers, the
    # loss sees the batch once, with its groups.
    g_ids = batch["group"] if groups else None
    if chunked:
      embed_fns = {"txt": embed_txt}
      tower_params = {"txt": params["txt"]}
      if not precomputed:
        embed_fns["img"] = embed_img
        tower_params["img"] = params["img"]
      loss, g_head, g_towers = gradcache.value_and_grad(
          lambda hp, e: loss_fn(hp, e["img"], e["txt"], g_ids), embed_fns,
          params["head"], tower_params,
          {"img": batch[image_key], "txt": batch["text"]},
          num_chunks=num_chunks,
          trainable={"img": not image_locked, "txt": True})
      grads = {"head": g_head, "txt": g_towers["txt"],
               "img": g_towers.get("img")}
    else:
      def full_loss(params):
        if precomputed:
          x = batch[image_key]
        else:
          x = embed_img(params["img"], batch[image_key])
          if image_locked:
            x = jax.lax.stop_gradient(x)  # Skips the frozen tower's backward.
        return loss_fn(params["head"], x, embed_txt(params["txt"],
                                                    batch["text"]), g_ids)
      loss, grads = jax.value_and_grad(full_loss)(params)
    if grads["img"] is None:  # Precomputed embeddings: the tower is unused.
      grads["img"] = jax.tree.map(jnp.zeros_like, params["img"])
    # Gradient convention: every grad is this shard's share of the gradient of
    # the global loss -> sum over devices (a mean would be N times too small).
    return loss, jax.lax.psum(grads, AXIS)

  return jax.shard_map(
      local_grads, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()),
      check_vma=False)


def make_train_step(*, grad_fn, head: nn.Module, optimizer, schedule,
                    embed_sample=None):
  """Builds the jitted ``train_step(state, batch) -> (state, metrics)``.

  Args:
    grad_fn: from ``make_grad_fn``.
    head: the loss head module (to report the clamped scale and bias).
    optimizer, schedule: from ``train.optim``.
    embed_sample: optional, from ``diagnostics.make_sample_embedder``: adds
      the positive/negative logit statistics of a small sample.
  """
  def train_step(state, batch):
    loss, grads = grad_fn(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"],
                                          state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {
        "loss": loss,
        **diagnostics.loss_diagnostics(head, state["params"], batch,
                                       embed_sample),
        "grad_norm": optax.tree.norm({"txt": grads["txt"],
                                        "head": grads["head"]}),
        "lr": schedule(state["step"]),
    }
    return {"step": state["step"] + 1, "params": params,
            "opt_state": opt_state}, metrics

  return jax.jit(train_step, donate_argnums=(0,))


def init_state(mesh, params, optimizer) -> dict[str, Any]:
  """A fresh train state, replicated over the mesh (as the step returns it,
  so the first and later steps share one compiled program)."""
  state = {"step": jnp.zeros((), jnp.int32), "params": params,
           "opt_state": jax.jit(optimizer.init)(params)}
  return jax.device_put(state, mesh_lib.replicated(mesh))


def to_global(sharding, value):
  """Process-local data -> a global array in ``sharding``. A value that is
  already a global array in that sharding (the GPU decoder's images,
  decoded on the devices that hold them) is kept as it is: it is not
  process-local data."""
  if isinstance(value, jax.Array) and value.sharding.is_equivalent_to(
      sharding, value.ndim):
    return value
  return jax.make_array_from_process_local_data(sharding, value)


def shard_batch(mesh, batch: dict):
  """Process-local batch -> global arrays sharded on "data"."""
  sharding = mesh_lib.rows(mesh)
  return {k: to_global(sharding, v) for k, v in batch.items()}

