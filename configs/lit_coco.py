"""LiT on COCO captions (TFDS ``coco_captions``), prepared by the user.

Prepare the dataset once (needs network and TFDS; the trainer then reads the
array_record files without TensorFlow):

    tfds build coco_captions --data_dir ~/tensorflow_datasets \
        --file_format array_record

and give a pretrained, locked image tower as a local checkpoint (a .npz of
named arrays in the layout of the own ViT, ``train.towers.own``, or an orbax directory):

    .venv/bin/python -m train.main --config configs/lit_coco.py --workdir /tmp/lit_coco \
        --config.model.image.init=/path/to/vit_b16.npz

COCO has no class labels, so the held-out evaluation is image <-> text
retrieval on the whole 5,000-image test split with all of its ~25,000
captions (R@1/5/10 both ways, the split and protocol of the CLIP, LiT and
SigLIP papers); set ``config.data.zeroshot_name`` to a prepared TFDS
classification dataset to also get zero-shot top-1/top-5, e.g.
``--config.data.zeroshot_name=imagenet2012 --config.data.zeroshot_split=
validation`` (CLIP's class names and 80 prompts are the default for its
WordNet-ID labels). ``:tiny`` shrinks everything for a smoke run on CPU
(still needs the prepared dataset).

The optimizer and schedule are big_vision's LiT-on-COCO recipe
(``big_vision/configs/proj/image_text/lit_coco.py``): Adam (``scale_by_adam``,
optax's default moments), lr 1e-3, wd 0.01 scaled by the schedule (big_vision's
``config.wd``), global-norm clipping at 1.0, cosine decay after
max(3% of the steps, 100) warmup steps, batch 4096, 5,000 steps, and the
initial temperature 10.
"""
import math

from train import config_base


def get_config(arg=None):
  if arg not in (None, "", "tiny"):
    raise ValueError(f"configs/lit_coco.py takes no argument or ':tiny', got "
                     f"{arg!r}")
  c = config_base.base_config()
  c.total_steps = 5_000               # big_vision lit_coco.py.
  c.batch_size = 4096                 # big_vision lit_coco.py.
  c.microbatch_size = 1024
  c.precompute_image_embeddings = True

  c.model.embed_dim = 768
  c.model.dtype = "bfloat16"
  c.model.image.kind = "vit"          # ViT-B/16.
  c.model.image.patch_size = 16
  c.model.image.width = 768
  c.model.image.depth = 12
  c.model.image.num_heads = 12
  c.model.image.mlp_dim = 3072
  c.model.image.init = "~/checkpoints/vit_b16_224.npz"
  c.model.image.locked = True
  c.model.image.pretrain_steps = 0    # A real tower must be given.
  c.model.text.width = 512
  c.model.text.depth = 12
  c.model.text.num_heads = 8
  c.model.text.mlp_dim = 2048

  c.loss.name = "softmax"
  c.loss.backend = "auto"
  c.loss.init_log_scale = math.log(10.0)  # big_vision: temperature_init=10.
  # big_vision lit_coco.py: optax_name="scale_by_adam", lr=0.001, wd=0.01,
  # grad_clip_norm=1.0, cosine with warmup max(int(0.03 * steps), 100).
  c.optim.name = "adamw"
  c.optim.lr = 1e-3
  c.optim.weight_decay = 0.01
  c.optim.weight_decay_scale = "schedule"
  c.optim.b1 = 0.9                    # optax.scale_by_adam defaults.
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.warmup_steps = max(int(0.03 * c.total_steps), 100)
  c.optim.grad_clip_norm = 1.0

  c.eval.every_steps = 2000
  c.eval.batch_size = 512
  c.checkpoint.every_steps = 1000
  c.checkpoint.keep = 3
  c.log_every_steps = 50

  c.data.name = "coco_captions"
  c.data.split = "train"
  c.data.eval_split = "test"          # The 5k test split of the papers.
  c.data.image_key = "image"
  c.data.text_key = "captions/text"
  c.data.label_key = ""
  c.data.image_size = 224
  c.data.num_eval_examples = 0        # The whole split, every caption.
  c.tokenizer.kind = "bytes"
  c.tokenizer.max_len = 64

  if arg == "tiny":
    c.total_steps = 4
    c.optim.warmup_steps = 1
    c.batch_size = 16
    c.microbatch_size = 8
    c.model.embed_dim = 32
    c.model.dtype = "float32"
    c.model.image.patch_size = 16
    c.model.image.width = 32
    c.model.image.depth = 1
    c.model.image.num_heads = 2
    c.model.image.mlp_dim = 64
    c.model.image.init = ""
    c.model.text.width = 32
    c.model.text.depth = 1
    c.model.text.num_heads = 2
    c.model.text.mlp_dim = 64
    c.eval.every_steps = 0
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 2
    c.log_every_steps = 1
    c.data.image_size = 64
    c.data.num_eval_examples = 64
  return c
