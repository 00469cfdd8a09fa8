"""Writes tests/fixtures/towers/: tiny random checkpoints in the on-disk
layouts users get, and the reference implementations' embeddings of them.

Runs in a Python 3.11 venv with torch, transformers, timm and open_clip
(``scripts/tower_oracles.sh`` makes it, the CI leg runs it); the tests then
need only numpy and safetensors. Each checkpoint is written the way its
library writes it (``save_pretrained``, timm's ``save_for_hf``, OpenCLIP's
hub config + safetensors), except the big_vision ``.npz``s, which have no
pip package: they are built by big_vision's documented parameter names from
the weights of an HF SigLIP and a timm model, whose outputs are their
oracle.

    python scripts/make_tower_fixtures.py OUT_DIR
    python scripts/make_tower_fixtures.py --check tests/fixtures/towers

``OUT_DIR/expected.npz`` holds, per fixture, the uint8 images and the
reference embedding computed in float64 (``<name>/images``,
``<name>/embedding``); ``OUT_DIR/tokenizer_expected.json`` the CLIP
tokenizer's ids of a few texts. ``--check DIR`` writes them to a temporary
directory and compares them with DIR (the committed ones): the same files,
the same JSON, bit-identical tensors, embeddings within 1e-7 relative.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

SEED = 0
S, P, W, HEADS, DEPTH, MLP = 32, 8, 32, 4, 2, 64
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
OPENAI = ((0.48145466, 0.4578275, 0.40821073),
          (0.26862954, 0.26130258, 0.27577711))
TEXTS = ["a photo of a cat.", "A Photo of TWO dogs!!", "  lots   of   space ",
         "unicode: café naïve", "numbers 12345 and 3.14", ""]


def _images(seed, n=3, size=S):
  return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3),
                                              dtype=np.uint8)


def _pixels(images, mean, std):
  x = images.astype(np.float64) / 255.0
  x = (x - np.asarray(mean)) / np.asarray(std)
  return torch.from_numpy(x.transpose(0, 3, 1, 2).copy())


def _randomize(model):
  """Non-trivial weights everywhere (LayerNorms and biases included), so a
  swapped or dropped tensor changes the output."""
  g = torch.Generator().manual_seed(SEED)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("norm1.weight", "norm2.weight", "layernorm.weight")) \
          or ".weight" in name and p.ndim == 1:
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(0.2 * torch.randn(p.shape, generator=g))
  return model.eval()


def _expect(out, name, images, emb):
  out[f"{name}/images"] = images
  out[f"{name}/embedding"] = np.asarray(emb, np.float64)


# ------------------------------------------------------------ Hugging Face


def hf_clip(root, out):
  from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
  from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
  vc = dict(hidden_size=W, intermediate_size=MLP, num_hidden_layers=DEPTH,
            num_attention_heads=HEADS, image_size=S, patch_size=P)
  torch.manual_seed(SEED)
  m = _randomize(CLIPVisionModelWithProjection(
      CLIPVisionConfig(**vc, projection_dim=24)))
  d = os.path.join(root, "hf_clip_vision")
  m.save_pretrained(d)
  CLIPImageProcessor(image_mean=list(IMAGENET[0]), image_std=list(
      IMAGENET[1]), size={"shortest_edge": S}, crop_size=S).save_pretrained(d)
  img = _images(1)
  with torch.no_grad():
    emb = m.double()(pixel_values=_pixels(img, *IMAGENET)).image_embeds
  _expect(out, "hf_clip_vision", img, emb)

  # CLIPModel: no preprocessor_config.json (OpenAI's mean/std by default);
  # its text tower uses the fixture vocabulary (tokenizer_expected.json).
  vocab = json.load(open(os.path.join(root, "clip_bpe", "vocab.json")))
  cfg = CLIPConfig(
      vision_config=dict(**vc, hidden_act="gelu"),
      text_config=dict(vocab_size=len(vocab), hidden_size=W,
                       intermediate_size=MLP, num_hidden_layers=DEPTH,
                       num_attention_heads=HEADS, max_position_embeddings=24,
                       bos_token_id=vocab["<|startoftext|>"],
                       eos_token_id=vocab["<|endoftext|>"],
                       pad_token_id=vocab["<|endoftext|>"]),
      projection_dim=20)
  torch.manual_seed(SEED + 1)
  m = _randomize(CLIPModel(cfg))
  d = os.path.join(root, "hf_clip")
  m.save_pretrained(d)
  img = _images(2)
  m = m.double()
  with torch.no_grad():
    emb = m.get_image_features(pixel_values=_pixels(img, *OPENAI))
    emb = getattr(emb, "pooler_output", emb)
    ids = clip_ids(root)
    temb = []
    for row in ids:
      t = m.get_text_features(input_ids=torch.tensor([row]))
      temb.append(getattr(t, "pooler_output", t)[0].numpy())
  _expect(out, "hf_clip", img, emb)
  out["hf_clip/text_embedding"] = np.stack(temb)


def hf_siglip(root, out):
  from transformers import SiglipImageProcessor, SiglipVisionConfig
  from transformers import SiglipVisionModel
  torch.manual_seed(SEED + 2)
  m = _randomize(SiglipVisionModel(SiglipVisionConfig(
      hidden_size=W, intermediate_size=MLP, num_hidden_layers=DEPTH,
      num_attention_heads=HEADS, image_size=S, patch_size=P)))
  d = os.path.join(root, "hf_siglip")
  m.save_pretrained(d)
  SiglipImageProcessor(size={"height": S, "width": S}).save_pretrained(d)
  img = _images(3)
  m = m.double()
  with torch.no_grad():
    emb = m(pixel_values=_pixels(img, (0.5,) * 3, (0.5,) * 3)).pooler_output
  _expect(out, "hf_siglip", img, emb)
  # The same weights by big_vision's names, as a SigLIP two-tower .npz.
  from safetensors.numpy import load_file
  sd = load_file(os.path.join(d, "model.safetensors"))  # As users have it.
  np.savez(os.path.join(root, "bv_siglip.npz"), **_bv_from_siglip(sd))
  _expect(out, "bv_siglip", img, emb)


def _bv_attn(prefix, wq, bq, wk, bk, wv, bv, wo, bo):
  """torch q/k/v/out Linear weights -> big_vision's MultiHeadDotProductAttention
  (query/key/value kernel [D, H, hd], bias [H, hd]; out kernel [H, hd, D])."""
  d = wq.shape[1]
  hd = d // HEADS
  o = {}
  for n, w, b in (("query", wq, bq), ("key", wk, bk), ("value", wv, bv)):
    o[f"{prefix}/{n}/kernel"] = w.T.reshape(d, HEADS, hd)
    o[f"{prefix}/{n}/bias"] = b.reshape(HEADS, hd)
  o[f"{prefix}/out/kernel"] = wo.T.reshape(HEADS, hd, d)
  o[f"{prefix}/out/bias"] = bo
  return o


def _bv_from_siglip(sd):
  r = "params/img/"
  # transformers 5 saves a SiglipVisionModel without the "vision_model."
  # prefix; older versions (and SiglipModel) with it.
  v = "vision_model." if any(k.startswith("vision_model.") for k in sd) else ""
  o = {r + "embedding/kernel": sd[v + "embeddings.patch_embedding.weight"]
       .transpose(2, 3, 1, 0),
       r + "embedding/bias": sd[v + "embeddings.patch_embedding.bias"],
       r + "pos_embedding": sd[v + "embeddings.position_embedding.weight"][None]}
  for i in range(DEPTH):
    s, b = f"{v}encoder.layers.{i}.", f"{r}Transformer/encoderblock_{i}/"
    for ln, n in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
      o[b + ln + "/scale"], o[b + ln + "/bias"] = sd[s + n + ".weight"], sd[
          s + n + ".bias"]
    a = s + "self_attn."
    o.update(_bv_attn(b + "MultiHeadDotProductAttention_0",
                      *(sd[a + f"{n}_proj.{t}"] for n in "qkv"
                        for t in ("weight", "bias")),
                      sd[a + "out_proj.weight"], sd[a + "out_proj.bias"]))
    for j, n in ((0, "fc1"), (1, "fc2")):
      o[b + f"MlpBlock_0/Dense_{j}/kernel"] = sd[s + f"mlp.{n}.weight"].T
      o[b + f"MlpBlock_0/Dense_{j}/bias"] = sd[s + f"mlp.{n}.bias"]
  o[r + "Transformer/encoder_norm/scale"] = sd[v + "post_layernorm.weight"]
  o[r + "Transformer/encoder_norm/bias"] = sd[v + "post_layernorm.bias"]
  h, m = v + "head.", r + "MAPHead_0/"
  o[m + "probe"] = sd[h + "probe"]
  wi, bi = sd[h + "attention.in_proj_weight"], sd[h + "attention.in_proj_bias"]
  o.update(_bv_attn(m + "MultiHeadDotProductAttention_0",
                    wi[:W], bi[:W], wi[W:2 * W], bi[W:2 * W], wi[2 * W:],
                    bi[2 * W:], sd[h + "attention.out_proj.weight"],
                    sd[h + "attention.out_proj.bias"]))
  o[m + "LayerNorm_0/scale"], o[m + "LayerNorm_0/bias"] = sd[
      h + "layernorm.weight"], sd[h + "layernorm.bias"]
  for j, n in ((0, "fc1"), (1, "fc2")):
    o[m + f"MlpBlock_0/Dense_{j}/kernel"] = sd[h + f"mlp.{n}.weight"].T
    o[m + f"MlpBlock_0/Dense_{j}/bias"] = sd[h + f"mlp.{n}.bias"]
  # The rest of a SigLIP checkpoint, which the image loader ignores.
  o["params/txt/Embed_0/embedding"] = np.zeros((8, W), np.float32)
  o["params/t"], o["params/b"] = np.ones((1,), np.float32), np.zeros(
      (1,), np.float32)
  return o


# ------------------------------------------------------------------ timm


def timm_models(root, out):
  import timm
  from timm.models import save_for_hf
  cases = {
      # A class-token ViT, pooled at the token; ImageNet mean/std.
      "timm_token": dict(arch="vit_base_patch16_224", global_pool="token",
                         overlay=dict(mean=IMAGENET[0], std=IMAGENET[1])),
      # GAP with fc_norm after the pooling, layer scale, no qkv bias.
      "timm_gap": dict(arch="vit_small_patch16_224", global_pool="avg",
                       init_values=0.5, qkv_bias=False),
      # MAP (attention-pool) head, no class token.
      "timm_map": dict(arch="vit_base_patch16_224", global_pool="map",
                       class_token=False),
  }
  for i, (name, c) in enumerate(cases.items()):
    args = dict(img_size=S, patch_size=P, embed_dim=W, depth=DEPTH,
                num_heads=HEADS, mlp_ratio=MLP / W, num_classes=0,
                global_pool=c["global_pool"])
    for k in ("init_values", "qkv_bias", "class_token"):
      if k in c:
        args[k] = c[k]
    torch.manual_seed(SEED + 10 + i)
    m = _randomize(timm.create_model(
        c["arch"], pretrained=False,
        pretrained_cfg_overlay=c.get("overlay", {}), **args))
    d = os.path.join(root, name)
    save_for_hf(m, d, model_args=args, safe_serialization=True)
    cfg = m.pretrained_cfg
    img = _images(10 + i)
    with torch.no_grad():
      emb = m.double()(_pixels(img, cfg["mean"], cfg["std"]))
    _expect(out, name, img, emb)

  # big_vision's classifier layout (scanned blocks, class token without a
  # position, tanh-GELU, head dropped) from a timm model that computes the
  # same function: no_embed_class, gelu_tanh.
  args = dict(img_size=S, patch_size=P, embed_dim=W, depth=DEPTH,
              num_heads=HEADS, mlp_ratio=MLP / W, num_classes=5,
              global_pool="token", no_embed_class=True, act_layer="gelu_tanh")
  torch.manual_seed(SEED + 20)
  m = _randomize(timm.create_model("vit_base_patch16_224", pretrained=False,
                                   **args))
  sd = {k: v.float().numpy() for k, v in m.state_dict().items()}
  np.savez(os.path.join(root, "bv_classifier.npz"), **_bv_from_timm(sd))
  m.reset_classifier(0)
  img = _images(20)
  with torch.no_grad():
    emb = m.double()(_pixels(img, (0.5,) * 3, (0.5,) * 3))
  _expect(out, "bv_classifier", img, emb)


def _bv_from_timm(sd):
  o = {"embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
       "embedding/bias": sd["patch_embed.proj.bias"],
       "cls": sd["cls_token"], "pos_embedding": sd["pos_embed"],
       "head/kernel": sd["head.weight"].T, "head/bias": sd["head.bias"]}
  per = {}
  for i in range(DEPTH):
    s = f"blocks.{i}."
    wq, wk, wv = np.split(sd[s + "attn.qkv.weight"], 3)
    bq, bk, bv = np.split(sd[s + "attn.qkv.bias"], 3)
    blk = _bv_attn("MultiHeadDotProductAttention_0", wq, bq, wk, bk, wv, bv,
                   sd[s + "attn.proj.weight"], sd[s + "attn.proj.bias"])
    for ln, n in (("LayerNorm_0", "norm1"), ("LayerNorm_1", "norm2")):
      blk[ln + "/scale"], blk[ln + "/bias"] = sd[s + n + ".weight"], sd[
          s + n + ".bias"]
    for j, n in ((0, "fc1"), (1, "fc2")):
      blk[f"MlpBlock_0/Dense_{j}/kernel"] = sd[s + f"mlp.{n}.weight"].T
      blk[f"MlpBlock_0/Dense_{j}/bias"] = sd[s + f"mlp.{n}.bias"]
    for k, a in blk.items():
      per.setdefault(k, []).append(a)
  # Scanned (nn.scan) layout: one stacked array per name, depth first.
  o.update({f"Transformer/encoderblock/{k}": np.stack(v)
            for k, v in per.items()})
  o["Transformer/encoder_norm/scale"] = sd["norm.weight"]
  o["Transformer/encoder_norm/bias"] = sd["norm.bias"]
  return o


# -------------------------------------------------------------- OpenCLIP


def open_clip_model(root, out):
  import open_clip
  from open_clip.push_to_hf_hub import save_config_for_hf
  import safetensors.torch
  from pathlib import Path
  model_cfg = dict(embed_dim=24, quick_gelu=True,
                   vision_cfg=dict(image_size=S, patch_size=P, width=W,
                                   layers=DEPTH, head_width=W // HEADS,
                                   mlp_ratio=MLP / W),
                   text_cfg=dict(context_length=16, vocab_size=64, width=W,
                                 heads=HEADS, layers=1))
  torch.manual_seed(SEED + 30)
  m = _randomize(open_clip.CLIP(**model_cfg))
  # Set by open_clip.create_model (the architecture's default): OpenAI's.
  m.visual.image_mean, m.visual.image_std = OPENAI
  d = os.path.join(root, "open_clip")
  os.makedirs(d, exist_ok=True)
  # What open_clip's save_for_hf writes (less the tokenizer files).
  safetensors.torch.save_file(m.state_dict(),
                              os.path.join(d, "open_clip_model.safetensors"))
  save_config_for_hf(m, Path(d) / "open_clip_config.json", model_cfg)
  img = _images(30)
  with torch.no_grad():
    emb = m.double().encode_image(_pixels(img, OPENAI[0], OPENAI[1]))
  _expect(out, "open_clip", img, emb)


# ------------------------------------------------------------- tokenizer


def _bytes_to_unicode():
  """GPT-2/CLIP's printable stand-in for each byte (a documented table)."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
        + list(range(0xAE, 0x100)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def clip_bpe(root):
  """A small CLIP-format vocabulary: the 256 byte symbols, each with the
  end-of-word "</w>", merges learned on a few sentences, the two specials."""
  b2u = _bytes_to_unicode()
  corpus = ("a photo of a cat . a photo of two dogs ! the cat and the dog "
            "photo of the space numbers and unicode cafe naive ") * 3
  words = [tuple(b2u[b] for b in w.encode()) for w in corpus.split()]
  words = [w[:-1] + (w[-1] + "</w>",) for w in words]
  merges = []
  for _ in range(60):
    counts = {}
    for w in words:
      for a, b in zip(w, w[1:]):
        counts[(a, b)] = counts.get((a, b), 0) + 1
    if not counts:
      break
    pair = max(sorted(counts), key=lambda k: counts[k])
    merges.append(pair)
    new = []
    for w in words:
      out, i = [], 0
      while i < len(w):
        if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
          out.append(w[i] + w[i + 1])
          i += 2
        else:
          out.append(w[i])
          i += 1
      new.append(tuple(out))
    words = new
  symbols = list(b2u.values())
  vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
  vocab += ["<|startoftext|>", "<|endoftext|>"]
  d = os.path.join(root, "clip_bpe")
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "vocab.json"), "w") as f:
    json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
  with open(os.path.join(d, "merges.txt"), "w") as f:
    f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
  from transformers import CLIPTokenizer
  tok = CLIPTokenizer(os.path.join(d, "vocab.json"),
                      os.path.join(d, "merges.txt"))
  os.makedirs(os.path.join(root, "clip_bpe_json"), exist_ok=True)
  tok.save_pretrained(os.path.join(root, "clip_bpe_json"))
  for n in os.listdir(os.path.join(root, "clip_bpe_json")):
    if n not in ("tokenizer.json",):
      os.remove(os.path.join(root, "clip_bpe_json", n))


def clip_ids(root):
  from transformers import CLIPTokenizer
  d = os.path.join(root, "clip_bpe")
  tok = CLIPTokenizer(os.path.join(d, "vocab.json"),
                      os.path.join(d, "merges.txt"))
  return [tok(t)["input_ids"] for t in TEXTS]


def check(committed: str) -> int:
  """Regenerates into a temporary directory and compares with ``committed``."""
  import tempfile
  from safetensors.numpy import load_file
  with tempfile.TemporaryDirectory() as tmp:
    write(tmp)
    problems = []
    files = lambda d: sorted(  # noqa: E731
        os.path.relpath(os.path.join(r, f), d)
        for r, _, fs in os.walk(d) for f in fs if f != "README.md")
    a, b = files(committed), files(tmp)
    if a != b:
      problems.append(f"files differ: committed only {sorted(set(a) - set(b))}"
                      f", regenerated only {sorted(set(b) - set(a))}")
    for f in sorted(set(a) & set(b)):
      x, y = os.path.join(committed, f), os.path.join(tmp, f)
      if f.endswith(".json"):
        if json.load(open(x, encoding="utf-8")) != json.load(
            open(y, encoding="utf-8")):
          problems.append(f"{f}: JSON differs")
      elif f.endswith(".safetensors"):
        tx, ty = load_file(x), load_file(y)
        if sorted(tx) != sorted(ty) or any(
            not np.array_equal(tx[k], ty[k]) for k in tx):
          problems.append(f"{f}: tensors differ")
      elif f.endswith(".npz"):
        with np.load(x) as nx, np.load(y) as ny:
          if sorted(nx.files) != sorted(ny.files):
            problems.append(f"{f}: array names differ")
            continue
          for k in nx.files:
            u, v = nx[k], ny[k]
            scale = max(float(np.max(np.abs(v))) if v.size else 0.0, 1e-30)
            if u.shape != v.shape or (
                float(np.max(np.abs(u.astype(np.float64) - v))) / scale
                > 1e-7 if u.size else False):
              problems.append(f"{f}:{k} differs")
      elif open(x, "rb").read() != open(y, "rb").read():
        problems.append(f"{f}: bytes differ")
  for p in problems:
    print("MISMATCH", p)
  print(f"{len(a)} committed fixture files checked against the reference "
        f"libraries: {len(problems)} mismatches")
  return 1 if problems else 0


def write(root: str) -> None:
  os.makedirs(root, exist_ok=True)
  out = {}
  clip_bpe(root)
  with open(os.path.join(root, "tokenizer_expected.json"), "w") as f:
    json.dump({"texts": TEXTS, "ids": clip_ids(root)}, f, ensure_ascii=False,
              indent=0)
  hf_clip(root, out)
  hf_siglip(root, out)
  timm_models(root, out)
  open_clip_model(root, out)
  np.savez(os.path.join(root, "expected.npz"), **out)
  print(f"wrote {len(out) // 2} fixtures to {root}")


def main(argv):
  torch.set_num_threads(1)  # Same float order on every machine size.
  if len(argv) == 3 and argv[1] == "--check":
    sys.exit(check(argv[2]))
  if len(argv) != 2 or argv[1].startswith("-"):
    sys.exit("usage: make_tower_fixtures.py OUT_DIR | --check DIR")
  write(argv[1])


if __name__ == "__main__":
  main(sys.argv)
