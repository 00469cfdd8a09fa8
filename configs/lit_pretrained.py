"""LiT with a pretrained ViT-B/16 the user already has on disk.

The image tower is read by ``train.pretrained`` from a local checkpoint
(format, architecture, mean/std and embedding size come from its files),
locked, and run at ``config.data.image_size``; the text tower is trained
from scratch (or started from the CLIP text tower, ``:hf_text``) with the
checkpoint's own tokenizer. Nothing is downloaded: fetch the checkpoint
beforehand (README, "Pretrained towers").

    python -m train.main --config configs/lit_pretrained.py:hf \
        --workdir /tmp/lit_hf --config.model.image.init=/path/to/clip-vit-base-patch16

Arguments (default ``hf``):

- ``hf``: a Hugging Face CLIP directory (``config.json`` +
  ``model.safetensors``), its ``vocab.json``/``merges.txt`` or
  ``tokenizer.json`` as the CLIP BPE tokenizer; softmax loss.
- ``hf_text``: the same, with the text tower initialised from the
  checkpoint's CLIP text tower (77 positions).
- ``siglip``: a Hugging Face SigLIP directory; its ``spiece.model`` as the
  SentencePiece tokenizer; sigmoid loss.
- ``timm``: a timm hub directory (``config.json`` + ``model.safetensors``);
  an ImageNet tower has no tokenizer, so bytes.
- ``open_clip``: an OpenCLIP hub directory; its ``tokenizer.json``.
- ``bv``: a big_vision ViT ``.npz``; bytes (or set ``tokenizer.kind=
  'sentencepiece'`` and ``spm_path``).
- ``tiny``: a seconds-long CPU run of the same code path with the committed
  tiny HF CLIP fixture (image and text towers) on synthetic_shapes.

Everything but the towers and the tokenizer is ``configs/lit_coco.py``:
COCO captions (prepared by the user), big_vision's LiT-on-COCO optimizer and
schedule (cited there), retrieval on the whole test split with every
caption. ``tiny`` uses the embedded synthetic_shapes.
"""
import os

from configs import lit_coco

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


def get_config(arg=None):
  arg = arg or "hf"
  if arg not in (*_SOURCES, "tiny"):
    raise ValueError(f"configs/lit_pretrained.py takes one of "
                     f"{', '.join(list(_SOURCES) + ['tiny'])}, got {arg!r}")
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
  # The tokenizer (and the text tower's start) follow model.image.init, so
  # --config.model.image.init=PATH alone points them all at PATH (``tiny``
  # sets its own paths, unlinked).
  init = c.model.image.get_ref("init") if arg != "tiny" else path
  if arg == "hf_text":
    c.model.text.init = init

  c.loss.name = loss
  if loss == "sigmoid":  # SigLIP's own start: t' = log 10, b = -10.
    c.loss.init_log_scale = None
  c.tokenizer.kind = tok
  c.tokenizer.max_len = 64
  if tok == "clip_bpe":
    c.tokenizer.bpe_path = init        # The checkpoint's own vocabulary.
  elif tok == "sentencepiece":
    c.tokenizer.spm_path = init + "/spiece.model"

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
