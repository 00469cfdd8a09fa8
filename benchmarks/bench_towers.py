"""Tower speed beside torch, in one job, and a LiT step with a loaded tower.

    PYTHONPATH=. python3 benchmarks/bench_towers.py --out OUT [--budget_s 400]

On one GPU, bf16, synthetic inputs, medians of timed repetitions after
compilation and a warm-up:

1. ViT-B/16 forward, 224 px, batch 1024 (images/s): ours (``train.towers.vit``
   through ``Tower.embed`` on uint8, normalisation included) with cuDNN
   attention and with XLA's; timm's ``vit_base_patch16_224`` (torch SDPA)
   eager and ``torch.compile``d (float input, no normalisation).
2. Text tower forward + backward, CLIP size (width 512, depth 12, 8 heads,
   vocabulary 49,408), batch 1024, 16 and 77 tokens (sequences/s): ours
   (causal + EOS pooling, and bidirectional + mean pooling over per-row
   lengths) beside HF ``CLIPTextModelWithProjection`` (SDPA) eager and
   compiled.
3. A LiT step at B = 65,536 with a ViT-B/16 HF-CLIP-layout tower (random
   weights, written by ``save_pretrained``, read by
   ``train.pretrained.load_image_tower``): the embedding of 65,536 uint8
   images in micro-batches of 1024, then ``train.step``'s precomputed-mode
   train step (text tower width 768, depth 12, 16 tokens, vocabulary 32,000,
   GradCache micro-batch 8192: the configuration of ``bench_train.py``).

Rows go to OUT/bench_towers.jsonl as they finish (a cut-off run keeps what
it measured); a table is printed last. ``--budget_s`` skips what would not
finish in time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.time()


def _median(xs):
  return sorted(xs)[len(xs) // 2]


def _time_jax(fn, reps):
  import jax  # pylint: disable=g-import-not-at-top
  t = time.perf_counter()
  jax.block_until_ready(fn())
  compile_s = time.perf_counter() - t
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return _median(times), compile_s


def _time_torch(fn, reps):
  import torch  # pylint: disable=g-import-not-at-top
  t = time.perf_counter()
  fn()
  torch.cuda.synchronize()
  compile_s = time.perf_counter() - t
  fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
  return _median(times), compile_s


class Rows:
  def __init__(self, out):
    self.path = os.path.join(out, "bench_towers.jsonl")
    self.rows = []

  def add(self, **row):
    row["elapsed_s"] = round(time.time() - T0, 1)
    self.rows.append(row)
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")
    print("ROW", json.dumps(row), flush=True)


def vit_jax(rows, batch, reps):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from train.towers import layers  # pylint: disable=g-import-not-at-top
  from train.towers import vit as vit_lib  # pylint: disable=g-import-not-at-top
  from train.towers.tower import Normalization, Tower  # pylint: disable=g-import-not-at-top,g-multiple-import
  module = vit_lib.ViT(patch_size=16, width=768, depth=12, num_heads=12,
                       mlp_dim=3072, class_token=True, pos_embed_cls=True,
                       pool="tok", final_norm="tokens", act="gelu",
                       dtype=jnp.bfloat16)
  params = module.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)))[
      "params"]
  tower = Tower(module, params, 224, Normalization((0.5,) * 3, (0.25,) * 3),
                768, jnp.bfloat16)
  images = jax.device_put(np.random.default_rng(0).integers(
      0, 256, (batch, 224, 224, 3), dtype=np.uint8))
  original = layers.attention_implementation
  impls = ("cudnn", "xla") if jax.default_backend() == "gpu" else ("xla",)
  try:
    for impl in impls:
      layers.attention_implementation = lambda dtype, impl=impl: impl
      fn = jax.jit(tower.embed)
      s, c = _time_jax(lambda: fn(params, images), reps)
      rows.add(part="vit_b16_fwd", impl=f"ours ({impl} attention)",
               batch=batch, median_s=s, per_s=batch / s, compile_s=c)
  finally:
    layers.attention_implementation = original


def vit_torch(rows, batch, reps, compile_too):
  import timm  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  m = timm.create_model("vit_base_patch16_224", pretrained=False,
                        num_classes=0).cuda().to(torch.bfloat16).eval()
  x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
  variants = [("timm eager (SDPA)", m)]
  if compile_too:
    variants.append(("timm torch.compile", torch.compile(m)))
  for name, f in variants:
    with torch.inference_mode():
      s, c = _time_torch(lambda f=f: f(x), reps)
    rows.add(part="vit_b16_fwd", impl=name, batch=batch, median_s=s,
             per_s=batch / s, compile_s=c)
  del m, variants
  torch.cuda.empty_cache()


TEXT = dict(vocab=49408, width=512, depth=12, heads=8, mlp=2048, embed=512)


def text_jax(rows, batch, length, reps):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from train.towers import text as text_lib  # pylint: disable=g-import-not-at-top
  t = TEXT
  rng = jax.random.key(0)
  tokens = jax.random.randint(rng, (batch, length), 2, t["vocab"])
  lengths = jax.random.randint(jax.random.key(1), (batch, 1), 4, length + 1)
  tokens = jnp.where(jnp.arange(length)[None] < lengths, tokens, 0)
  tokens = jnp.where(jnp.arange(length)[None] == lengths - 1, 1, tokens)
  for pool, act in (("eos", "quick_gelu"), ("mean", "gelu_tanh")):
    m = text_lib.TextTransformer(
        vocab_size=t["vocab"], max_len=77, width=t["width"], depth=t["depth"],
        num_heads=t["heads"], mlp_dim=t["mlp"], embed_dim=t["embed"],
        pool=pool, act=act, dtype=jnp.bfloat16)
    p = m.init(rng, tokens[:1])["params"]
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(
        m.apply({"params": p}, x).astype(jnp.float32) ** 2)))
    s, c = _time_jax(lambda: grad(p, tokens), reps)
    rows.add(part=f"text_fwd_bwd_L{length}", impl=f"ours ({pool} pool)",
             batch=batch, median_s=s, per_s=batch / s, compile_s=c)


def text_torch(rows, batch, length, reps, compile_too):
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import CLIPTextConfig, CLIPTextModelWithProjection  # pylint: disable=g-import-not-at-top,g-multiple-import
  t = TEXT
  cfg = CLIPTextConfig(vocab_size=t["vocab"], hidden_size=t["width"],
                       intermediate_size=t["mlp"], num_hidden_layers=t["depth"],
                       num_attention_heads=t["heads"], projection_dim=t["embed"],
                       max_position_embeddings=77)
  m = CLIPTextModelWithProjection._from_config(  # pylint: disable=protected-access
      cfg, attn_implementation="sdpa").cuda().to(torch.bfloat16)
  ids = torch.randint(2, t["vocab"] - 1, (batch, length), device="cuda")
  ids[:, -1] = t["vocab"] - 1
  variants = [("HF CLIP text eager (SDPA)", m)]
  if compile_too:
    variants.append(("HF CLIP text torch.compile", torch.compile(m)))
  for name, f in variants:
    def step(f=f):
      m.zero_grad(set_to_none=True)
      out = f(input_ids=ids).text_embeds
      out.float().pow(2).sum().backward()
    s, c = _time_torch(step, reps)
    rows.add(part=f"text_fwd_bwd_L{length}", impl=name, batch=batch,
             median_s=s, per_s=batch / s, compile_s=c)
  del m, variants
  torch.cuda.empty_cache()


def lit_step(rows, reps, b=65536, micro=8192, img_batch=1024, path=None):
  import tempfile  # pylint: disable=g-import-not-at-top
  from types import SimpleNamespace as NS  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,g-multiple-import
  from infcl_jax.flax import ContrastiveLoss  # pylint: disable=g-import-not-at-top
  from train import pretrained  # pylint: disable=g-import-not-at-top
  from train import step as step_lib  # pylint: disable=g-import-not-at-top
  from train.towers import text as text_lib  # pylint: disable=g-import-not-at-top
  d = path
  if d is None:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection  # pylint: disable=g-import-not-at-top,g-multiple-import
    d = tempfile.mkdtemp()
    CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
        num_attention_heads=12, image_size=224, patch_size=16,
        projection_dim=512)).save_pretrained(d)
  t = time.perf_counter()
  tower = pretrained.load_image_tower(d, dtype=jnp.bfloat16)
  load_s = time.perf_counter() - t
  L, vocab = 16, 32000
  embed = jax.jit(tower.embed)
  img = jax.device_put(np.random.default_rng(0).integers(
      0, 256, (img_batch, tower.image_size, tower.image_size, 3), dtype=np.uint8))
  jax.block_until_ready(embed(tower.params, img))
  t = time.perf_counter()
  embs = [embed(tower.params, img) for _ in range(b // img_batch)]
  emb = jax.block_until_ready(jnp.concatenate(embs).astype(jnp.bfloat16))
  embed_s = time.perf_counter() - t
  del embs
  txt = text_lib.from_scratch(NS(width=768, depth=12, num_heads=12,
                                 mlp_dim=3072), vocab, L, tower.embed_dim,
                              jnp.bfloat16)
  head = ContrastiveLoss(loss="softmax", backend="auto")
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  k = jax.random.split(jax.random.key(0), 2)
  e = jnp.zeros((2, tower.embed_dim))
  params = {"img": tower.params,
            "txt": txt.init(k[0], jnp.ones((1, L), jnp.int32))["params"],
            "head": head.init(k[1], e, e)["params"]}
  schedule = step_lib.make_schedule(lr=1e-4, total_steps=100, warmup_steps=10)
  opt = step_lib.make_optimizer(name="adamw", schedule=schedule,
                                weight_decay=1e-4, grad_clip_norm=1.0,
                                params=params, image_locked=True)
  grad_fn = step_lib.make_grad_fn(
      mesh=mesh, image_tower=tower, text_tower=txt, head=head,
      microbatch_size=micro, global_batch=b, precomputed=True,
      image_locked=True)
  train_step = step_lib.make_train_step(grad_fn=grad_fn, head=head,
                                        optimizer=opt, schedule=schedule)
  state = step_lib.init_state(mesh, params, opt)
  sh = NamedSharding(mesh, P(step_lib.AXIS))
  tokens = jax.random.randint(k[0], (b, L), 2, vocab)
  lengths = jax.random.randint(k[1], (b, 1), 4, L + 1)
  tokens = jnp.where(jnp.arange(L)[None] < lengths, tokens, 0)
  batch = {"text": jax.device_put(tokens, sh),
           "image_emb": jax.device_put(emb, sh)}
  holder = {"s": state}

  def one():
    holder["s"], m = train_step(holder["s"], batch)
    return m["loss"]
  s, c = _time_jax(one, reps)
  peak = max(int((dv.memory_stats() or {}).get("peak_bytes_in_use", 0))
             for dv in jax.local_devices()) / 2**30
  rows.add(part=f"lit_step_b{b}", impl="HF-CLIP B/16 tower, precomputed",
           batch=b, median_s=s, compile_s=c, embed_all_s=embed_s,
           embed_per_s=b / embed_s, micro=micro, load_s=load_s, peak_gib=peak)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--budget_s", type=float, default=400)
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--no_compile", action="store_true")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny batches, jax parts only (a CPU check)")
  args = ap.parse_args()
  n = 2 if args.smoke else 1024
  os.makedirs(args.out, exist_ok=True)
  rows = Rows(args.out)
  import jax  # pylint: disable=g-import-not-at-top
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  left = lambda: args.budget_s - (time.time() - T0)  # noqa: E731
  parts = [
      (lambda: vit_jax(rows, n, args.reps), 30),
      (lambda: vit_torch(rows, n, args.reps, not args.no_compile), 60),
      (lambda: text_jax(rows, n, 16, args.reps), 20),
      (lambda: text_jax(rows, n, 77, args.reps), 20),
      (lambda: text_torch(rows, n, 16, args.reps, not args.no_compile), 50),
      (lambda: text_torch(rows, n, 77, args.reps, not args.no_compile), 50),
      (lambda: lit_step(rows, 3) if not args.smoke
       else lit_step(rows, 1, b=32, micro=16, img_batch=16, path=os.path.join(
           os.path.dirname(__file__), "..", "tests/fixtures/towers/"
           "hf_clip_vision")), 60),
  ]
  if args.smoke:
    parts = [p for i, p in enumerate(parts) if i not in (1, 4, 5)]
  for fn, need in parts:
    if left() < need:
      print(f"skipped a part: {left():.0f} s left, needs ~{need}", flush=True)
      continue
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      print(f"part failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
  print(f"\n{'part':<22}{'implementation':<36}{'per s':>12}{'median s':>10}")
  for r in rows.rows:
    print(f"{r['part']:<22}{r['impl']:<36}{r.get('per_s', 0):>12,.0f}"
          f"{r['median_s']:>10.4f}")
    if "embed_all_s" in r:
      print(f"   embed {r['batch']:,} images {r['embed_all_s']:.2f} s "
            f"({r['embed_per_s']:,.0f} img/s), step {r['median_s']:.3f} s, "
            f"peak {r['peak_gib']:.1f} GiB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
