"""Every config key of the trainer, with defaults, and the config check.

A config file (``configs/*.py``) starts from ``base_config()`` and changes
values; ``check_config`` rejects keys that are not here (typos) with one
clear line, so a misspelled key never silently falls back to a default.
``config.data`` and ``config.tokenizer`` belong to ``train.data`` and are
checked there.
"""
from __future__ import annotations

import difflib
import math

import ml_collections
from ml_collections import config_dict

from train import data as data_lib


def base_config() -> ml_collections.ConfigDict:
  """All trainer keys with their defaults (a CPU-sized LiT run)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 1000
  c.batch_size = 256            # Global batch (all devices, all processes).
  # GradCache micro-batch (global). 0, or >= batch_size: no micro-batching.
  c.microbatch_size = 0
  # LiT: embed the training split once with the locked tower (into
  # <workdir>/image_embeddings, as `python -m train.precompute` does) and
  # train on those embeddings, decoding no image (needs model.image.locked).
  c.precompute_image_embeddings = False

  c.model = ml_collections.ConfigDict()
  c.model.embed_dim = 128       # Shared embedding size of the two towers.
  c.model.dtype = "float32"     # Compute dtype of the towers (params: f32).
  c.model.image = ml_collections.ConfigDict()
  c.model.image.kind = "cnn"    # "cnn" | "vit"
  c.model.image.cnn_features = (32, 64, 128)
  c.model.image.patch_size = 4  # ViT keys.
  c.model.image.width = 128
  c.model.image.depth = 4
  c.model.image.num_heads = 4
  c.model.image.mlp_dim = 256
  # Pretrained tower: a .npz of named arrays or an orbax checkpoint dir.
  # "" = random init (only sensible for tests and benchmarks).
  c.model.image.init = ""
  c.model.image.locked = True   # LiT "Lu": frozen via the optimizer mask.
  # If model.image.init is missing, run train.pretrain_image_tower first
  # (synthetic_shapes only) for this many steps; 0 = error instead.
  c.model.image.pretrain_steps = 0
  c.model.text = ml_collections.ConfigDict()
  c.model.text.width = 128
  c.model.text.depth = 2
  c.model.text.num_heads = 4
  c.model.text.mlp_dim = 256

  c.loss = ml_collections.ConfigDict()
  c.loss.name = "softmax"       # "softmax" (CLIP) | "sigmoid" (SigLIP)
  c.loss.backend = "auto"       # "auto" | "xla" | "pallas" | "reference"
  c.loss.block_q = 0            # Tile rows; 0 = backend default.
  c.loss.block_k = 0            # Tile columns; 0 = backend default.
  # None = paper default: log(1/0.07) softmax, log(10) sigmoid.
  c.loss.init_log_scale = config_dict.placeholder(float)
  c.loss.use_bias = config_dict.placeholder(bool)      # None: sigmoid only.
  c.loss.init_bias = config_dict.placeholder(float)    # None: -10 sigmoid.
  c.loss.min_log_scale = 0.0
  c.loss.max_log_scale = math.log(100.0)

  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"        # "adamw" | "adafactor"
  c.optim.lr = 1e-3
  c.optim.weight_decay = 1e-4
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.warmup_steps = 100
  c.optim.end_lr_ratio = 0.0    # Cosine decays to lr * end_lr_ratio.
  c.optim.grad_clip_norm = 1.0  # 0 = no clipping.

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 0        # 0 = only at the end.
  c.eval.batch_size = 256

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 3         # Keep the last K checkpoints.

  c.log_every_steps = 10
  c.progress_bar = True

  c.data = data_lib.default_data_config()
  c.tokenizer = data_lib.default_tokenizer_config()
  return c


def _flat_keys(cfg, prefix=""):
  out = {}
  for k, v in cfg.items():
    if isinstance(v, ml_collections.ConfigDict):
      out.update(_flat_keys(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def check_config(config) -> None:
  """Raises ValueError (one line) for unknown keys and invalid values."""
  known = _flat_keys(base_config())
  given = _flat_keys(config)
  for key in sorted(given):
    if key.startswith(("data.", "tokenizer.")):
      continue  # train.data checks its own sections.
    if key not in known:
      close = difflib.get_close_matches(key, known, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ValueError(f"unknown config key {'config.' + key!r}{hint}")
  def need(cond, msg):
    if not cond:
      raise ValueError(msg)
  need(config.total_steps >= 1, f"config.total_steps={config.total_steps} "
       "must be >= 1")
  need(config.batch_size >= 1, f"config.batch_size={config.batch_size} must "
       "be >= 1")
  need(config.microbatch_size >= 0, "config.microbatch_size must be >= 0")
  mb = config.microbatch_size
  if 0 < mb < config.batch_size:
    need(config.batch_size % mb == 0, f"config.microbatch_size={mb} must "
         f"divide config.batch_size={config.batch_size}")
  need(config.model.image.kind in ("cnn", "vit"),
       f"config.model.image.kind must be 'cnn' or 'vit', got "
       f"{config.model.image.kind!r}")
  need(config.loss.name in ("softmax", "sigmoid"),
       f"config.loss.name must be 'softmax' or 'sigmoid', got "
       f"{config.loss.name!r}")
  need(config.loss.backend in ("auto", "xla", "pallas", "reference"),
       f"config.loss.backend must be auto|xla|pallas|reference, got "
       f"{config.loss.backend!r}")
  need(config.optim.name in ("adamw", "adafactor"),
       f"config.optim.name must be 'adamw' or 'adafactor', got "
       f"{config.optim.name!r}")
  need(config.model.dtype in ("float32", "bfloat16", "float16"),
       f"config.model.dtype must be float32|bfloat16|float16, got "
       f"{config.model.dtype!r}")
  need(not config.precompute_image_embeddings or config.model.image.locked,
       "config.precompute_image_embeddings needs config.model.image.locked="
       "True (an unlocked tower's embeddings change every step)")
  need(not config.data.name.startswith("embeddings:")
       or config.model.image.locked,
       "config.data.name=embeddings:... needs config.model.image.locked=True "
       "(precomputed embeddings are of a frozen tower)")
  need((config.loss.block_q > 0) == (config.loss.block_k > 0),
       "config.loss.block_q and block_k must both be set (> 0) or both be 0")
  need(config.checkpoint.keep >= 1, "config.checkpoint.keep must be >= 1")
