"""big_vision ViT ``.npz`` checkpoints (ViT classifiers, LiT and SigLIP).

Names are those of big_vision's ``models/vit.py``, "/"-joined, optionally
under ``params/`` and, for two-tower (LiT, SigLIP) checkpoints, ``img/``
(the text tower, ``txt/``, and the temperature/bias are ignored):
``embedding/{kernel,bias}``, ``cls``, ``pos_embedding``,
``Transformer/encoderblock_{i}/`` (or the scanned ``encoderblock/`` with a
leading depth axis) with ``LayerNorm_0``, ``MultiHeadDotProductAttention_0/
{query,key,value,out}``, ``LayerNorm_1``, ``MlpBlock_0/Dense_{0,1}``, then
``Transformer/encoder_norm``, ``MAPHead_0/...`` and ``head``.

The embedding: a classifier's pre-logits (its ``head`` is dropped); a
two-tower image tower keeps its ``head`` (the projection into the shared
space) when it has one. big_vision position embeddings cover the patches
only (the class token is added after them); activations are tanh-GELU;
pixels are scaled to [-1, 1].
"""
from __future__ import annotations

import os

import numpy as np

from train.towers import checkpoint_io as io

_BLOCK = "Transformer/encoderblock"


def detect(path: str) -> bool:
  return os.path.isfile(path) and path.endswith(".npz")


def _root(names) -> tuple[str, bool]:
  """(prefix of the image tower, whether it is a two-tower checkpoint)."""
  for prefix, two in (("params/img/", True), ("img/", True),
                      ("params/", False), ("", False)):
    if any(n.startswith(prefix + "embedding/") for n in names):
      return prefix, two
  return "", False


def _mha(t: io.Tensors, p: str, cross: bool, layer=None) -> dict | None:
  def take(name):
    a = t.take(f"{p}/{name}")
    return a if a is None or layer is None else a[layer]
  q = [take(f"{n}/kernel") for n in ("query", "key", "value")]
  qb = [take(f"{n}/bias") for n in ("query", "key", "value")]
  out = {"out": {"kernel": take("out/kernel"), "bias": take("out/bias")}}
  if any(a is None for a in q + qb) or out["out"]["kernel"] is None:
    return None
  if cross:
    out["q"] = {"kernel": q[0], "bias": qb[0]}
    out["kv"] = {"kernel": np.stack(q[1:], axis=1),
                 "bias": np.stack(qb[1:], axis=0)}
  else:
    out["qkv"] = {"kernel": np.stack(q, axis=1), "bias": np.stack(qb, axis=0)}
  return out


def _params(t, p, names, layer=None):
  """{name: the tensor p/name} for each of ``names`` (taken in order), of
  one ``layer`` of a scanned stack; None if one is missing."""
  got = [t.take(f"{p}/{name}") for name in names]
  if any(x is None for x in got):
    return None
  return {name: x if layer is None else x[layer]
          for name, x in zip(names, got)}


def _ln(t, p, layer=None):
  return _params(t, p, ("scale", "bias"), layer)


def _dense(t, p, layer=None):
  return _params(t, p, ("kernel", "bias"), layer)


def load(path: str) -> io.Converted:
  if not os.path.isfile(path):
    raise io.CheckpointError(f"{path}: no such file")
  tensors = io.read_npz(path)
  root, two_tower = _root(tensors)
  if root + "embedding/kernel" not in tensors:
    raise io.CheckpointError(
        f"{path}: no {root or ''}embedding/kernel: not a big_vision ViT .npz "
        f"(first names: {', '.join(sorted(tensors)[:4])})")
  r = root
  kernel = tensors[r + "embedding/kernel"]
  patch, width = int(kernel.shape[0]), int(kernel.shape[-1])
  scanned = f"{r}{_BLOCK}/LayerNorm_0/scale" in tensors
  if scanned:
    depth = int(tensors[f"{r}{_BLOCK}/LayerNorm_0/scale"].shape[0])
    heads_of = tensors[
        f"{r}{_BLOCK}/MultiHeadDotProductAttention_0/query/kernel"]
    heads = int(heads_of.shape[-2])
  else:
    depth = 1 + max((int(n[len(r + _BLOCK) + 1:].split("/")[0])
                     for n in tensors if n.startswith(r + _BLOCK + "_")),
                    default=-1)
    q = f"{r}{_BLOCK}_0/MultiHeadDotProductAttention_0/query/kernel"
    if q not in tensors:
      raise io.CheckpointError(f"{path}: no {q}: not a big_vision ViT")
    heads = int(tensors[q].shape[-2])
  pool = ("map" if any(n.startswith(r + "MAPHead_0/") for n in tensors) else
          "tok" if r + "cls" in tensors else "gap")
  keep_head = two_tower and r + "head/kernel" in tensors
  arch = (f"big_vision ViT: width {width}, depth {depth}, {heads} heads, "
          f"patch {patch}, pool {pool}"
          + (", scanned" if scanned else "")
          + (", two-tower image tower" if two_tower else ""))
  t = io.Tensors(tensors, path, arch)
  blocks = {}
  for i in range(depth):
    p, layer = ((f"{r}{_BLOCK}", i) if scanned else (f"{r}{_BLOCK}_{i}", None))
    blocks[f"block{i}"] = {
        "norm1": _ln(t, f"{p}/LayerNorm_0", layer),
        "attn": _mha(t, f"{p}/MultiHeadDotProductAttention_0", False, layer),
        "norm2": _ln(t, f"{p}/LayerNorm_1", layer),
        "mlp": {"fc1": _dense(t, f"{p}/MlpBlock_0/Dense_0", layer),
                "fc2": _dense(t, f"{p}/MlpBlock_0/Dense_1", layer)}}
  params = {
      "embedding": {"kernel": t.take(r + "embedding/kernel"),
                    "bias": t.take(r + "embedding/bias")},
      "pos_embedding": t.take(r + "pos_embedding"),
      "encoder": blocks,
      "norm": _ln(t, r + "Transformer/encoder_norm"),
  }
  if pool == "tok":
    params["cls"] = t.take(r + "cls")
  if pool == "map":
    m = r + "MAPHead_0"
    params["map_head"] = {
        "probe": t.take(f"{m}/probe"),
        "attn": _mha(t, f"{m}/MultiHeadDotProductAttention_0", True),
        "norm": _ln(t, f"{m}/LayerNorm_0"),
        "mlp": {"fc1": _dense(t, f"{m}/MlpBlock_0/Dense_0"),
                "fc2": _dense(t, f"{m}/MlpBlock_0/Dense_1")}}
  embed_dim = 0
  if keep_head:
    params["head"] = _dense(t, r + "head")
    embed_dim = int(tensors[r + "head/kernel"].shape[-1])
  # A classifier's head is dropped (pre-logits wanted); in a two-tower
  # checkpoint everything outside the image tower is ignored.
  ignore = [r + "head/"] + ([k for k in tensors if not k.startswith(r)]
                            if two_tower else [])
  t.finish(ignore)
  mlp_dim = int(params["encoder"]["block0"]["mlp"]["fc1"]["kernel"].shape[-1])
  vit = dict(patch_size=patch, width=width, depth=depth, num_heads=heads,
             mlp_dim=mlp_dim, embed_dim=embed_dim, head_bias=True,
             patch_bias=True, class_token=pool == "tok", pos_embed_cls=False,
             pre_norm=False, pool=pool, final_norm="tokens", act="gelu_tanh",
             ln_eps=1e-6, qkv_bias=True)
  grid = int(round(params["pos_embedding"].shape[1] ** 0.5))
  return io.Converted(vit=vit, params=params, mean=(0.5,) * 3,
                      std=(0.5,) * 3, image_size=grid * patch,
                      fmt="big_vision", arch=arch)
