"""Tower speed beside torch, in one job, and LiT steps with a loaded tower.

    PYTHONPATH=. python3 benchmarks/bench_towers.py --out OUT           # GPU
    PYTHONPATH=. python3 benchmarks/bench_towers.py --quick --out /tmp/bt  # CPU

Each case in its own child process (``harness.run_child``: XLA_FLAGS read
once, the peak counter from zero, torch off JAX's pool, a crash costs one
case); bf16, synthetic inputs, medians after compilation and a warm-up:

1. ViT-B/16 forward, 224 px, batch 1024: ours (``Tower.embed`` on uint8)
   beside timm's ``vit_base_patch16_224`` eager and ``torch.compile``d.
2. CLIP-size text tower forward + backward, batch 1024, 16 and 77 tokens:
   ours (causal, EOS pooling) beside HF ``CLIPTextModelWithProjection``.
3. The LiT step (``harness.lit_step``) at B = 65,536 with a ViT-B/16 in the
   HF CLIP layout (random weights written by ``save_pretrained``), locked:
   embeddings precomputed (the tower's rate on 1024-image batches, tiled
   to B) or the tower on the fly inside the step.

Cases run in priority order within ``--budget_s``; rows go to
OUT/bench_towers.jsonl as measured, a table is printed last.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position

FIXTURE_HF = os.path.join(harness.ROOT, "tests", "fixtures", "towers",
                          "hf_clip_vision")
# Sizes, each key (the GPU run's, the CPU smoke run's (--quick)).
SIZES = dict(
    vit=dict(patch_size=(16, 8), width=(768, 32), depth=(12, 2),
             num_heads=(12, 2), mlp_dim=(3072, 64), image=(224, 32),
             batch=(1024, 4)),
    text=dict(vocab=(49408, 300), width=(512, 32), depth=(12, 1),
              heads=(8, 2), mlp=(2048, 64), embed=(512, 32),
              batch=(1024, 4), lengths=((16, 77), (16, 77))),
    lit=dict(batch=(65536, 32), micro=(8192, 16), img_batch=(1024, 16),
             embed_batches=(16, 1), embed_dim=(512, 24),
             text_width=(768, 32), text_depth=(12, 1), text_heads=(12, 2),
             text_mlp=(3072, 64), text_len=(16, 16), vocab=(32000, 300),
             reps=(3, 1), reps_on_the_fly=(1, 1)))


def sizes(quick):
  return {part: {k: v[quick] for k, v in keys.items()}
          for part, keys in SIZES.items()}


# (name, kind, estimated seconds on one H200 incl. the child's start,
# deadline seconds), in priority order: what a short budget cuts is last.
PLAN = (
    ("vit", "vit", 30, 120),
    ("vit_torch", "vit_torch", 40, 180),
    ("vit_p16", "vit", 30, 120),
    ("text_jax_eos", "text_jax", 60, 180),
    ("text_torch", "text_torch", 110, 150),
    ("lit_hf_precomputed", "lit", 60, 200),
    ("lit_hf_on_the_fly", "lit", 130, 240),
)
PART = {"vit": "vit_b16_fwd", "vit_torch": "vit_b16_fwd", "lit": "lit_step",
        "text_jax": "text_fwd_bwd", "text_torch": "text_fwd_bwd"}
PARTS_ORDER = ("vit_b16_fwd", "text_fwd_bwd_L16", "text_fwd_bwd_L77",
               "lit_step")


# ----------------------------------------------------------------- child


class Emitter:
  """Appends each measured row to the jsonl at once (a child cut by its
  deadline keeps what it measured) and keeps it for the parent."""

  def __init__(self, spec):
    self.spec, self.rows = spec, []

  def add(self, **row):
    row = dict(case=self.spec["name"], status=row.pop("status", "ok"), **row)
    row["elapsed_s"] = round(time.time() - self.spec["t0"], 1)
    self.rows.append(row)
    harness.append_jsonl(self.spec["jsonl"], row)
    print("ROW", json.dumps(row), flush=True)


def _peak_gib():
  peak = harness.device_bytes("peak_bytes_in_use")
  return max(peak) / 2**30 if peak and max(peak) else None


def _timing_row(t, batch):
  return dict(median_s=t.median, min_s=t.min, max_s=t.max, reps=t.reps,
              per_s=batch / t.median)


def _compiled_vit(v, images, params_in_dtype=False):
  """(compiled embed, compile seconds, params) of the benchmark's ViT-B/16
  (class token, tok pooling, the trainer's defaults otherwise);
  ``params_in_dtype``: the trainer's ``model.image.params_in_dtype``
  (``Tower.with_params_in_dtype``: no per-call f32 -> bf16 weight casts)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from train.towers import vit as vit_lib  # pylint: disable=import-outside-toplevel
  from train.towers.tower import Normalization, Tower  # pylint: disable=import-outside-toplevel,g-multiple-import
  module = vit_lib.ViT(patch_size=v["patch_size"], width=v["width"],
                       depth=v["depth"], num_heads=v["num_heads"],
                       mlp_dim=v["mlp_dim"], class_token=True,
                       pos_embed_cls=True, pool="tok", final_norm="tokens",
                       act="gelu", dtype=jnp.bfloat16)
  s = v["image"]
  params = jax.jit(module.init)(jax.random.key(0),
                                jnp.zeros((1, s, s, 3)))["params"]
  tower = Tower(module, params, s, Normalization((0.5,) * 3, (0.25,) * 3),
                v["width"], jnp.bfloat16)
  if params_in_dtype:
    tower = tower.with_params_in_dtype()
  return (*harness.aot(jax.jit(tower.embed), tower.params, images),
          tower.params)


def child_vit(spec, rows):
  """Ours: forward of a batch of uint8 images."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  v = spec["sizes"]["vit"]
  b, s = v["batch"], v["image"]
  images = jax.device_put(np.random.default_rng(0).integers(
      0, 256, (b, s, s, 3), dtype=np.uint8))
  compiled, compile_s, params = _compiled_vit(
      v, images, spec["case"].get("params_in_dtype", False))
  t = harness.timeit(compiled, params, images, reps=spec["reps"], warmup=2)
  rows.add(part="vit_b16_fwd", impl=spec["label"], batch=b,
           compile_s=compile_s, peak_gib=_peak_gib(), **_timing_row(t, b))


def torch_rows(rows, torch, m, cases, reps, impl):
  """A row per case and variant of the torch model ``m``: eager and
  ``torch.compile``d (dynamic=False: a second input shape recompiles a
  static graph instead of switching the model to dynamic shapes). A case is
  (part, batch, call(f)), timed with a device sync inside (the harness syncs
  JAX arrays; a torch call returns before the GPU is done)."""
  cuda = torch.cuda.is_available()
  variants = (("eager", m), ("torch.compile", torch.compile(m, dynamic=False)))
  for part, b, call in cases:
    for name, f in variants:
      def run(f=f, call=call):
        call(f)
        if cuda:
          torch.cuda.synchronize()
      t0 = time.perf_counter()
      try:
        t = harness.timeit(run, reps=reps, warmup=2)
      except Exception as e:  # pylint: disable=broad-except
        rows.add(part=part, impl=impl.format(name), batch=b,
                 status=harness.failure(e))
        continue
      rows.add(part=part, impl=impl.format(name), batch=b,
               first_calls_s=time.perf_counter() - t0,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda
               else None, **_timing_row(t, b))


def child_vit_torch(spec, rows):
  """timm's ViT-B/16, eager and torch.compile'd, bf16 inference."""
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  v = spec["sizes"]["vit"]
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  kw = {} if v["image"] == 224 else dict(
      img_size=v["image"], patch_size=v["patch_size"], embed_dim=v["width"],
      depth=v["depth"], num_heads=v["num_heads"])
  m = timm.create_model("vit_base_patch16_224", pretrained=False,
                        num_classes=0, **kw).to(dev, torch.bfloat16).eval()
  x = torch.randn(v["batch"], 3, v["image"], v["image"], device=dev,
                  dtype=torch.bfloat16)

  def forward(f):
    with torch.inference_mode():
      f(x)
  torch_rows(rows, torch, m, [("vit_b16_fwd", v["batch"], forward)],
             spec["reps"], "timm {} (SDPA)")


def _text_tokens(jax, jnp, batch, length, vocab, eos):
  """Random ids, per-row lengths 4..L, trailing padding 0, EOS at the end."""
  tokens = jax.random.randint(jax.random.key(0), (batch, length), 2, vocab)
  lengths = jax.random.randint(jax.random.key(1), (batch, 1), 4, length + 1)
  tokens = jnp.where(jnp.arange(length)[None] < lengths, tokens, 0)
  return jnp.where(jnp.arange(length)[None] == lengths - 1, eos, tokens)


def child_text_jax(spec, rows):
  """Ours, causal + EOS pooling (CLIP's), forward + backward, each length
  (the longest first)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from train.towers import text as text_lib  # pylint: disable=import-outside-toplevel
  t = spec["sizes"]["text"]
  b = t["batch"]
  for length in sorted(t["lengths"], reverse=True):
    tokens = _text_tokens(jax, jnp, b, length, t["vocab"], 1)
    impl, part = "ours (eos pool, quick_gelu)", f"text_fwd_bwd_L{length}"
    try:
      m = text_lib.TextTransformer(
          vocab_size=t["vocab"], max_len=77, width=t["width"],
          depth=t["depth"], num_heads=t["heads"], mlp_dim=t["mlp"],
          embed_dim=t["embed"], pool="eos", act="quick_gelu",
          dtype=jnp.bfloat16)
      p = jax.jit(m.init)(jax.random.key(0), tokens[:1])["params"]
      grad = jax.jit(jax.grad(lambda p, x, m=m: jnp.sum(
          m.apply({"params": p}, x).astype(jnp.float32) ** 2)))
      compiled, compile_s = harness.aot(grad, p, tokens)
      tm = harness.timeit(compiled, p, tokens, reps=spec["reps"], warmup=2)
    except Exception as e:  # pylint: disable=broad-except
      rows.add(part=part, impl=impl, batch=b, status=harness.failure(e))
      continue
    rows.add(part=part, impl=impl, batch=b, compile_s=compile_s,
             **_timing_row(tm, b))


def child_text_torch(spec, rows):
  """HF CLIPTextModelWithProjection (SDPA), forward + backward, eager and
  torch.compile'd (the whole model, as the ViT), 77 tokens first: each
  row is written when measured, so a child cut by its deadline keeps the
  77-token pair (the comparison still open) and loses the 16-token
  recompilation first. ~100 s on one H200, most of it the two compiles."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import CLIPTextConfig, CLIPTextModelWithProjection  # pylint: disable=import-outside-toplevel,g-multiple-import
  t = spec["sizes"]["text"]
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  cfg = CLIPTextConfig(vocab_size=t["vocab"], hidden_size=t["width"],
                       intermediate_size=t["mlp"], num_hidden_layers=t["depth"],
                       num_attention_heads=t["heads"], projection_dim=t["embed"],
                       max_position_embeddings=77,
                       bos_token_id=t["vocab"] - 2,
                       eos_token_id=t["vocab"] - 1)
  m = CLIPTextModelWithProjection._from_config(  # pylint: disable=protected-access
      cfg, attn_implementation="sdpa").to(dev, torch.bfloat16)
  cases = []
  for length in sorted(t["lengths"], reverse=True):
    ids = torch.randint(2, t["vocab"] - 1, (t["batch"], length), device=dev)
    ids[:, -1] = cfg.eos_token_id

    def step(f, ids=ids):
      m.zero_grad(set_to_none=True)
      f(input_ids=ids).text_embeds.float().pow(2).sum().backward()
    cases.append((f"text_fwd_bwd_L{length}", t["batch"], step))
  torch_rows(rows, torch, m, cases, spec["reps"], "HF CLIP text {} (SDPA)")


def _hf_clip_b16(path):
  """A ViT-B/16 CLIP vision tower with random weights, as HF writes it."""
  if os.path.exists(os.path.join(path, "config.json")):
    return path
  from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection  # pylint: disable=import-outside-toplevel,g-multiple-import
  CLIPVisionModelWithProjection(CLIPVisionConfig(
      hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
      num_attention_heads=12, image_size=224, patch_size=16,
      projection_dim=512)).save_pretrained(path)
  return path


def _lit_tower(spec):
  """(Tower, load seconds): the HF-CLIP-layout checkpoint, loaded."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from train.towers import pretrained  # pylint: disable=import-outside-toplevel
  path = FIXTURE_HF if spec["quick"] else _hf_clip_b16(spec["hf_dir"])
  t0 = time.perf_counter()
  tower = pretrained.load_image_tower(path, dtype=jnp.bfloat16)
  return tower, time.perf_counter() - t0


def child_lit(spec, rows):
  """One LiT train step case: the loaded tower in a mode (precomputed / on
  the fly); step time, the precomputed mode's embedding rate, peak memory."""
  from types import SimpleNamespace as NS  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel,g-multiple-import
  from train import step as step_lib  # pylint: disable=import-outside-toplevel
  from train.towers import text as text_lib  # pylint: disable=import-outside-toplevel
  c, z = spec["case"], spec["sizes"]["lit"]
  b, micro, L, vocab = z["batch"], z["micro"], z["text_len"], z["vocab"]
  precomputed = c["mode"] == "precomputed"
  tower, load_s = _lit_tower(spec)
  s, d = tower.image_size, tower.embed_dim
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  sh = NamedSharding(mesh, P(step_lib.AXIS))
  extra = {}
  if precomputed:
    embed = jax.jit(tower.embed)
    img = jax.device_put(np.random.default_rng(0).integers(
        0, 256, (z["img_batch"], s, s, 3), dtype=np.uint8))
    jax.block_until_ready(embed(tower.params, img))
    # The embedding rate from ``embed_batches`` micro-batches, tiled to B
    # (the step's time does not depend on the values).
    n = z["embed_batches"] * z["img_batch"]
    t0 = time.perf_counter()
    embs = [embed(tower.params, img) for _ in range(z["embed_batches"])]
    emb = jax.block_until_ready(jnp.concatenate(embs).astype(jnp.bfloat16))
    extra["embed_s"], extra["embedded"] = time.perf_counter() - t0, n
    extra["embed_batch"] = z["img_batch"]
    extra["embed_per_s"] = n / extra["embed_s"]
    emb = jnp.tile(emb, (b // n, 1))
    del embs, img
    inputs = {"image_emb": jax.device_put(emb, sh)}
    del emb
  else:
    # Random bits straight into uint8: no int32 copy of the 65,536 images
    # in the peak.
    make = jax.jit(lambda k: jax.random.bits(k, (b, s, s, 3), jnp.uint8),
                   out_shardings=sh)
    inputs = {"image": jax.block_until_ready(make(jax.random.key(2)))}
  txt = text_lib.from_scratch(
      NS(width=z["text_width"], depth=z["text_depth"],
         num_heads=z["text_heads"], mlp_dim=z["text_mlp"]), vocab, L, d,
      jnp.bfloat16)
  train_step, state, _ = harness.lit_step(mesh, tower, txt, b, micro,
                                          precomputed)
  inputs["text"] = jax.device_put(
      _text_tokens(jax, jnp, b, L, vocab, 1), sh)
  compiled, compile_s = harness.aot(train_step, state, inputs)
  holder = {"s": state}

  def one():
    holder["s"], metrics = compiled(holder["s"], inputs)
    holder["loss"] = metrics["loss"]
    return holder["loss"]
  reps = z["reps"] if precomputed else z["reps_on_the_fly"]
  t = harness.timeit(one, reps=reps, warmup=1)
  rows.add(part="lit_step", impl="HF-CLIP checkpoint (quick-GELU, cls), "
           + c["mode"].replace("_", " "),
           batch=b, micro=micro, median_s=t.median, min_s=t.min,
           max_s=t.max, reps=t.reps, compile_s=compile_s, load_s=load_s,
           peak_gib=_peak_gib(), loss=float(holder["loss"]), **extra)


CHILDREN = {"vit": child_vit, "vit_torch": child_vit_torch,
            "text_jax": child_text_jax, "text_torch": child_text_torch,
            "lit": child_lit}


# ----------------------------------------------------------------- parent


def case_spec(name, kind):
  """The label and the per-kind fields of a case of ``PLAN``."""
  if kind == "vit":
    return (("ours, params stored bf16", dict(params_in_dtype=True))
            if name == "vit_p16" else ("ours (default)", {}))
  if kind == "lit":
    _, tower, *mode = name.split("_")
    return name, dict(tower=tower, mode="_".join(mode))
  return name, {}


def child_env(kind):
  """torch children: no JAX pool; JAX children: most of the device."""
  if kind in ("vit_torch", "text_torch"):
    return harness.child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
  return harness.child_env(XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get(
      "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"))


def _fmt(v, f):
  return "-" if v is None else f.format(v)


def summary(rows):
  """The table, by part in a fixed order, and ours over torch.compile."""
  lines = [f"\n{'part':<18}{'implementation':<50}{'per s':>10}"
           f"{'ms':>10}{'peak GiB':>10}  status"]
  key = {p: i for i, p in enumerate(PARTS_ORDER)}
  for r in sorted(rows, key=lambda r: key.get(r.get("part"), 99)):
    ms = None if r.get("median_s") is None else 1e3 * r["median_s"]
    lines.append(f"{r.get('part', '?'):<18}{r.get('impl', r['case']):<50}"
                 f"{_fmt(r.get('per_s'), '{:,.0f}'):>10}"
                 f"{_fmt(ms, '{:.1f}'):>10}"
                 f"{_fmt(r.get('peak_gib'), '{:.1f}'):>10}  {r['status']}")
    if r.get("embed_per_s"):
      lines.append(f"{'':<18}  the tower alone, {r['embedded']:,} images in "
                   f"batches of {r['embed_batch']}: {r['embed_per_s']:,.0f} img/s")
  ok = [r for r in rows if r["status"] == "ok" and r.get("per_s")]
  for part in PARTS_ORDER[:3]:
    ref = [r for r in ok if r["part"] == part and "torch.compile" in r["impl"]]
    for r in ok if ref else ():
      if r["part"] == part and r["impl"].startswith("ours"):
        lines.append(f"{part}: {r['impl']} / {ref[0]['impl']} = "
                     f"{r['per_s'] / ref[0]['per_s']:.3f}")
  return "\n".join(lines)


def main():
  ap = harness.parser(__doc__, out=None)
  ap.add_argument("--budget_s", type=float, default=495,
                  help="seconds for all cases together (children's starts "
                  "included); what does not fit is skipped")
  ap.add_argument("--reps", type=int, default=10,
                  help="timed repetitions of the tower cases")
  ap.add_argument("--cases", default="",
                  help="comma-separated case names (default: all of PLAN)")
  ap.add_argument("--quick", action="store_true",
                  help="tiny sizes: a CPU smoke run (torch cases need torch)")
  args = ap.parse_args()
  if args.case:
    spec = json.loads(args.case)
    rows = Emitter(spec)
    CHILDREN[spec["kind"]](spec, rows)
    harness.print_result({"rows": rows.rows})
    return 0
  wanted = [x for x in args.cases.split(",") if x]
  unknown = sorted(set(wanted) - {p[0] for p in PLAN})
  if unknown:
    ap.error(f"unknown --cases {unknown}; known: {[p[0] for p in PLAN]}")

  budget = harness.Budget(args.budget_s)
  os.makedirs(args.out, exist_ok=True)
  jsonl = os.path.join(args.out, "bench_towers.jsonl")
  open(jsonl, "w").close()
  plan = [p for p in PLAN if not wanted or p[0] in wanted]
  hf_dir = tempfile.mkdtemp(prefix="bench_towers_hf_")
  print(f"bench_towers: {len(plan)} cases, budget {args.budget_s:.0f} s, "
        f"rows -> {jsonl}", flush=True)
  try:
    for name, kind, est_s, cap_s in plan:
      label, case = case_spec(name, kind)
      needs_torch = kind in ("vit_torch", "text_torch") or (
          kind == "lit" and not args.quick)
      status = budget.skip(0 if args.quick else est_s)
      if needs_torch and importlib.util.find_spec("torch") is None:
        status = "skipped: torch is not installed"
      if status is None:
        spec = dict(name=name, kind=kind, label=label, case=case,
                    sizes=sizes(args.quick), reps=2 if args.quick else args.reps,
                    quick=args.quick, jsonl=jsonl, t0=budget.t0,
                    hf_dir=hf_dir)
        print(f"[{budget.elapsed():5.0f} s] {name} ...", flush=True)
        r = harness.run_child(
            [os.path.abspath(__file__), "--case", json.dumps(spec)],
            timeout_s=budget.deadline(cap_s),
            env=child_env(kind))
        status = None if "rows" in r else r.get("status", "no result")
        for row in r.get("rows", ()):
          print(f"        {row['impl']}: {row['status']}"
                + (f", {row['median_s'] * 1e3:.1f} ms" if row.get("median_s")
                   else ""), flush=True)
      if status is not None:
        harness.append_jsonl(jsonl, dict(
            case=name, part=PART[kind], impl=label, status=status,
            elapsed_s=round(budget.elapsed(), 1)))
        print(f"        {name}: {status[:300]}", flush=True)
  finally:
    shutil.rmtree(hf_dir, ignore_errors=True)
  print(summary(harness.read_jsonl(jsonl)))
  print(f"\nwhole run {budget.elapsed():.0f} s; rows: {jsonl}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
