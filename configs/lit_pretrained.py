"""LiT with a pretrained ViT-B/16 the user already has on disk.

The image tower is read by ``train.towers.pretrained`` from a local checkpoint
(format, architecture, mean/std and embedding size come from its files),
locked, and run at ``config.data.image_size``; the text tower is trained
from scratch (or started from the CLIP text tower, ``:hf_text``) with the
checkpoint's own tokenizer. Nothing is downloaded: fetch the checkpoint
beforehand (docs/towers.md, "Getting a checkpoint onto the machine").

    python -m train.main --config configs/lit_pretrained.py:hf \
        --workdir /tmp/lit_hf --config.model.image.init=/path/to/clip-vit-base-patch16

Your checkpoint on your shards (README, "LiT with your checkpoint and
shards"):

    .venv/bin/python -m train.main --config configs/lit_pretrained.py:user \
        --workdir runs/lit_mine \
        --config.model.image.init=~/checkpoints/clip-vit-base-patch16 \
        --config.data.name='webdataset:/data/train-{000000..000127}.tar' \
        --config.data.eval_split='webdataset:/data/val-000000.tar' \
        --config.data.zeroshot_classnames_file=/data/classnames.txt

Arguments (default ``hf``):

- ``user``: a first run on one GPU with the user's own checkpoint (any
  format ``train.towers.pretrained`` reads; its tokenizer.json or
  vocab.json + merges.txt as the CLIP BPE tokenizer unless
  config.tokenizer.bpe_path says otherwise) and webdataset shards (or a
  CSV/TSV/JSONL table): the image tower locked and embedded once, a 6-layer text tower trained from
  scratch, zero-shot on the held-out shards from their json ``label`` and
  the class names, retrieval on the same shards. Its sizes are in
  ``_user`` below, each with why.
- ``user_small``: the same path sized for a CPU smoke run of about a
  minute (a few steps on 32 px images, embedded on the fly; the first 64
  held-out examples): check a recipe before it takes the GPU.
- ``hf``: a Hugging Face CLIP directory (``config.json`` +
  ``model.safetensors``), its ``vocab.json``/``merges.txt`` or
  ``tokenizer.json`` as the CLIP BPE tokenizer; softmax loss.
- ``hf_text``: the same, with the text tower initialised from the
  checkpoint's CLIP text tower (77 positions); ``model.text.init`` is a key
  of its own, so another checkpoint wants both ``--config.model.image.init``
  and ``--config.model.text.init`` (the tokenizer follows the text tower's).
- ``siglip``: a Hugging Face SigLIP directory; its ``spiece.model`` as the
  SentencePiece tokenizer; sigmoid loss.
- ``timm``: a timm hub directory (``config.json`` + ``model.safetensors``);
  an ImageNet tower has no tokenizer, so bytes.
- ``open_clip``: an OpenCLIP hub directory; its ``tokenizer.json``.
- ``bv``: a big_vision ViT ``.npz``; bytes (or set ``tokenizer.kind=
  'sentencepiece'`` and ``spm_path``).
- ``tiny``: a seconds-long CPU run of the same code path with the committed
  tiny HF CLIP fixture (image and text towers) on synthetic_shapes.

For the arguments other than ``user*``, everything but the towers and the
tokenizer is ``configs/lit_coco.py``:
COCO captions (prepared by the user), big_vision's LiT-on-COCO optimizer and
schedule (cited there), retrieval on the whole test split with every
caption. ``tiny`` uses the embedded synthetic_shapes.
"""
import math
import os

from configs import lit_coco
from train import config_base

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FIXTURES = os.path.join(_ROOT, "tests", "fixtures", "towers")
# (default checkpoint path, tokenizer kind, loss) per argument.
_SOURCES = {
    "hf": ("~/checkpoints/clip-vit-base-patch16", "clip_bpe", "softmax"),
    "hf_text": ("~/checkpoints/clip-vit-base-patch16", "clip_bpe", "softmax"),
    "siglip": ("~/checkpoints/siglip-base-patch16-224", "sentencepiece",
               "sigmoid"),
    "timm": ("~/checkpoints/vit_base_patch16_224.augreg2_in21k_ft_in1k",
             "bytes", "softmax"),
    "open_clip": ("~/checkpoints/open_clip_vit_b16", "clip_bpe", "softmax"),
    "bv": ("~/checkpoints/vit_b16_augreg.npz", "bytes", "softmax"),
}


_ARGS = (*_SOURCES, "tiny", "user", "user_small")


def get_config(arg=None):
  arg = arg or "hf"
  if arg not in _ARGS:
    raise ValueError(f"configs/lit_pretrained.py takes one of "
                     f"{', '.join(_ARGS)}, got {arg!r}")
  if arg.startswith("user"):
    return _user(small=arg == "user_small")
  c = lit_coco.get_config()
  # The locked tower embeds each image once; the step trains the text.
  c.precompute_image_embeddings = True

  path, tok, loss = _SOURCES.get(arg, _SOURCES["hf"])
  c.model.embed_dim = 0                # The pretrained tower's own.
  c.model.dtype = "bfloat16"
  c.model.image.kind = "pretrained"
  c.model.image.init = path
  c.model.image.locked = True
  c.model.text.width = 512
  c.model.text.depth = 12
  c.model.text.num_heads = 8
  c.model.text.mlp_dim = 2048
  # The text tower's start is a key of its own: with ``hf_text``, a
  # --config.model.image.init=PATH wants --config.model.text.init=PATH too.
  if arg == "hf_text":
    c.model.text.init = path

  c.loss.name = loss
  if loss == "sigmoid":  # SigLIP's own start: t' = log 10, b = -10.
    c.loss.init_log_scale = None
  c.tokenizer.kind = tok
  c.tokenizer.max_len = 64
  # tokenizer.bpe_path / spm_path stay unset: the trainer then reads the
  # checkpoint's own vocabulary (model.text.init, else model.image.init;
  # train/data/tokenizer.py, checkpoint_default), and setting either key
  # points the tokenizer elsewhere without moving the tower.

  if arg == "tiny":
    c.total_steps = 6
    c.batch_size = 16
    c.microbatch_size = 8
    c.model.dtype = "float32"
    c.model.image.init = os.path.join(_FIXTURES, "hf_clip")
    c.model.text.init = os.path.join(_FIXTURES, "hf_clip")
    c.tokenizer.kind = "clip_bpe"
    c.tokenizer.bpe_path = os.path.join(_FIXTURES, "clip_bpe")
    c.tokenizer.max_len = 16
    c.loss.block_q = 8
    c.loss.block_k = 16
    c.optim.warmup_steps = 2
    c.eval.every_steps = 0
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 3
    c.log_every_steps = 1
    c.data.name = "synthetic_shapes"
    c.data.split = "train"
    c.data.eval_split = "test"
    c.data.label_key = "label"
    c.data.image_size = 32
    c.data.num_train_examples = 128
    c.data.num_eval_examples = 32
  return c


def _user(small: bool):
  """``:user`` / ``:user_small``: the user's checkpoint and shards."""
  c = config_base.base_config()
  c.seed = 0
  # LiT "Lu": the pretrained image tower locked, its embeddings computed
  # once (a pass over the shards, JPEG decoding on num_threads threads) into
  # <workdir>/image_embeddings; each step then trains only the text tower
  # and the head, so 4096 pairs a step fit one GPU with room to spare.
  c.precompute_image_embeddings = True
  c.batch_size = 4096                # A contrastive loss wants many
  c.microbatch_size = 1024           # negatives; GradCache bounds memory.
  # ~12M pairs: about ten passes over 1M shards of img2dataset, long enough
  # for the text tower to align with a strong frozen tower (LiT's curves
  # flatten past a few thousand steps at this batch).
  c.total_steps = 3000
  c.model.embed_dim = 0              # The checkpoint's own embedding size.
  c.model.dtype = "bfloat16"
  c.model.image.kind = "pretrained"
  c.model.image.init = "~/checkpoints/clip-vit-base-patch16"
  c.model.image.locked = True
  # A text tower from scratch rather than the checkpoint's own: it works
  # with any image checkpoint (timm and vision-only ones have no text
  # tower) and is what LiT trains; 6 layers of 512 learn a caption corpus of
  # this size in a few thousand steps (12 layers, CLIP's, gain little there).
  c.model.text.width = 512
  c.model.text.depth = 6
  c.model.text.num_heads = 8
  c.model.text.mlp_dim = 2048
  c.model.text.init = ""

  c.loss.name = "softmax"
  c.loss.backend = "auto"
  c.loss.init_log_scale = math.log(10.0)  # LiT/big_vision: temperature 10.
  # big_vision's LiT recipe (lit_coco.py): Adam, lr 1e-3, weight decay 0.01
  # following the schedule, clipping at 1; warmup ~7% of the steps.
  c.optim.name = "adamw"
  c.optim.lr = 1e-3
  c.optim.weight_decay = 0.01
  c.optim.weight_decay_scale = "schedule"
  c.optim.warmup_steps = 200
  c.optim.grad_clip_norm = 1.0

  c.eval.every_steps = 500           # Six evaluations in a run.
  c.eval.batch_size = 512
  c.checkpoint.every_steps = 500
  c.checkpoint.keep = 2
  c.log_every_steps = 50

  d = c.data
  d.name = "webdataset:/data/train-{000000..000127}.tar"
  d.eval_split = "webdataset:/data/val-000000.tar"
  d.image_size = 224                 # ViT-B/16's own resolution.
  d.wds_label_field = "label"        # img2dataset-style json {"label": k}.
  d.zeroshot_classnames_file = "/data/classnames.txt"
  d.num_eval_examples = 0            # The whole held-out source.
  d.num_threads = 8                  # JPEG decoding while precomputing.
  c.tokenizer.kind = "clip_bpe"      # The checkpoint's tokenizer.json.
  c.tokenizer.max_len = 64
  c.tokenizer.bpe_path = ""          # "" = the checkpoint's own files.

  if small:
    # Seconds of CPU per step: a few steps, images embedded per step (a
    # precompute would embed the whole training corpus first), 32 px (a
    # ViT-B/16 then sees 2 x 2 patches: a smoke run checks the path, not
    # the model), a tiny text tower, the first 64 held-out examples.
    c.precompute_image_embeddings = False
    c.batch_size = 16
    c.microbatch_size = 0
    c.total_steps = 6
    c.model.dtype = "float32"
    c.model.text.width = 32
    c.model.text.depth = 1
    c.model.text.num_heads = 2
    c.model.text.mlp_dim = 64
    c.optim.warmup_steps = 2
    c.eval.every_steps = 3
    c.eval.batch_size = 32
    c.checkpoint.every_steps = 3
    c.log_every_steps = 1
    c.progress_bar = False
    d.image_size = 32
    d.num_eval_examples = 64
    d.num_threads = 2
    d.cache_max_mb = 64
    c.tokenizer.max_len = 16
  return c
