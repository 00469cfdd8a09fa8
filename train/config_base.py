"""Every config key of the trainer, with defaults, and the config check.

A config file (``configs/*.py``) starts from ``base_config()`` and changes
values; ``check_config`` rejects keys that are not here (typos) with one
clear line, so a misspelled key never silently falls back to a default.
``config.data`` and ``config.tokenizer`` belong to ``train.data``: their
keys, each with what it means, are in ``train/data/config.py``, and are
checked there.
"""
from __future__ import annotations

import difflib
import math

import infcl_jax
import ml_collections
from ml_collections import config_dict

from train import checkpoint as checkpoint_lib
from train import data as data_lib
from train import preemption


def base_config() -> ml_collections.ConfigDict:
  """All trainer keys with their defaults (a CPU-sized LiT run)."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 1000
  c.batch_size = 256            # Global batch (all devices, all processes).
  # GradCache micro-batch (global). 0, or >= batch_size: no micro-batching.
  # "auto": the largest up to 8192 whose compiled step fits the device's
  # memory (train/memory.py). A set one that cannot fit stops the run
  # before any data is decoded, naming the one that fits.
  c.microbatch_size = config_dict.FieldReference(0, field_type=object)
  # The device memory (GB) the step may plan for; 0 = the device's own
  # (memory_stats()["bytes_limit"]; on CPU the host's memory).
  c.device_memory_gb = 0.0
  # Captions of one image per batch: each training image is put at k
  # consecutive positions of the stream with k distinct captions (as long
  # as it has k), e.g. COCO's 5. With loss.groups = "image" the loss knows
  # them as one image's captions, not as negatives of each other. (Not in
  # config.data: the image tower's pretraining, fingerprinted by config.data,
  # does not depend on it.)
  c.captions_per_image = 1
  # LiT: embed the training split once with the locked tower (into
  # <workdir>/image_embeddings, as `python -m train.precompute` does) and
  # train on those embeddings, decoding no image (needs model.image.locked).
  c.precompute_image_embeddings = False

  c.model = ml_collections.ConfigDict()
  # Shared embedding size of the two towers; 0 = the pretrained image
  # tower's own (kind "pretrained" must have 0 or exactly that).
  c.model.embed_dim = 128
  c.model.dtype = "float32"     # Compute dtype of the towers (params: f32).
  c.model.image = ml_collections.ConfigDict()
  # "pretrained": a checkpoint of HF (CLIP, SigLIP), timm, OpenCLIP or
  # big_vision at `init` (train.towers.pretrained; architecture,
  # normalisation and embedding size come from it). "cnn" | "vit": this
  # project's own tower.
  c.model.image.kind = "cnn"
  c.model.image.cnn_features = (32, 64, 128)
  c.model.image.patch_size = 4  # Own-ViT keys.
  c.model.image.width = 128
  c.model.image.depth = 4
  c.model.image.num_heads = 4
  c.model.image.mlp_dim = 256
  # The checkpoint. Given and missing: an error. "" with pretrain_path "":
  # random init (only sensible for tests and benchmarks).
  c.model.image.init = ""
  c.model.image.locked = True   # LiT "Lu": frozen via the optimizer mask.
  # A locked tower stores in model.dtype the params it casts to it anyway
  # (cast once at load: half their memory, no casts in each step; LayerNorm
  # params stay float32): bitwise the same embeddings.
  c.model.image.params_in_dtype = False
  # Own towers, init "": this .npz is used, made first by
  # train.pretrain_image_tower (synthetic_shapes, pretrain_steps steps) if
  # it does not exist. Ignored when init is given.
  c.model.image.pretrain_path = ""
  c.model.image.pretrain_steps = 0
  c.model.text = ml_collections.ConfigDict()
  c.model.text.width = 128
  c.model.text.depth = 2
  c.model.text.num_heads = 4
  c.model.text.mlp_dim = 256
  # An HF CLIP directory (CLIPModel / CLIPTextModelWithProjection) to start
  # the text tower from; its architecture replaces width/depth/heads/mlp,
  # and config.tokenizer must be its clip_bpe vocabulary.
  c.model.text.init = ""
  # What each text block keeps for the backward pass of GradCache
  # (train/towers/layers.py): "none" (every activation), "block" (its input
  # only: the block runs again in the backward, one more forward of the
  # tower for a fraction of the memory) or "dots" (its matmul outputs).
  c.model.text.remat = "none"

  c.loss = ml_collections.ConfigDict()
  c.loss.name = "softmax"       # "softmax" (CLIP) | "sigmoid" (SigLIP)
  # "auto", "reference" (the full matrix) or any backend the library
  # registers (infcl_jax.backend_names(): "xla", "pallas", "mosaic", ...).
  c.loss.backend = "auto"
  c.loss.block_q = 0            # Tile rows; 0 = backend default.
  c.loss.block_k = 0            # Tile columns; 0 = backend default.
  # The dtype both embeddings are cast to for the loss; "" = their promoted
  # dtype: the image tower's float32 embeddings make a bfloat16 text
  # tower's loss float32 (1.6x the bfloat16 loss's time on a GPU, and the
  # loss is O(B^2)). "bfloat16", "float16" or "float32".
  c.loss.dtype = ""
  # None = paper default: log(1/0.07) softmax, log(10) sigmoid.
  c.loss.init_log_scale = config_dict.placeholder(float)
  c.loss.use_bias = config_dict.placeholder(bool)      # None: sigmoid only.
  c.loss.init_bias = config_dict.placeholder(float)    # None: -10 sigmoid.
  c.loss.min_log_scale = 0.0
  c.loss.max_log_scale = math.log(100.0)
  # Pairs that are not negatives (the loss's groups=): "none"; "image": the
  # captions of one image sampled into one batch (captions_per_image,
  # or a table of one row per caption); "content": duplicate images, by a
  # hash of their pixels recorded where the embeddings are precomputed
  # (needs precomputed embeddings).
  c.loss.groups = "none"
  # "mask": related pairs other than the positive leave the softmax
  # (SigLIP: leave the sum); "positives": every related pair is a positive
  # (multi-positive InfoNCE; SigLIP: label +1).
  c.loss.group_mode = "mask"

  # The update of either optimizer is described in train/optim.py.
  c.optim = ml_collections.ConfigDict()
  c.optim.name = "adamw"        # "adamw" | "adafactor" (big_vision's variant)
  c.optim.lr = 1e-3             # Peak of the warmup + cosine schedule.
  c.optim.weight_decay = 1e-4   # Decoupled; on weights with ndim >= 2.
  # How the decay follows the schedule: "lr" = multiplied by lr(t) (optax.adamw,
  # PyTorch AdamW); "schedule" = by lr(t) / lr (big_vision's config.wd).
  c.optim.weight_decay_scale = "lr"
  c.optim.b1 = 0.9              # Adam b1; Adafactor momentum (0 = none).
  c.optim.b2 = 0.999            # Adam b2; Adafactor second-moment decay cap.
  c.optim.eps = 1e-8            # Adam epsilon.
  c.optim.warmup_steps = 100
  c.optim.end_lr_ratio = 0.0    # Cosine decays to lr * end_lr_ratio.
  c.optim.grad_clip_norm = 1.0  # 0 = no clipping.
  # ((regex, multiplier), ...) over parameter names such as "head/log_scale",
  # "head/bias", "txt/encoder/block0/..."; first full match wins, else 1.
  c.optim.lr_mults = ()
  # Adafactor only (big_vision.scale_by_adafactor's defaults).
  c.optim.adafactor_decay_rate = 0.8
  c.optim.adafactor_min_dim_size_to_factor = 32
  c.optim.adafactor_eps = 1e-30
  c.optim.adafactor_clipping_threshold = 0.0  # 0 = no update clipping.
  # First-moment dtype (Adam's mu, Adafactor's momentum).
  c.optim.momentum_dtype = "float32"

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 0        # 0 = only at the end.
  c.eval.batch_size = 256

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 3         # Keep the last K checkpoints.
  # Also a checkpoint whenever this many minutes have passed since the last
  # one (0 = steps only): for steps of minutes, where every_steps is hours.
  # With several processes, process 0's clock decides (train/preemption.py).
  c.checkpoint.every_minutes = 0.0
  # Where checkpoints go: "" = <workdir>/checkpoints; or a directory
  # elsewhere, e.g. on object storage (gs://bucket/run, s3://bucket/run;
  # docs/cluster.md).
  c.checkpoint.directory = ""

  # Signals that preempt the run: the step in progress finishes, a
  # checkpoint of it is saved, and train.main exits with status 75
  # (docs/cluster.md). SLURM and Kubernetes send SIGTERM; `#SBATCH
  # --signal=USR1@120` sends SIGUSR1 ahead of the end. () = default actions.
  c.preemption_signals = ("SIGTERM", "SIGUSR1")
  # A rerun on a workdir whose config.json differs in keys that change the
  # train state or the data stream stops with one line naming them; True
  # resumes anyway (the checkpoint must still fit the new train state).
  c.resume_despite_changes = False

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

  def choice(key, value, choices):
    need(value in choices, f"{key} must be one of {', '.join(choices)}; got "
         f"{value!r}")
  need(config.total_steps >= 1, f"config.total_steps={config.total_steps} "
       "must be >= 1")
  need(config.batch_size >= 1, f"config.batch_size={config.batch_size} must "
       "be >= 1")
  mb = config.microbatch_size
  need(mb == "auto" or (isinstance(mb, int) and not isinstance(mb, bool)
                        and mb >= 0),
       f"config.microbatch_size={mb!r} must be an int >= 0 or \"auto\"")
  dm = config.device_memory_gb
  need(isinstance(dm, (int, float)) and math.isfinite(dm) and dm >= 0,
       f"config.device_memory_gb={dm!r} must be a finite number >= 0 (0 = "
       "the device's own limit)")
  need(config.model.text.remat in ("none", "block", "dots"),
       f"config.model.text.remat must be 'none', 'block' or 'dots', got "
       f"{config.model.text.remat!r}")
  need(isinstance(config.captions_per_image, int)
       and config.captions_per_image >= 1,
       f"config.captions_per_image={config.captions_per_image!r} must be an "
       "int >= 1")
  if mb != "auto" and 0 < mb < config.batch_size:
    need(config.batch_size % mb == 0, f"config.microbatch_size={mb} must "
         f"divide config.batch_size={config.batch_size}")
  ic = config.model.image
  need(ic.kind in ("cnn", "vit", "pretrained"),
       f"config.model.image.kind must be 'cnn', 'vit' or 'pretrained', got "
       f"{ic.kind!r}")
  need(ic.kind != "pretrained" or ic.init,
       "config.model.image.kind='pretrained' needs config.model.image.init "
       "(a local checkpoint: HF, timm, OpenCLIP or big_vision)")
  need(config.model.embed_dim >= (0 if ic.kind == "pretrained" else 1),
       f"config.model.embed_dim={config.model.embed_dim} must be >= 1 (0 = "
       "the pretrained tower's own, kind='pretrained' only)")
  need(not ic.get("params_in_dtype", False) or ic.locked,
       "config.model.image.params_in_dtype needs config.model.image.locked="
       "True (a trained tower keeps float32 params for its optimizer)")
  need(not ic.pretrain_path or ic.init or ic.pretrain_steps > 0,
       "config.model.image.pretrain_path needs "
       "config.model.image.pretrain_steps > 0")
  need(not config.model.text.init or ic.kind == "pretrained",
       "config.model.text.init (a pretrained text tower) needs a pretrained "
       "image tower (config.model.image.kind='pretrained')")
  # The library's own lists: a backend registered there (or a loss family,
  # a group mode) is taken here with no second list to update.
  choice("config.loss.name", config.loss.name, infcl_jax.LOSS_FAMILIES)
  choice("config.loss.backend", config.loss.backend, infcl_jax.backend_names())
  choice("config.loss.groups", config.loss.groups, ("none", "image", "content"))
  choice("config.loss.group_mode", config.loss.group_mode,
         infcl_jax.GROUP_MODES)
  need(config.loss.group_mode == "mask" or config.loss.groups != "none",
       f"config.loss.group_mode={config.loss.group_mode!r} needs "
       "config.loss.groups ('image' or 'content'): without groups there are "
       "no related pairs")
  need(config.loss.groups != "content" or config.precompute_image_embeddings
       or config.data.name.startswith("embeddings:"),
       "config.loss.groups='content' needs precomputed embeddings "
       "(config.precompute_image_embeddings=True or config.data.name="
       "embeddings:DIR): the content hashes are recorded there")
  need(config.optim.name in ("adamw", "adafactor"),
       f"config.optim.name must be 'adamw' or 'adafactor', got "
       f"{config.optim.name!r}")
  need(config.optim.weight_decay_scale in ("lr", "schedule"),
       f"config.optim.weight_decay_scale must be 'lr' or 'schedule', got "
       f"{config.optim.weight_decay_scale!r}")
  need(config.optim.momentum_dtype in ("float32", "bfloat16"),
       f"config.optim.momentum_dtype must be float32|bfloat16, got "
       f"{config.optim.momentum_dtype!r}")
  for key in ("lr", "weight_decay", "eps", "grad_clip_norm", "end_lr_ratio",
              "adafactor_eps", "adafactor_clipping_threshold"):
    value = config.optim[key]
    need(isinstance(value, (int, float)) and math.isfinite(value)
         and value >= 0, f"config.optim.{key}={value!r} must be a finite "
         "number >= 0")
  for key in ("b1", "b2"):
    need(0 <= config.optim[key] < 1, f"config.optim.{key}="
         f"{config.optim[key]!r} must be in [0, 1)")
  need(config.optim.warmup_steps >= 0, "config.optim.warmup_steps must be "
       ">= 0")
  for i, rule in enumerate(config.optim.lr_mults):
    need(isinstance(rule, (tuple, list)) and len(rule) == 2
         and isinstance(rule[0], str) and isinstance(rule[1], (int, float)),
         f"config.optim.lr_mults[{i}]={rule!r} must be a (regex, "
         "multiplier) pair")
  need(config.eval.batch_size >= 1, f"config.eval.batch_size="
       f"{config.eval.batch_size} must be >= 1")
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
  need(config.loss.dtype in ("", "bfloat16", "float16", "float32"),
       f"config.loss.dtype must be '', 'bfloat16', 'float16' or 'float32', "
       f"got {config.loss.dtype!r}")
  need((config.loss.block_q > 0) == (config.loss.block_k > 0),
       "config.loss.block_q and block_k must both be set (> 0) or both be 0")
  need(config.checkpoint.keep >= 1, "config.checkpoint.keep must be >= 1")
  minutes = config.checkpoint.every_minutes
  need(isinstance(minutes, (int, float)) and math.isfinite(minutes)
       and minutes >= 0, f"config.checkpoint.every_minutes={minutes!r} must "
       "be a finite number >= 0 (0 = only every_steps)")
  preemption.check_signal_names(config.preemption_signals)
  checkpoint_lib.check_directory(config.checkpoint.directory)
