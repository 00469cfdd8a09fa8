"""LiT at a global batch of 256k+ with ViT-B/16-size towers (documented, not
run in CI: it needs accelerators and a prepared image-text dataset).

How the batch fits:

* The image tower is locked and ``precompute_image_embeddings`` is on: each
  image is embedded once (a forward pass only) and a train step sees a
  (B, 768) bf16 array of embeddings, 384 MiB at B = 256k.
* GradCache (``microbatch_size``): the text tower (12 layers, width 768, the
  size of ViT-B's transformer) runs in micro-batches of 8k, first forward
  only to get all text embeddings, then once more with the cached embedding
  gradients; its activation memory is that of 8k captions, whatever B is.
* The loss is the exact CLIP loss over the full global batch, tiled (never a
  B x B matrix) and, across devices, a ring of ``ppermute`` steps.

Scale it further with ``--config.batch_size=1048576``: memory grows only as
O(B * D) for the embeddings and their gradients. ``benchmarks/bench_train.py``
measures the step time and the largest batch on one GPU with synthetic data.

    .venv/bin/python -m train.main --config configs/lit_b16_large_batch.py \
        --workdir /tmp/lit_b16 --config.model.image.init=/path/to/vit_b16.npz

``:coco`` reads TFDS coco_captions (default); ``:synthetic`` trains on the
embedded synthetic_shapes data at 224 px (a systems test, not a model).
COCO's train split has fewer images (82,783) than one batch, so every batch
repeats images and a copy counts as its own negative; the trainer warns. A
real run at this batch size needs a split of many millions of pairs.

The optimizer is SigLIP's (Zhai et al. 2023), as big_vision configures it:
``big_vision.scale_by_adafactor`` (momentum 0.9 kept in bfloat16, factored
second moment with decay rate 0.8 capped at beta2 = 0.95, the cap SigLIP
uses for stable large-batch training, no parameter-scale multiplication, no
update clipping), lr 1e-3, wd 1e-4 scaled by the schedule, global-norm
clipping at 1.0 and cosine decay after max(3% of the steps, 100) warmup
steps (big_vision's SigLIP configs: ``optax = dict(beta2_cap=0.95)``,
``lr = 1e-3``, ``wd = 1e-4``).
"""
import importlib.util
import os


def _lit_coco():
  # Loaded by path: config files are run by file name, not as a package.
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "lit_coco.py")
  spec = importlib.util.spec_from_file_location("_lit_coco_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg=None):
  if arg not in (None, "", "coco", "synthetic"):
    raise ValueError("configs/lit_b16_large_batch.py takes ':coco' or "
                     f"':synthetic', got {arg!r}")
  c = _lit_coco().get_config()
  c.total_steps = 10_000
  c.batch_size = 262_144            # 256k global.
  c.microbatch_size = 8192          # GradCache micro-batch (global).
  c.precompute_image_embeddings = True
  c.model.dtype = "bfloat16"
  c.model.embed_dim = 768
  c.model.text.width = 768
  c.model.text.depth = 12
  c.model.text.num_heads = 12
  c.model.text.mlp_dim = 3072
  c.tokenizer.max_len = 32
  c.optim.name = "adafactor"        # Factored moments: less optimizer memory.
  c.optim.lr = 1e-3
  c.optim.weight_decay = 1e-4
  c.optim.weight_decay_scale = "schedule"
  c.optim.b1 = 0.9                  # big_vision scale_by_adafactor momentum.
  c.optim.b2 = 0.95                 # beta2_cap, SigLIP.
  c.optim.momentum_dtype = "bfloat16"
  c.optim.adafactor_decay_rate = 0.8
  c.optim.adafactor_min_dim_size_to_factor = 32
  c.optim.adafactor_eps = 1e-30
  c.optim.adafactor_clipping_threshold = 0.0
  c.optim.grad_clip_norm = 1.0
  c.optim.warmup_steps = max(int(0.03 * c.total_steps), 100)
  c.eval.every_steps = 1000
  c.eval.batch_size = 4096
  c.checkpoint.every_steps = 500
  c.log_every_steps = 10
  if arg == "synthetic":
    c.data.name = "synthetic_shapes"
    c.data.text_key = "captions/text"
    c.data.label_key = "label"
    c.data.eval_split = "test"
    c.data.num_train_examples = 300_000
  return c
