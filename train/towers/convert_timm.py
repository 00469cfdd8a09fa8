"""timm ViTs as their hub directories hold them (``timm.models.save_for_hf``).

A directory holds ``config.json`` (``architecture``, ``global_pool``,
``pretrained_cfg`` with ``mean``/``std``/``input_size``, and sometimes
``model_args``) and ``model.safetensors``. The embedding is the pooled
pre-logits, ``model(x)`` with ``num_classes=0``: the classifier ``head`` is
dropped. Read: class-token and GAP ViTs, MAP (``attn_pool``), pre-norm
(``norm_pre``), ``fc_norm``, layer scale, position embeddings with or
without the class token (``no_embed_class``), with or without qkv biases.

The head count is not in the tensors: it comes from ``model_args``, else
the size in the architecture name (timm's ViT sizes), else the width.
"""
from __future__ import annotations

import os

from train.towers import checkpoint_io as io

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# timm's ViT sizes: name -> heads; and width -> heads where the name says
# nothing.
_HEADS_BY_NAME = {"tiny": 3, "small": 6, "medium": 8, "base": 12, "large": 16,
                  "huge": 16, "giant": 16, "gigantic": 16, "so400m": 16}
_HEADS_BY_WIDTH = {192: 3, 384: 6, 512: 8, 768: 12, 1024: 16, 1152: 16,
                   1280: 16, 1408: 16, 1664: 16}


def detect(path: str) -> bool:
  f = os.path.join(path, "config.json")
  return (os.path.isdir(path) and os.path.isfile(f)
          and "architecture" in io.read_json(f))


def _heads(cfg: dict, width: int, where: str) -> int:
  args = cfg.get("model_args") or {}
  if "num_heads" in args:
    return int(args["num_heads"])
  arch = cfg.get("architecture", "")
  for part in arch.split("_"):
    if part in _HEADS_BY_NAME:
      return _HEADS_BY_NAME[part]
  if width in _HEADS_BY_WIDTH:
    return _HEADS_BY_WIDTH[width]
  raise io.CheckpointError(
      f"{where}: cannot tell the number of attention heads of {arch!r} "
      f"(width {width}): add \"model_args\": {{\"num_heads\": N}} to it")


def load(path: str) -> io.Converted:
  cfg_path = os.path.join(path, "config.json")
  cfg = io.read_json(cfg_path)
  arch_name = cfg.get("architecture", "")
  if not arch_name.startswith(("vit_", "deit")):
    raise io.CheckpointError(f"{cfg_path}: timm architecture {arch_name!r} is "
                             "not a ViT (only timm VisionTransformers are read)")
  f = os.path.join(path, "model.safetensors")
  if not os.path.isfile(f):
    raise io.CheckpointError(
        f"{path}: no model.safetensors (pickled pytorch_model.bin is not "
        "read: save_for_hf(..., safe_serialization=True))")
  tensors = io.read_safetensors(f)
  args = cfg.get("model_args") or {}
  probe = io.Tensors(tensors, f)
  if "pos_embed" not in probe or "patch_embed.proj.weight" not in probe:
    raise io.CheckpointError(f"{f}: no pos_embed / patch_embed.proj.weight: "
                             f"not a timm ViT ({arch_name})")
  width = int(tensors["pos_embed"].shape[-1])
  patch = int(tensors["patch_embed.proj.weight"].shape[-1])
  heads = _heads(cfg, width, cfg_path)
  depth = 1 + max(int(k.split(".")[1]) for k in tensors
                  if k.startswith("blocks."))
  class_token = "cls_token" in probe
  has_fc_norm = probe.has_prefix("fc_norm.")
  pool = cfg.get("global_pool", args.get("global_pool"))
  if pool is None:
    pool = ("map" if probe.has_prefix("attn_pool.") else
            "avg" if has_fc_norm or not class_token else "token")
  pools = {"token": "tok", "avg": "gap", "map": "map"}
  if pool not in pools:
    raise io.CheckpointError(f"{cfg_path}: global_pool {pool!r} is not one of "
                             f"{sorted(pools)}")
  n_pos = int(tensors["pos_embed"].shape[1])
  pos_embed_cls = class_token and int(round(n_pos ** 0.5)) ** 2 != n_pos
  # timm's CLIP ports with "quickgelu" in the name use quick-GELU, its SigLIP
  # ports tanh-GELU, the rest erf-GELU (or what model_args says).
  act = args.get("act_layer")
  if act is not None and act not in ("quick_gelu", "gelu_tanh", "gelu"):
    raise io.CheckpointError(f"{cfg_path}: model_args.act_layer {act!r} is not "
                             "one of gelu, gelu_tanh, quick_gelu")
  if act is None:
    act = ("quick_gelu" if "quickgelu" in arch_name else
           "gelu_tanh" if "_siglip" in arch_name else "gelu")
  eps = 1e-5 if "_clip_" in arch_name else 1e-6
  arch = (f"timm {arch_name}: width {width}, depth {depth}, {heads} heads, "
          f"patch {patch}, pool {pool}"
          + (", class token" if class_token else "")
          + (", fc_norm" if has_fc_norm else ""))
  io.check_heads(cfg_path, arch, width, heads)
  t = io.Tensors(tensors, f, arch)
  blocks = io.torch_blocks(t, heads, depth, "blocks.", {
      "qkv": "attn.qkv", "out": "attn.proj", "norm1": "norm1",
      "norm2": "norm2", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
      "ls1": "ls1.gamma", "ls2": "ls2.gamma"})
  params = {
      "embedding": io.torch_conv(
          t.take("patch_embed.proj.weight"),
          t.take("patch_embed.proj.bias")
          if "patch_embed.proj.bias" in t else None),
      "pos_embedding": t.take("pos_embed"),
      "encoder": blocks,
  }
  if class_token:
    params["cls"] = t.take("cls_token")
  if "norm_pre.weight" in t:
    params["pre_norm"] = io.torch_norm(t.take("norm_pre.weight"),
                                       t.take("norm_pre.bias"))
  norm = "fc_norm" if has_fc_norm else "norm"
  final_norm = "pooled" if has_fc_norm else "tokens"
  if norm + ".weight" in t:
    params["norm"] = io.torch_norm(t.take(norm + ".weight"),
                                   t.take(norm + ".bias"))
  else:
    final_norm = "none"
  if has_fc_norm and probe.has_prefix("norm."):
    t.missing.append("(both norm and fc_norm: not a timm ViT layout)")
  if pools[pool] == "map":
    q_w, kv_w = t.take("attn_pool.q.weight"), t.take("attn_pool.kv.weight")
    params["map_head"] = {
        "probe": t.take("attn_pool.latent"),
        "attn": {"q": io.torch_q(q_w, t.take("attn_pool.q.bias"), heads),
                 "kv": io.torch_qkv(kv_w, t.take("attn_pool.kv.bias"), heads,
                                    parts=2),
                 "out": io.torch_attn_out(t.take("attn_pool.proj.weight"),
                                          t.take("attn_pool.proj.bias"),
                                          heads)},
        "norm": io.torch_norm(t.take("attn_pool.norm.weight"),
                              t.take("attn_pool.norm.bias")),
        "mlp": {"fc1": io.torch_dense(t.take("attn_pool.mlp.fc1.weight"),
                                      t.take("attn_pool.mlp.fc1.bias")),
                "fc2": io.torch_dense(t.take("attn_pool.mlp.fc2.weight"),
                                      t.take("attn_pool.mlp.fc2.bias"))}}
  t.finish(ignore_prefixes=("head.",))  # The classifier: pre-logits wanted.
  ls = any("ls1" in b for b in blocks.values())
  vit = dict(patch_size=patch, width=width, depth=depth, num_heads=heads,
             mlp_dim=int(tensors["blocks.0.mlp.fc1.weight"].shape[0]),
             patch_bias="bias" in params["embedding"],
             class_token=class_token, pos_embed_cls=pos_embed_cls,
             pre_norm="pre_norm" in params, pool=pools[pool],
             final_norm=final_norm, act=act, ln_eps=eps,
             qkv_bias=io.qkv_bias_of(blocks["block0"]), layer_scale=ls)
  pc = cfg.get("pretrained_cfg") or {}
  mean, std = pc.get("mean", IMAGENET_MEAN), pc.get("std", IMAGENET_STD)
  grid = int(round((n_pos - (1 if pos_embed_cls else 0)) ** 0.5))
  return io.Converted(vit=vit, params=params, mean=mean, std=std,
                      image_size=grid * patch, fmt="timm", arch=arch)
