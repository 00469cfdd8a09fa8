"""The towers of a config: ``config.model.image`` -> a ``Tower``,
``config.model.text`` -> a Flax text module (and its pretrained params).

``config.model.image.kind``:

- "pretrained": ``init`` is a checkpoint that ``train.towers.pretrained``
  reads (HF, timm, OpenCLIP, big_vision), loaded at
  ``config.data.image_size``;
- "cnn" / "vit": this project's own tower (``train.towers.own``), from the
  ``.npz`` at ``init``; with ``init`` empty, from ``pretrain_path`` (which
  the trainer first makes where it is missing or stale:
  ``train.pretrain_image_tower.make_current``), or, with neither,
  randomly initialised (tests and benchmarks only).

A path that is given and does not exist is always an error.
"""
from __future__ import annotations

import os

from absl import logging
import jax
import jax.numpy as jnp

from train.towers import own
from train.towers import pretrained
from train.towers import text as text_lib
from train.towers.tower import SYMMETRIC
from train.towers.tower import Tower


def image_embed_dim(config, tower: Tower) -> int:
  """The shared embedding size: the pretrained tower's own, or the config's."""
  want = config.model.embed_dim
  if config.model.image.kind == "pretrained":
    if want and want != tower.embed_dim:
      raise ValueError(
          f"config.model.embed_dim={want} but the pretrained image tower "
          f"{config.model.image.init} embeds into {tower.embed_dim} "
          "dimensions (set config.model.embed_dim=0: the tower's own)")
    return tower.embed_dim
  return want


def make_image_tower(config, dtype, rng=None) -> Tower:
  """The image tower of ``config.model.image`` with its params (``rng``: the
  key of a random own tower; default ``key(config.seed)``)."""
  ic = config.model.image
  s = config.data.image_size
  init = os.path.expanduser(ic.init)
  if ic.kind == "pretrained":
    if not init:
      raise ValueError("config.model.image.kind='pretrained' needs "
                       "config.model.image.init (a local checkpoint path)")
    tower = pretrained.load_image_tower(init, image_size=s, dtype=dtype)
    logging.info("image tower loaded from %s", tower.source)
    return _stored(tower, ic)
  module = own.make_module(ic, config.model.embed_dim, dtype)
  rng = jax.random.key(config.seed) if rng is None else rng
  # Jitted: one compiled program, not one per initializer's every eager op
  # (a run's start-up on CPU spent ~9 s compiling ~150 of those).
  params = jax.jit(module.init)(rng, jnp.zeros((1, s, s, 3)))["params"]
  source = "random"
  path = init or os.path.expanduser(ic.pretrain_path)
  if path:
    if not os.path.exists(path):
      raise FileNotFoundError(
          f"config.model.image.init: image tower checkpoint not found: {path} "
          "(make one with `python -m train.pretrain_image_tower --config "
          "<config> --out <path>`, or set config.model.image.pretrain_path "
          "instead of init to have the trainer make it)")
    params = own.load_npz(path, params)
    source = path
    logging.info("image tower loaded from %s", path)
  else:
    logging.warning("config.model.image.init is empty: the image tower is "
                    "randomly initialized")
  return _stored(Tower(module=module, params=params, image_size=s,
                       normalization=SYMMETRIC,
                       embed_dim=config.model.embed_dim, dtype=dtype,
                       source=source), ic)


def _stored(tower: Tower, ic) -> Tower:
  """``tower`` with its params as ``config.model.image.params_in_dtype``
  asks (a locked tower only; ``config_base.check`` says so)."""
  if ic.get("params_in_dtype", False) and ic.locked:
    return tower.with_params_in_dtype()
  return tower


def make_text_tower(config, tokenizer, embed_dim: int, dtype):
  """The text module of ``config.model.text``; from ``text.init`` (an HF
  CLIP directory) its architecture is the checkpoint's."""
  tc = config.model.text
  if tc.init:
    kwargs, _ = text_init(config, tokenizer, embed_dim)
    return text_lib.TextTransformer(**kwargs, dtype=dtype,
                                    remat=tc.get("remat", "none"))
  return text_lib.from_scratch(tc, tokenizer.vocab_size, tokenizer.max_len,
                               embed_dim, dtype, pad_id=tokenizer.pad_id,
                               eos_id=tokenizer.eos_id)


def text_init(config, tokenizer, embed_dim: int):
  """(kwargs, params) of the text tower in ``config.model.text.init``,
  checked against the tokenizer and the image tower's embedding size."""
  path = os.path.expanduser(config.model.text.init)
  kwargs, params = pretrained.load_text_tower(path)
  if kwargs["vocab_size"] != tokenizer.vocab_size:
    raise ValueError(
        f"config.model.text.init={path}: its vocabulary has "
        f"{kwargs['vocab_size'] - 2} tokens, the tokenizer "
        f"{tokenizer.vocab_size - 2} (use config.tokenizer.kind='clip_bpe' "
        "with the checkpoint's own vocabulary as bpe_path)")
  if tokenizer.max_len > kwargs["max_len"]:
    raise ValueError(f"config.tokenizer.max_len={tokenizer.max_len} is longer "
                     f"than the text tower's {kwargs['max_len']} positions "
                     f"({path})")
  if kwargs["embed_dim"] != embed_dim:
    raise ValueError(f"config.model.text.init={path} projects into "
                     f"{kwargs['embed_dim']} dimensions, the image tower into "
                     f"{embed_dim}")
  kwargs.update(pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
  return kwargs, params
