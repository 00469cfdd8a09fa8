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
  c.optim.warmup_steps = 500
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
