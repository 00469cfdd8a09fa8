"""OpenCLIP visual towers as their hub directories hold them.

A directory holds ``open_clip_config.json`` (``model_cfg`` with
``vision_cfg`` and ``quick_gelu``; ``preprocess_cfg`` with ``mean``/``std``)
and ``open_clip_model.safetensors`` (the whole model's state dict; only
``visual.*`` is read). The embedding is ``encode_image`` (unnormalised):
``ln_post`` then the class token (or the patch mean, ``pool_type="avg"``)
times ``visual.proj``. Towers built on a timm trunk (``timm_model_name``)
and attentional pooling are refused by name.
"""
from __future__ import annotations

import os

import numpy as np

from train.towers import checkpoint_io as io
from train.towers.convert_hf import OPENAI_MEAN
from train.towers.convert_hf import OPENAI_STD

CONFIG = "open_clip_config.json"
WEIGHTS = "open_clip_model.safetensors"


def detect(path: str) -> bool:
  return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def load(path: str) -> io.Converted:
  cfg_path = os.path.join(path, CONFIG)
  cfg = io.read_json(cfg_path)
  mc = cfg.get("model_cfg") or {}
  vc = mc.get("vision_cfg")
  if not isinstance(vc, dict):
    raise io.CheckpointError(f"{cfg_path}: no model_cfg.vision_cfg")
  for key in ("timm_model_name", "attentional_pool"):
    if vc.get(key):
      raise io.CheckpointError(
          f"{cfg_path}: vision_cfg.{key}={vc[key]!r} is not read (only "
          "OpenCLIP's own VisionTransformer)")
  f = os.path.join(path, WEIGHTS)
  if not os.path.isfile(f):
    raise io.CheckpointError(
        f"{path}: no {WEIGHTS} (the pickled open_clip_pytorch_model.bin is "
        "not read)")
  tensors = io.read_safetensors(f)
  width = int(vc.get("width", 768))
  heads = width // int(vc.get("head_width", 64))
  patch = int(vc.get("patch_size", 16))
  pool = vc.get("pool_type", "tok")
  if pool not in ("tok", "avg"):
    raise io.CheckpointError(f"{cfg_path}: vision_cfg.pool_type {pool!r} is "
                             "not one of ['avg', 'tok']")
  depth = 1 + max((int(k.split(".")[3]) for k in tensors
                   if k.startswith("visual.transformer.resblocks.")),
                  default=-1)
  act = "quick_gelu" if mc.get("quick_gelu") else "gelu"
  arch = (f"OpenCLIP ViT: width {width}, depth {depth}, {heads} heads, "
          f"patch {patch}, pool {pool}, act {act}")
  io.check_heads(cfg_path, arch, width, heads)
  t = io.Tensors(tensors, f, arch)
  blocks = io.torch_blocks(t, heads, depth, "visual.transformer.resblocks.", {
      "qkv_w": "attn.in_proj_weight", "qkv_b": "attn.in_proj_bias",
      "out": "attn.out_proj", "norm1": "ln_1", "norm2": "ln_2",
      "fc1": "mlp.c_fc", "fc2": "mlp.c_proj", "ls1": "ls_1.gamma",
      "ls2": "ls_2.gamma"})
  cls = t.take("visual.class_embedding")
  pos = t.take("visual.positional_embedding")
  proj = t.take("visual.proj")
  params = {
      "embedding": io.torch_conv(t.take("visual.conv1.weight")),
      "encoder": blocks,
      "norm": io.torch_norm(t.take("visual.ln_post.weight"),
                            t.take("visual.ln_post.bias")),
  }
  if not vc.get("no_ln_pre"):
    params["pre_norm"] = io.torch_norm(t.take("visual.ln_pre.weight"),
                                       t.take("visual.ln_pre.bias"))
  t.finish(ignore_prefixes=tuple(
      k for k in {n.split(".")[0] for n in tensors} if k != "visual"))
  params["cls"] = cls.reshape(1, 1, -1)
  params["pos_embedding"] = pos[None]
  # x @ proj: proj is [width, embed] already, a Dense kernel.
  params["head"] = {"kernel": np.ascontiguousarray(proj)}
  vit = dict(patch_size=patch, width=width, depth=depth, num_heads=heads,
             mlp_dim=int(blocks["block0"]["mlp"]["fc1"]["kernel"].shape[1]),
             embed_dim=int(proj.shape[1]), head_bias=False, patch_bias=False,
             class_token=True, pos_embed_cls=True,
             pre_norm="pre_norm" in params,
             pool="tok" if pool == "tok" else "gap",
             final_norm="pooled" if vc.get("final_ln_after_pool") else "tokens",
             act=act, ln_eps=1e-5, qkv_bias=True,
             layer_scale="ls1" in blocks["block0"])
  pp = cfg.get("preprocess_cfg") or {}
  mean, std = pp.get("mean", OPENAI_MEAN), pp.get("std", OPENAI_STD)
  grid = int(round((pos.shape[0] - 1) ** 0.5))
  return io.Converted(vit=vit, params=params, mean=mean, std=std,
                      image_size=grid * patch, fmt="open_clip", arch=arch)
