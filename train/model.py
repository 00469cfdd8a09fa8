"""The model of a config: the image tower, the text tower, the loss head and
their initial parameters.

Training (``train.train``) and the embedding precompute (``train.precompute``)
both build the locked image tower from here, so neither imports the other.
An own tower's ``config.model.image.pretrain_path`` is made first where it
is missing or was made by another recipe
(``train.pretrain_image_tower.make_current``); ``train.towers.build`` then
loads it.
"""
from __future__ import annotations

import dataclasses
import os

from absl import logging
import jax
import jax.numpy as jnp

from infcl_jax.block_sizes import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from train import pretrain_image_tower
from train.towers import build as towers_build
from train.towers import pretrained
from train.towers import tower as tower_lib


def check_checkpoints(config) -> None:
  """The checkpoints a config names exist and look like checkpoints (their
  file names only: no weights are read), with the loaders' own messages,
  e.g. "config.model.image.init: image tower checkpoint not found: PATH"."""
  ic = config.model.image
  if ic.init:
    path = os.path.expanduser(ic.init)
    if ic.kind == "pretrained":
      try:
        pretrained.check_checkpoint(path)
      except (FileNotFoundError, pretrained.CheckpointError) as e:
        raise type(e)(f"config.model.image.init: {e}") from None
    elif not os.path.exists(path):
      raise FileNotFoundError(f"config.model.image.init: image tower "
                              f"checkpoint not found: {path}")
  text = os.path.expanduser(config.model.text.init)
  if text and not os.path.exists(text):
    raise FileNotFoundError(f"config.model.text.init: text tower checkpoint "
                            f"not found: {text}")


def make_head(config, axis_name=None) -> ContrastiveLoss:
  """The loss head of ``config.loss`` (temperature, bias, loss, backend)."""
  lc = config.loss
  block_sizes = (BlockSizes(lc.block_q, lc.block_k) if lc.block_q > 0
                 else None)
  # group_mode only where groups are used: a run without them builds the
  # head it always did.
  extra = ({} if lc.get("groups", "none") == "none"
           else {"group_mode": lc.group_mode})
  return ContrastiveLoss(
      **extra, loss=lc.name, init_log_scale=lc.init_log_scale, use_bias=lc.use_bias,
      init_bias=lc.init_bias, min_log_scale=lc.min_log_scale,
      max_log_scale=lc.max_log_scale, backend=lc.backend,
      block_sizes=block_sizes, axis_name=axis_name)


def make_models(config, tokenizer):
  """(image ``Tower`` with its params, text module, loss head)."""
  dtype = jnp.dtype(config.model.dtype)
  # The first of init_params' three keys: a random own tower is initialised
  # as it always was.
  rng_img = jax.random.split(jax.random.key(config.seed), 3)[0]
  pretrain_image_tower.make_current(config)
  image_tower = towers_build.make_image_tower(config, dtype, rng_img)
  embed_dim = towers_build.image_embed_dim(config, image_tower)
  text_tower = towers_build.make_text_tower(config, tokenizer, embed_dim,
                                            dtype)
  return image_tower, text_tower, make_head(config)


def make_locked_tower(config, tokenizer) -> tower_lib.Tower:
  """The (locked) image tower of ``config``, loaded as training loads it."""
  image_tower, _, _ = make_models(config, tokenizer)
  return dataclasses.replace(image_tower,
                             params=jax.device_get(image_tower.params))


def init_params(config, image_tower, text_tower, head, tokenizer):
  """The image tower's params (loaded by ``make_models``), the text tower's
  (fresh, or from ``config.model.text.init``) and a fresh head."""
  _, rng_txt, rng_head = jax.random.split(jax.random.key(config.seed), 3)
  if config.model.text.init:
    _, txt = towers_build.text_init(config, tokenizer, image_tower.embed_dim)
    txt = jax.tree.map(jnp.asarray, txt)
    logging.info("text tower loaded from %s", config.model.text.init)
  else:
    txt = jax.jit(text_tower.init)(  # Jitted: see towers.build.
        rng_txt, jnp.ones((1, tokenizer.max_len), jnp.int32))["params"]
  e = jnp.zeros((2, text_tower.embed_dim))
  # A grouped head is called with groups (group_mode "positives" needs them).
  g = ({} if config.loss.groups == "none"
       else {"groups": jnp.arange(2, dtype=jnp.int32)})
  hp = jax.jit(head.init)(rng_head, e, e, **g)["params"]
  return {"img": image_tower.params, "txt": txt, "head": hp}
