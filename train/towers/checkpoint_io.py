"""Reading checkpoint files as plain tensors, and the torch -> Flax layouts.

The one home for what every converter (``convert_*.py``) shares:

- ``read_safetensors`` / ``read_npz`` / ``read_json``: tensors through the
  ``safetensors`` numpy API (never unpickled), ``.npz`` with
  ``allow_pickle=False``; each failure is one ``CheckpointError`` line naming
  the file and what was expected.
- ``Tensors``: a name -> array table that records which names a converter
  used, so a converter ends with one line naming the first missing and
  unexpected names and the architecture it inferred.
- ``torch_*``: a torch ``Linear``/``Conv2d``/``LayerNorm``/attention weight
  in the Flax layout of ``train.towers.layers``.
"""
from __future__ import annotations

import json
import os
import zipfile

import numpy as np
from safetensors import safe_open
from safetensors import SafetensorError


class CheckpointError(ValueError):
  """A checkpoint that cannot be read as the architecture it claims."""


def _first(names, n=4) -> str:
  names = sorted(names)
  return ", ".join(names[:n]) + (f", ... ({len(names)} in all)"
                                 if len(names) > n else "")


def read_json(path: str) -> dict:
  try:
    with open(path) as f:
      out = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}: not a readable JSON file ({e})") from None
  if not isinstance(out, dict):
    raise CheckpointError(f"{path}: expected a JSON object, got "
                          f"{type(out).__name__}")
  return out


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of a .safetensors file as numpy arrays (bf16 included)."""
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: no such file")
  try:
    with safe_open(path, framework="np") as f:
      return {k: f.get_tensor(k) for k in f.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise CheckpointError(
        f"{path}: not a readable safetensors file (truncated or not "
        f"safetensors?): {str(e).splitlines()[0]}") from None


def read_npz(path: str) -> dict[str, np.ndarray]:
  """All arrays of an .npz (``allow_pickle=False``: arrays of objects fail)."""
  try:
    with np.load(path, allow_pickle=False) as f:
      return {k: f[k] for k in f.files}
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
    raise CheckpointError(f"{path}: not a readable .npz of arrays (truncated, "
                          f"or pickled objects?): {e}") from None


class Tensors:
  """A checkpoint's tensors; ``take`` marks a name used, ``finish`` checks.

  Args:
    tensors: name -> array.
    path: the file, for messages.
    arch: a short description of the inferred architecture, for messages.
  """

  def __init__(self, tensors: dict, path: str, arch: str = ""):
    self.tensors, self.path, self.arch = tensors, path, arch
    self.used: set[str] = set()
    self.missing: list[str] = []

  def __contains__(self, name):
    return name in self.tensors

  def has_prefix(self, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in self.tensors)

  def take(self, name: str):
    """The array ``name`` as float32 (None, noted as missing, if absent)."""
    if name not in self.tensors:
      self.missing.append(name)
      return None
    self.used.add(name)
    return np.asarray(self.tensors[name]).astype(np.float32)

  def finish(self, ignore_prefixes=()) -> None:
    """One-line error if names were missing or not used (except ignored)."""
    unexpected = [k for k in self.tensors if k not in self.used
                  and not k.startswith(tuple(ignore_prefixes))]
    if self.missing or unexpected:
      parts = []
      if self.missing:
        parts.append(f"missing {_first(self.missing)}")
      if unexpected:
        parts.append(f"unexpected {_first(unexpected)}")
      raise CheckpointError(f"{self.path}: does not match the inferred "
                            f"architecture ({self.arch}): "
                            + "; ".join(parts))


def check_heads(path: str, arch: str, width: int, heads: int) -> None:
  if heads < 1 or width % heads:
    raise CheckpointError(f"{path} ({arch}): width {width} is not divisible "
                          f"by num_heads {heads}")


def check_shapes(path: str, arch: str, params: dict, expected: dict) -> None:
  """Flat params vs the module's flat shapes: one line for the first misfit."""
  missing = sorted(set(expected) - set(params))
  extra = sorted(set(params) - set(expected))
  if missing or extra:
    raise CheckpointError(f"{path} ({arch}): converted params do not fit the "
                          f"module: missing {_first(missing)}; unexpected "
                          f"{_first(extra)}")
  for k in sorted(expected):
    if tuple(params[k].shape) != tuple(expected[k]):
      raise CheckpointError(
          f"{path} ({arch}): {k} has shape {tuple(params[k].shape)} in the "
          f"checkpoint, the architecture wants {tuple(expected[k])}")


# --------------------------------------------------- torch -> Flax layouts
# torch Linear: weight [out, in], y = x W^T + b. Flax Dense: kernel [in, out].


# Each returns None for a missing weight (``Tensors.finish`` names it).


def torch_dense(w, b=None) -> dict | None:
  if w is None:
    return None
  out = {"kernel": np.ascontiguousarray(w.T)}
  if b is not None:
    out["bias"] = b
  return out


def torch_norm(w, b) -> dict | None:
  if w is None or b is None:
    return None
  return {"scale": w, "bias": b}


def torch_conv(w, b=None) -> dict:
  """Conv2d weight [out, in, kh, kw] -> Flax Conv kernel [kh, kw, in, out]."""
  if w is None:
    return None
  out = {"kernel": np.ascontiguousarray(w.transpose(2, 3, 1, 0))}
  if b is not None:
    out["bias"] = b
  return out


def torch_qkv(w, b, num_heads: int, parts: int = 3) -> dict:
  """Stacked projections [parts * D, D] (+ bias) -> DenseGeneral kernel
  [D, parts, H, D/H] (bias [parts, H, D/H]): layers.Attention's ``qkv``
  (or ``kv`` with parts=2)."""
  if w is None:
    return None
  d_in = w.shape[1]
  d = w.shape[0] // parts
  k = w.reshape(parts, d, d_in).transpose(2, 0, 1)
  out = {"kernel": np.ascontiguousarray(
      k.reshape(d_in, parts, num_heads, d // num_heads))}
  if b is not None:
    out["bias"] = b.reshape(parts, num_heads, d // num_heads)
  return out


def torch_q(w, b, num_heads: int) -> dict:
  out = torch_qkv(w, b, num_heads, parts=1)
  if out is None:
    return None
  out["kernel"] = out["kernel"][:, 0]
  if "bias" in out:
    out["bias"] = out["bias"][0]
  return out


def torch_attn_out(w, b, num_heads: int) -> dict:
  """Output projection [D, D] -> DenseGeneral kernel [H, D/H, D]."""
  if w is None:
    return None
  d = w.shape[0]
  return {"kernel": np.ascontiguousarray(
      w.T.reshape(num_heads, w.shape[1] // num_heads, d)), "bias": b}


def cat(*arrays):
  """Concatenates along axis 0; None if any part is missing."""
  if any(a is None for a in arrays):
    return None
  return np.concatenate(arrays, axis=0)


def torch_block(t: Tensors, num_heads: int, names: dict) -> dict:
  """One pre-LN transformer block in torch names -> ``layers.Block`` params.

  ``names`` maps our parts to the checkpoint's full names: norm1, norm2
  (prefixes of .weight/.bias), fc1, fc2, out (Linear prefixes), and either
  ``qkv`` (one fused Linear prefix, or ``in_proj`` of nn.MultiheadAttention:
  give its weight and bias names as ``qkv_w``/``qkv_b``) or ``q``/``k``/``v``
  (three Linear prefixes); optional ``ls1``/``ls2`` (layer-scale names).
  """
  def lin(prefix):
    return t.take(prefix + ".weight"), (t.take(prefix + ".bias")
                                        if prefix + ".bias" in t else None)
  if "q" in names:
    (wq, bq), (wk, bk), (wv, bv) = (lin(names[n]) for n in "qkv")
    w = cat(wq, wk, wv)
    b = None if bq is None else cat(bq, bk, bv)
  elif "qkv_w" in names:
    w = t.take(names["qkv_w"])
    b = t.take(names["qkv_b"]) if names["qkv_b"] in t else None
  else:
    w, b = lin(names["qkv"])
  wo, bo = lin(names["out"])
  out = {
      "norm1": torch_norm(t.take(names["norm1"] + ".weight"),
                          t.take(names["norm1"] + ".bias")),
      "norm2": torch_norm(t.take(names["norm2"] + ".weight"),
                          t.take(names["norm2"] + ".bias")),
      "mlp": {"fc1": torch_dense(*lin(names["fc1"])),
              "fc2": torch_dense(*lin(names["fc2"]))},
  }
  if w is not None and wo is not None:
    out["attn"] = {"qkv": torch_qkv(w, b, num_heads),
                   "out": torch_attn_out(wo, bo, num_heads)}
  for ls in ("ls1", "ls2"):
    if names.get(ls) and names[ls] in t:
      out[ls] = t.take(names[ls])
  return out


def torch_blocks(t: Tensors, num_heads: int, depth: int, prefix: str,
                 parts: dict) -> dict:
  """``{"block{i}": torch_block(...)}`` of ``depth`` blocks, block i's
  names ``{prefix}{i}.{part}``: ``parts`` maps torch_block's names to each
  block's own (``{"fc1": "mlp.fc1", ...}``)."""
  return {f"block{i}": torch_block(t, num_heads, {
      name: f"{prefix}{i}.{part}" for name, part in parts.items()})
          for i in range(depth)}


def qkv_bias_of(block_params: dict) -> bool:
  return "bias" in block_params.get("attn", {}).get("qkv", {})


# --------------------------------------------------- a converter's result


class Converted:
  """What a converter returns: enough to build the ``ViT`` and its Tower.

  Attributes:
    vit: keyword arguments of ``train.towers.vit.ViT`` (no dtype).
    params: the nested Flax params at the checkpoint's own grid.
    mean, std: the checkpoint's normalisation, [0, 1] units.
    image_size: the checkpoint's native input size.
    fmt: the format, e.g. "hf-clip".
    arch: a one-line description of the inferred architecture.
  """

  def __init__(self, *, vit, params, mean, std, image_size, fmt, arch):
    self.vit, self.params = vit, params
    self.mean = tuple(float(m) for m in mean)
    self.std = tuple(float(s) for s in std)
    self.image_size, self.fmt, self.arch = int(image_size), fmt, arch
