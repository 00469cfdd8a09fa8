"""Hugging Face ``save_pretrained`` directories: CLIP and SigLIP towers.

A directory holds ``config.json`` and ``model.safetensors`` (and usually
``preprocessor_config.json``). Read here:

- CLIP (``CLIPModel``, ``CLIPVisionModelWithProjection``, ``CLIPVisionModel``):
  the image embedding is ``get_image_features``: ``visual_projection`` of
  ``post_layernorm`` of the class token (``CLIPVisionModel`` has no
  projection: the pooled output).
- SigLIP (``SiglipModel``, ``SiglipVisionModel``): the MAP head's pooled
  output (``get_image_features``); the vision tower has no projection.
- The CLIP text tower (``CLIPModel``, ``CLIPTextModelWithProjection``), for
  ``text_tower``: causal attention, EOS pooling, ``text_projection``.

Normalisation: ``preprocessor_config.json``'s ``image_mean``/``image_std``,
else the family's default (OpenAI's for CLIP, 0.5 for SigLIP).
"""
from __future__ import annotations

import os

import numpy as np

from train.towers import checkpoint_io as io

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

# The transformers defaults of each vision config (a saved config may omit
# a key that equals its default).
_DEFAULTS = {
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, patch_size=32, hidden_act="quick_gelu",
                 layer_norm_eps=1e-5),
    "siglip": dict(hidden_size=768, intermediate_size=3072,
                   num_hidden_layers=12, num_attention_heads=12, patch_size=16,
                   hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
}
_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu",
         "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_FAMILY = {"clip": "clip", "clip_vision_model": "clip",
           "clip_text_model": "clip", "siglip": "siglip",
           "siglip_vision_model": "siglip"}


def detect(path: str) -> bool:
  return (os.path.isdir(path)
          and os.path.isfile(os.path.join(path, "config.json"))
          and "model_type" in io.read_json(os.path.join(path, "config.json")))


def _vision_config(path: str) -> tuple[str, dict, dict]:
  cfg_path = os.path.join(path, "config.json")
  cfg = io.read_json(cfg_path)
  model_type = cfg.get("model_type")
  family = _FAMILY.get(model_type)
  if family is None:
    raise io.CheckpointError(
        f"{cfg_path}: model_type {model_type!r} is not an image tower this "
        f"loader reads (known: {', '.join(sorted(_FAMILY))})")
  vision = cfg.get("vision_config", cfg) if model_type in ("clip", "siglip") \
      else cfg
  return family, {**_DEFAULTS[family], **vision}, cfg


def _weights(path: str) -> dict:
  f = os.path.join(path, "model.safetensors")
  if not os.path.isfile(f):
    others = sorted(n for n in os.listdir(path) if n.endswith(
        (".bin", ".pt", ".pth", ".safetensors", ".index.json")))
    raise io.CheckpointError(
        f"{path}: no model.safetensors (found {others or 'no weights'}; "
        "pickled .bin/.pt weights are not read: save with "
        "safe_serialization=True)")
  return io.read_safetensors(f)


def _normalization(path: str, family: str):
  pp = os.path.join(path, "preprocessor_config.json")
  if os.path.isfile(pp):
    cfg = io.read_json(pp)
    if "image_mean" in cfg and "image_std" in cfg:
      return cfg["image_mean"], cfg["image_std"]
  return (OPENAI_MEAN, OPENAI_STD) if family == "clip" else ((0.5,) * 3,
                                                             (0.5,) * 3)


def _encoder(t: io.Tensors, prefix: str, depth: int, heads: int) -> dict:
  """``prefix`` ends with "." (or is empty)."""
  return io.torch_blocks(t, heads, depth, f"{prefix}encoder.layers.", {
      "q": "self_attn.q_proj", "k": "self_attn.k_proj",
      "v": "self_attn.v_proj", "out": "self_attn.out_proj",
      "norm1": "layer_norm1", "norm2": "layer_norm2",
      "fc1": "mlp.fc1", "fc2": "mlp.fc2"})


def _depth(t: io.Tensors, prefix: str, configured: int) -> int:
  """The number of layers the tensors hold (the config's if none)."""
  ids = {int(k[len(prefix):].split(".")[0]) for k in t.tensors
         if k.startswith(prefix) and k[len(prefix):].split(".")[0].isdigit()}
  return max(ids) + 1 if ids else configured


def load(path: str) -> io.Converted:
  family, vc, _ = _vision_config(path)
  tensors = _weights(path)
  f = os.path.join(path, "model.safetensors")
  heads = int(vc["num_attention_heads"])
  act = _ACTS.get(vc["hidden_act"])
  if act is None:
    raise io.CheckpointError(f"{path}/config.json: hidden_act "
                             f"{vc['hidden_act']!r} is not one of {sorted(_ACTS)}")
  # transformers 5 saves a bare vision model (SiglipVisionModel) without
  # the "vision_model." prefix; the two-tower models and older versions
  # with it.
  pv = ("vision_model." if io.Tensors(tensors, f).has_prefix("vision_model.")
        else "")
  depth = _depth(io.Tensors(tensors, f), f"{pv}encoder.layers.",
                 int(vc["num_hidden_layers"]))
  arch = (f"HF {family} vision tower: width {vc['hidden_size']}, depth "
          f"{depth}, {heads} heads, patch {vc['patch_size']}, act "
          f"{vc['hidden_act']}")
  io.check_heads(path, arch, int(vc["hidden_size"]), heads)
  t = io.Tensors(tensors, f, arch)
  e = f"{pv}embeddings"
  params = {
      "embedding": io.torch_conv(t.take(f"{e}.patch_embedding.weight"),
                                 t.take(f"{e}.patch_embedding.bias")
                                 if family == "siglip" else None),
      "encoder": _encoder(t, pv, depth, heads),
      "norm": io.torch_norm(t.take(f"{pv}post_layernorm.weight"),
                            t.take(f"{pv}post_layernorm.bias")),
  }
  pos = t.take(f"{e}.position_embedding.weight")
  if pos is not None:
    params["pos_embedding"] = pos[None]
  vit = dict(patch_size=int(vc["patch_size"]),
             width=int(vc["hidden_size"]), depth=depth, num_heads=heads,
             mlp_dim=int(vc["intermediate_size"]), act=act,
             ln_eps=float(vc["layer_norm_eps"]), qkv_bias=True)
  if family == "clip":
    params["cls"] = _reshape(t.take(f"{e}.class_embedding"), (1, 1, -1))
    params["pre_norm"] = io.torch_norm(t.take(f"{pv}pre_layrnorm.weight"),
                                       t.take(f"{pv}pre_layrnorm.bias"))
    vit.update(class_token=True, pos_embed_cls=True, pre_norm=True,
               pool="tok", final_norm="pooled", patch_bias=False)
    if "visual_projection.weight" in t:
      w = t.take("visual_projection.weight")
      params["head"] = io.torch_dense(w)
      vit.update(embed_dim=int(w.shape[0]), head_bias=False)
    ignore = ("text_model.", "text_projection.", "logit_scale")
  else:
    h = f"{pv}head"
    w_in, b_in = t.take(f"{h}.attention.in_proj_weight"), t.take(
        f"{h}.attention.in_proj_bias")
    d = int(vc["hidden_size"])
    mh = {"probe": t.take(f"{h}.probe"),
          "norm": io.torch_norm(t.take(f"{h}.layernorm.weight"),
                                t.take(f"{h}.layernorm.bias")),
          "mlp": {"fc1": io.torch_dense(t.take(f"{h}.mlp.fc1.weight"),
                                        t.take(f"{h}.mlp.fc1.bias")),
                  "fc2": io.torch_dense(t.take(f"{h}.mlp.fc2.weight"),
                                        t.take(f"{h}.mlp.fc2.bias"))}}
    if w_in is not None and b_in is not None:
      mh["attn"] = {
          "q": io.torch_q(w_in[:d], b_in[:d], heads),
          "kv": io.torch_qkv(w_in[d:], b_in[d:], heads, parts=2),
          "out": io.torch_attn_out(t.take(f"{h}.attention.out_proj.weight"),
                                   t.take(f"{h}.attention.out_proj.bias"),
                                   heads)}
    params["map_head"] = mh
    vit.update(class_token=False, pool="map", final_norm="tokens")
    ignore = ("text_model.", "logit_scale", "logit_bias")
  t.finish(ignore)
  grid = int(round((params["pos_embedding"].shape[1]
                    - (1 if family == "clip" else 0)) ** 0.5))
  mean, std = _normalization(path, family)
  return io.Converted(vit=vit, params=params, mean=mean, std=std,
                      image_size=grid * vit["patch_size"],
                      fmt=f"hf-{family}", arch=arch)


def _reshape(a, shape):
  return None if a is None else a.reshape(shape)


def load_clip_text(path: str) -> tuple[dict, dict]:
  """The CLIP text tower of an HF directory -> (TextTransformer kwargs,
  params), with our token ids: ours are the CLIP ids + 2 (0 = pad and
  1 = EOS stay reserved, ``tokenizer.ClipBpeTokenizer``), so the
  embedding table gains two rows in front: zeros for pad (only ever seen
  after EOS, which causal attention ignores) and a copy of the CLIP
  ``<|endoftext|>`` row for our EOS.
  """
  cfg_path = os.path.join(path, "config.json")
  cfg = io.read_json(cfg_path)
  if cfg.get("model_type") == "clip":
    tc = cfg.get("text_config", {})
  elif cfg.get("model_type") == "clip_text_model":
    tc = cfg
  else:
    raise io.CheckpointError(f"{cfg_path}: model_type "
                             f"{cfg.get('model_type')!r} has no CLIP text tower")
  tc = {**dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
               num_attention_heads=8, hidden_act="quick_gelu",
               layer_norm_eps=1e-5, eos_token_id=49407), **tc}
  tensors = _weights(path)
  f = os.path.join(path, "model.safetensors")
  heads = int(tc["num_attention_heads"])
  pt = ("text_model." if io.Tensors(tensors, f).has_prefix("text_model.")
        else "")
  depth = _depth(io.Tensors(tensors, f), f"{pt}encoder.layers.",
                 int(tc["num_hidden_layers"]))
  arch = (f"HF CLIP text tower: width {tc['hidden_size']}, depth {depth}, "
          f"{heads} heads")
  io.check_heads(path, arch, int(tc["hidden_size"]), heads)
  t = io.Tensors(tensors, f, arch)
  tok = t.take(f"{pt}embeddings.token_embedding.weight")
  pos = t.take(f"{pt}embeddings.position_embedding.weight")
  proj = t.take("text_projection.weight")
  params = {
      "encoder": _encoder(t, pt, depth, heads),
      "norm": io.torch_norm(t.take(f"{pt}final_layer_norm.weight"),
                            t.take(f"{pt}final_layer_norm.bias")),
  }
  t.finish(("vision_model.", "visual_projection.", "logit_scale"))
  eos = int(tc["eos_token_id"])
  if eos == 2:  # Old configs: EOS is the largest id (<|endoftext|>).
    eos = tok.shape[0] - 1
  params["token_embedding"] = {"embedding": np.concatenate(
      [np.zeros_like(tok[:1]), tok[eos:eos + 1], tok], axis=0)}
  params["pos_embedding"] = pos[None]
  params["head"] = io.torch_dense(proj)
  kwargs = dict(vocab_size=tok.shape[0] + 2, max_len=pos.shape[0],
                width=int(tc["hidden_size"]), depth=depth, num_heads=heads,
                mlp_dim=int(tc["intermediate_size"]),
                embed_dim=int(proj.shape[0]), pool="eos",
                act=_ACTS[tc["hidden_act"]],
                ln_eps=float(tc["layer_norm_eps"]), head_bias=False)
  return kwargs, params
