"""LiT demo on the embedded synthetic_shapes dataset: offline, CPU-sized.

    .venv/bin/python -m train.main --config configs/lit_demo.py --workdir /tmp/lit_demo

generates the dataset (~10 s), pretrains the small CNN image tower on the
training split if its checkpoint is missing (once, cached under
~/.cache/infcl_jax/towers), embeds each training image once with the locked
tower, trains the text tower from scratch with the exact CLIP loss, and
reports zero-shot shape classification on held-out (shape, color)
combinations with held-out prompt templates (chance 1/8).

``configs/lit_demo.py:tiny`` is a seconds-long run of the same code path
(tiny towers, random image tower, a few steps) for tests and smoke checks.

``--config.captions_per_image=3 --config.loss.groups=image`` trains with the
3 captions of each training image in one batch and tells the loss they are
one image's (docs/groups.md; ``--config.loss.group_mode=positives``
for multi-positive InfoNCE).
"""
import os

from train import config_base


def get_config(arg=None):
  c = config_base.base_config()
  tiny = arg == "tiny"
  if arg not in (None, "", "tiny"):
    raise ValueError(f"configs/lit_demo.py takes no argument or ':tiny', got "
                     f"{arg!r}")
  c.seed = 0
  c.total_steps = 800
  c.batch_size = 128
  c.microbatch_size = 0
  c.precompute_image_embeddings = True

  c.model.embed_dim = 64
  c.model.image.kind = "cnn"
  c.model.image.cnn_features = (16, 32, 64)
  feats = "-".join(str(f) for f in c.model.image.cnn_features)
  # No init: the demo's own tower, pretrained once into this cache file
  # (asked for explicitly here; a given --config.model.image.init must exist).
  c.model.image.init = ""
  c.model.image.pretrain_path = os.path.join(
      "~/.cache/infcl_jax/towers",
      f"shapes_s32_n4096_cnn{feats}_d{c.model.embed_dim}.npz")
  c.model.image.locked = True
  c.model.image.pretrain_steps = 500
  c.model.text.width = 64
  c.model.text.depth = 2
  c.model.text.num_heads = 2
  c.model.text.mlp_dim = 128

  c.loss.name = "softmax"
  c.loss.backend = "auto"

  c.optim.name = "adamw"
  c.optim.lr = 2e-3
  c.optim.weight_decay = 1e-4
  c.optim.warmup_steps = 100
  c.optim.grad_clip_norm = 1.0

  c.eval.every_steps = 400
  c.eval.batch_size = 256
  c.checkpoint.every_steps = 200
  c.checkpoint.keep = 2
  c.log_every_steps = 20

  c.data.name = "synthetic_shapes"
  c.data.image_size = 32
  c.data.num_train_examples = 4096
  c.data.num_eval_examples = 512
  c.tokenizer.kind = "bytes"
  c.tokenizer.max_len = 64

  if tiny:
    c.total_steps = 8
    c.batch_size = 16
    c.model.embed_dim = 16
    c.model.image.cnn_features = (4, 8)
    c.model.image.pretrain_path = ""   # Random locked tower: no pretraining.
    c.model.image.pretrain_steps = 0
    c.model.text.width = 16
    c.model.text.depth = 1
    c.model.text.num_heads = 2
    c.model.text.mlp_dim = 32
    c.loss.block_q = 8
    c.loss.block_k = 16
    c.optim.warmup_steps = 2
    c.eval.every_steps = 4
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 2
    c.log_every_steps = 1
    c.data.num_train_examples = 128
    c.data.num_eval_examples = 32
    c.tokenizer.max_len = 32
  return c
