"""A pretrained image tower from the files users have: one entry.

    from train.towers import pretrained
    tower = pretrained.load_image_tower(path)   # format and architecture
    emb = tower(images_uint8)                     # [B, S, S, 3] -> [B, D] f32

``path`` is a Hugging Face ``save_pretrained`` directory (CLIP, SigLIP), a
timm hub directory (``save_for_hf``), an OpenCLIP hub directory, or a
big_vision ViT ``.npz``; the format and the architecture are inferred from
the files (``train.towers.convert_*``). The tower applies the checkpoint's
own normalisation on the device to uint8 pixels, already at
``tower.image_size`` (resizing and cropping belong to the data pipeline),
and its embedding is the checkpoint's own image embedding.
"""
from __future__ import annotations

import os

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from train.towers import checkpoint_io as io
from train.towers import convert_big_vision
from train.towers import convert_hf
from train.towers import convert_open_clip
from train.towers import convert_timm
from train.towers import vit as vit_lib
from train.towers.tower import Normalization
from train.towers.tower import Tower

CheckpointError = io.CheckpointError

# In order: the first whose files are there reads the path.
_FORMATS = (("open_clip", convert_open_clip), ("timm", convert_timm),
            ("hf", convert_hf), ("big_vision", convert_big_vision))


def check_checkpoint(path: str):
  """The format module that reads ``path``, found from its file names alone
  (no weights are read): the cheap check a config gets before any work.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    CheckpointError: nothing there looks like a checkpoint of a known format.
  """
  path = os.path.expanduser(os.fspath(path))
  if not os.path.exists(path):
    raise FileNotFoundError(f"image tower checkpoint not found: {path}")
  for _, fmt in _FORMATS:
    if fmt.detect(path):
      return fmt
  what = ("a directory with open_clip_config.json (OpenCLIP), or "
          "config.json with 'architecture' (timm) or 'model_type' (Hugging "
          "Face), plus safetensors weights; or a big_vision .npz")
  found = sorted(os.listdir(path))[:6] if os.path.isdir(path) else "a file"
  raise CheckpointError(f"{path}: no recognisable image tower checkpoint "
                        f"(expected {what}; found {found})")


def convert(path: str) -> io.Converted:
  """The checkpoint at ``path`` in our ViT's layout, at its own size."""
  path = os.path.expanduser(os.fspath(path))
  return check_checkpoint(path).load(path)


def load_image_tower(path: str, *, image_size: int | None = None,
                     dtype=jnp.float32) -> Tower:
  """Loads a pretrained image tower (see the module docstring).

  Args:
    path: the checkpoint directory or .npz.
    image_size: the input size; None = the checkpoint's own. Another size
      resamples the position embeddings (bilinear over the patch grid, the
      class token's kept); it must be a multiple of the patch size.
    dtype: the compute dtype (params stay float32).

  Raises:
    FileNotFoundError: ``path`` does not exist.
    CheckpointError (a ValueError): unreadable files, an unrecognised
      layout, missing/unexpected names or shapes that do not fit; one line
      naming the path and what was expected.
  """
  path = os.path.expanduser(os.fspath(path))
  conv = convert(path)
  size = int(image_size or conv.image_size)
  patch = conv.vit["patch_size"]
  if size % patch:
    raise CheckpointError(f"{path}: image_size {size} is not a multiple of the "
                          f"patch size {patch} ({conv.arch})")
  params = conv.params
  prefix = 1 if conv.vit.get("class_token") and conv.vit.get(
      "pos_embed_cls") else 0
  params["pos_embedding"] = vit_lib.resample_pos_embedding(
      params["pos_embedding"], prefix, size // patch,
      where=f"{path} pos_embedding")
  module = vit_lib.ViT(**conv.vit, dtype=dtype)
  flat = flax.traverse_util.flatten_dict(params, sep="/")
  try:
    expected = flax.traverse_util.flatten_dict(jax.eval_shape(
        lambda: module.init(jax.random.key(0),
                            jnp.zeros((1, size, size, 3))))["params"], sep="/")
  except ValueError as e:  # E.g. a width the inferred head count misfits.
    raise CheckpointError(f"{path} ({conv.arch}): {e}") from None
  io.check_shapes(path, conv.arch, flat, {k: v.shape
                                          for k, v in expected.items()})
  params = flax.traverse_util.unflatten_dict(
      {k: jnp.asarray(np.asarray(v, np.float32)) for k, v in flat.items()},
      sep="/")
  return Tower(module=module, params=params, image_size=size,
               normalization=Normalization(tuple(conv.mean),
                                           tuple(conv.std)),
               embed_dim=int(conv.vit.get("embed_dim") or conv.vit["width"]),
               dtype=dtype, source=f"{path} ({conv.fmt}: {conv.arch})")


def load_text_tower(path: str):
  """(TextTransformer kwargs, params) of an HF CLIP directory's text tower."""
  path = os.path.expanduser(os.fspath(path))
  if not os.path.exists(path):
    raise FileNotFoundError(f"text tower checkpoint not found: {path}")
  if not convert_hf.detect(path):
    raise CheckpointError(f"{path}: not a Hugging Face CLIP directory "
                          "(config.json with model_type 'clip' or "
                          "'clip_text_model', and model.safetensors)")
  return convert_hf.load_clip_text(path)
