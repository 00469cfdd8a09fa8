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
retrieval on the validation split (R@1/5/10); set
``config.data.zeroshot_name`` to a prepared TFDS classification dataset
(e.g. "cifar10") to also get zero-shot accuracy. ``:tiny`` shrinks
everything for a smoke run on CPU (still needs the prepared dataset).
"""
from train import config_base


def get_config(arg=None):
  if arg not in (None, "", "tiny"):
    raise ValueError(f"configs/lit_coco.py takes no argument or ':tiny', got "
                     f"{arg!r}")
  c = config_base.base_config()
  c.total_steps = 20_000
  c.batch_size = 4096
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
  c.optim.name = "adamw"
  c.optim.lr = 1e-3
  c.optim.weight_decay = 1e-4
  c.optim.b2 = 0.98
  c.optim.warmup_steps = 1000
  c.optim.grad_clip_norm = 1.0

  c.eval.every_steps = 2000
  c.eval.batch_size = 512
  c.checkpoint.every_steps = 1000
  c.checkpoint.keep = 3
  c.log_every_steps = 50

  c.data.name = "coco_captions"
  c.data.split = "train"
  c.data.eval_split = "val"
  c.data.image_key = "image"
  c.data.text_key = "captions/text"
  c.data.label_key = ""
  c.data.image_size = 224
  c.data.num_eval_examples = 5000
  c.tokenizer.kind = "bytes"
  c.tokenizer.max_len = 64

  if arg == "tiny":
    c.total_steps = 4
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
