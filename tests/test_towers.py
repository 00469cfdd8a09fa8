"""The configurable ViT, the text tower and the trainer's tower config."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.towers import build
from train.towers import layers
from train.towers import text as text_lib
from train.towers import vit as vit_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _vit(**kw):
  base = dict(patch_size=4, width=16, depth=2, num_heads=2, mlp_dim=32)
  return vit_lib.ViT(**{**base, **kw})


@pytest.mark.parametrize("kw", [
    dict(pool="gap", embed_dim=8),
    dict(class_token=True, pos_embed_cls=True, pre_norm=True, pool="tok",
         final_norm="pooled", act="quick_gelu", embed_dim=8, head_bias=False,
         patch_bias=False, ln_eps=1e-5),
    dict(pool="map", act="gelu_tanh"),
    dict(class_token=True, pool="gap", final_norm="pooled", qkv_bias=False,
         layer_scale=True),
])
def test_vit_variants_run_and_have_the_named_params(kw):
  m = _vit(**kw)
  x = jax.random.normal(jax.random.key(0), (3, 20, 20, 3))
  p = m.init(jax.random.key(1), x)["params"]
  out = m.apply({"params": p}, x)
  assert out.shape == (3, kw.get("embed_dim") or 16)
  n_pos = 25 + (1 if kw.get("pos_embed_cls") else 0)
  assert p["pos_embedding"].shape == (1, n_pos, 16)
  assert ("cls" in p) == bool(kw.get("class_token"))
  assert ("pre_norm" in p) == bool(kw.get("pre_norm"))
  assert ("map_head" in p) == (kw.get("pool") == "map")
  assert ("bias" in p["encoder"]["block0"]["attn"]["qkv"]) == kw.get(
      "qkv_bias", True)
  # Each image's embedding depends on that image only.
  np.testing.assert_allclose(m.apply({"params": p}, x[1:2]), out[1:2],
                             rtol=1e-5, atol=1e-6)


def test_vit_rejects_bad_settings():
  x = jnp.zeros((1, 8, 8, 3))
  for kw, msg in ((dict(pool="max"), "pool"), (dict(final_norm="x"),
                                               "final_norm"),
                  (dict(pool="tok"), "class_token")):
    with pytest.raises(ValueError, match=msg):
      _vit(**kw).init(jax.random.key(0), x)


def test_attention_equals_a_float64_reference():
  att = layers.Attention(num_heads=3)
  x = jax.random.normal(jax.random.key(0), (2, 7, 12))
  p = att.init(jax.random.key(1), x)["params"]
  lengths = jnp.array([7, 4])
  for causal in (False, True):
    out = att.apply({"params": p}, x, lengths=lengths, causal=causal)
    xd = np.asarray(x, np.float64)
    k = {n: np.asarray(v, np.float64) for n, v in p["qkv"].items()}
    qkv = np.einsum("btd,dphe->btphe", xd, k["kernel"]) + k["bias"]
    q, kk, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    s = np.einsum("bqhe,bkhe->bhqk", q, kk) / np.sqrt(4)
    mask = np.arange(7)[None, None, None, :] < np.asarray(lengths)[:, None,
                                                                   None, None]
    if causal:
      mask = mask & np.tril(np.ones((7, 7), bool))[None, None]
    s = np.where(mask, s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhe->bqhe", w, v)
    ref = np.einsum("bqhe,hed->bqd", o, np.asarray(p["out"]["kernel"])) + \
        np.asarray(p["out"]["bias"])
    rows = [(0, slice(None)), (1, slice(0, 4))]  # Only rows with keys kept.
    for b, sl in rows:
      np.testing.assert_allclose(out[b, sl], ref[b, sl], rtol=1e-5,
                                 atol=1e-5)


@pytest.mark.parametrize("causal,lengths", [(False, None), (True, None),
                                            (False, [7, 5, 2]),
                                            (True, [7, 5, 6])])
def test_pruned_last_block_equals_every_token_then_picked(causal, lengths):
  # The pooled token of each row (any position, the last included) through
  # an encoder whose last block computes that token only, against the same
  # params computing every token; values and parameter gradients.
  kw = dict(depth=2, num_heads=2, mlp_dim=24, layer_scale=True)
  x = jax.random.normal(jax.random.key(0), (3, 7, 12))
  query = jnp.array([0, 4, 6], jnp.int32)
  lens = None if lengths is None else jnp.array(lengths, jnp.int32)
  pruned = layers.Encoder(**kw)
  full = layers.Encoder(**kw, prune_last=False)
  p = pruned.init(jax.random.key(1), x, lens, causal, query)["params"]

  def out(m, p_):
    return m.apply({"params": p_}, x, lens, causal, query)

  def loss(m, p_):
    return jnp.sum(jnp.sin(out(m, p_)))

  got, want = out(pruned, p), out(full, p)
  assert got.shape == (3, 12)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  g_got, g_want = jax.grad(loss, 1)(pruned, p), jax.grad(loss, 1)(full, p)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               g_got, g_want)
  # The last block's MLP sees one token per row, the first block's all.
  hlo = jax.jit(lambda p_: out(pruned, p_)).lower(p).as_text()
  assert "3x1x24" in hlo and "3x7x24" in hlo


def test_gelu_is_the_erf_gelu_of_a_float64_reference():
  import math  # pylint: disable=import-outside-toplevel
  x = np.concatenate([np.linspace(-8, 8, 4001), [-30.0, 30.0]])
  ref = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
  got = np.asarray(layers.gelu(jnp.asarray(x, jnp.float32)), np.float64)
  # float32 rounding of x, of erf and of 1 + erf: absolute, scaled by |x|.
  np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)
  assert np.max(np.abs(got - ref) / np.maximum(np.abs(x), 1)) < 4e-7
  np.testing.assert_allclose(got, jax.nn.gelu(x.astype(np.float32),
                                              approximate=False), atol=2e-6)
  # 16-bit in, 16-bit out, computed in float32 (one rounding at the end).
  xb = jnp.asarray(x, jnp.bfloat16)
  yb = layers.gelu(xb)
  assert yb.dtype == jnp.bfloat16
  exact = np.array([float(v) * 0.5 * math.erfc(-float(v) / math.sqrt(2))
                    for v in np.asarray(xb, np.float64)])
  np.testing.assert_allclose(np.asarray(yb, np.float64), exact, rtol=2**-8,
                             atol=1e-6)
  assert layers.activation("gelu") is layers.gelu
  with pytest.raises(ValueError, match="activation must be one of"):
    layers.activation("relu")


def test_resample_keeps_prefix_and_is_identity_at_the_same_grid():
  pos = np.random.default_rng(0).normal(size=(1, 1 + 9, 4)).astype(np.float32)
  assert vit_lib.resample_pos_embedding(pos, 1, 3) is pos
  out = vit_lib.resample_pos_embedding(pos, 1, 5)
  assert out.shape == (1, 26, 4)
  np.testing.assert_array_equal(out[:, 0], pos[:, 0])
  const = np.ones((1, 16, 4), np.float32)
  np.testing.assert_allclose(vit_lib.resample_pos_embedding(const, 0, 7), 1.0,
                             rtol=1e-6)
  with pytest.raises(ValueError, match="square patch grid"):
    vit_lib.resample_pos_embedding(np.zeros((1, 10, 4)), 0, 3)


@pytest.mark.parametrize("pool", ["mean", "eos"])
def test_text_tower_ignores_padding(pool):
  m = text_lib.TextTransformer(vocab_size=30, max_len=12, width=16, depth=2,
                               num_heads=2, mlp_dim=32, embed_dim=8, pool=pool)
  tokens = np.array([[5, 6, 7, 1, 0, 0, 0, 0, 0],
                     [9, 1, 0, 0, 0, 0, 0, 0, 0]], np.int32)
  p = m.init(jax.random.key(0), tokens)["params"]
  out = m.apply({"params": p}, tokens)                    # Odd length 9.
  out_short = m.apply({"params": p}, tokens[:, :4])        # Even length 4.
  np.testing.assert_allclose(out, out_short, rtol=2e-5, atol=1e-6)
  if pool == "eos":  # Whatever follows the EOS does not matter.
    noisy = tokens.copy()
    noisy[0, 5:] = 3
    np.testing.assert_allclose(m.apply({"params": p}, noisy)[0], out[0],
                               rtol=2e-5, atol=1e-6)
  with pytest.raises(ValueError, match="longer than the tower's max_len"):
    m.apply({"params": p}, np.ones((1, 13), np.int32))


# --------------------------------------------------------- the config


def _config(arg):
  sys.path.insert(0, ROOT)
  from configs import lit_demo, lit_pretrained  # pylint: disable=g-import-not-at-top
  return (lit_pretrained if arg.startswith("p:") else lit_demo).get_config(
      arg[2:])


def test_a_given_missing_init_is_an_error_not_a_pretraining(tmp_path):
  """The demo with --config.model.image.init=PATH: PATH must exist; the
  demo's own pretraining (model.image.pretrain_path) is not run for it."""
  c = _config("d:")
  assert c.model.image.pretrain_path and c.model.image.pretrain_steps > 0
  missing = tmp_path / "nope.npz"
  c.model.image.init = str(missing)
  with pytest.raises(FileNotFoundError, match="image tower checkpoint not "
                     "found: " + str(missing)):
    build.make_image_tower(c, jnp.float32)
  assert not missing.exists()
  c.model.image.kind = "pretrained"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    build.make_image_tower(c, jnp.float32)


def test_pretrained_config_builds_the_towers_and_checks_sizes():
  from train import config_base  # pylint: disable=g-import-not-at-top
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  from train.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  c = _config("p:tiny")
  config_base.check_config(c)
  tok = tokenizer_lib.make_tokenizer(c)
  img, txt, head = train_lib.make_models(c, tok)
  assert img.embed_dim == 20 and img.image_size == 32 and txt.pool == "eos"
  params = train_lib.init_params(c, img, txt, head, tok)
  assert params["txt"]["token_embedding"]["embedding"].shape[0] == \
      tok.vocab_size
  c.model.embed_dim = 64
  with pytest.raises(ValueError, match="embeds into 20 dimensions"):
    train_lib.make_models(c, tok)
  c.model.embed_dim = 0
  c.model.image.kind = "cnn"
  with pytest.raises(ValueError, match="embed_dim=0 must be >= 1"):
    config_base.check_config(c)
  for arg in ("hf", "hf_text", "siglip", "timm", "open_clip", "bv"):
    config_base.check_config(_config("p:" + arg))
  # Each key is its own: moving the image tower moves nothing else, and an
  # unset tokenizer path is the checkpoint's (the text tower's first).
  from train.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  c = _config("p:hf_text")
  c.model.image.init = "/ckpt/clip"
  assert c.tokenizer.bpe_path == "" and c.model.text.init != "/ckpt/clip"
  assert tok_lib.resolve_tokenizer_config(c).bpe_path == c.model.text.init
  c.model.text.init = ""
  assert tok_lib.resolve_tokenizer_config(c).bpe_path == "/ckpt/clip"
  c.tokenizer.bpe_path = "/elsewhere/tokenizer.json"
  assert tok_lib.resolve_tokenizer_config(c).bpe_path == \
      "/elsewhere/tokenizer.json" and c.model.image.init == "/ckpt/clip"
  c = _config("p:siglip")
  c.model.image.init = "/ckpt/siglip"
  assert c.tokenizer.spm_path == ""
  assert tok_lib.resolve_tokenizer_config(c).spm_path == \
      "/ckpt/siglip/spiece.model"


@pytest.mark.slow
def test_lit_pretrained_tiny_trains_end_to_end(tmp_path):
  """train.main with the committed HF CLIP fixture as the locked tower and
  the text tower's start (a real subprocess, as a user runs it)."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             INFCL_DATA_DIR=str(tmp_path / "data"))
  r = subprocess.run(
      [sys.executable, "-m", "train.main", "--config",
       os.path.join(ROOT, "configs/lit_pretrained.py") + ":tiny",
       "--workdir", str(tmp_path / "w"), "--config.progress_bar=False"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "image tower pretrained locked" in r.stdout
  assert "[lit] done: 6 steps" in r.stdout


def _made(pit, c):
  """The demo's tower as the trainer makes it: its cache, then the tower."""
  pit.make_current(c)
  return build.make_image_tower(c, jnp.float32)


def test_the_demo_tower_cache_is_remade_when_its_recipe_changes(tmp_path):
  """The demo's pretrained tower is cached at model.image.pretrain_path with
  its recipe beside it: reused while the recipe holds, made again (not used
  silently) when the file has no recipe or another one."""
  from train import pretrain_image_tower as pit  # pylint: disable=g-import-not-at-top
  c = _config("d:")
  c.data.data_dir = str(tmp_path / "tfds")
  c.model.image.pretrain_path = str(tmp_path / "tower.npz")
  c.model.image.pretrain_steps = 2
  path = c.model.image.pretrain_path
  t1 = _made(pit, c)
  recipe = open(path + ".recipe").read().strip()
  assert recipe == pit.recipe(c, 2) and pit.is_current(path, c, 2)
  stamp = os.stat(path).st_mtime_ns
  t2 = _made(pit, c)   # the cache, as it is
  assert os.stat(path).st_mtime_ns == stamp
  assert t2.fingerprint == t1.fingerprint
  # Another recipe (more steps): the file is stale and made again.
  c.model.image.pretrain_steps = 3
  assert pit.recipe(c, 3) != recipe and not pit.is_current(path, c, 3)
  _made(pit, c)
  assert os.stat(path).st_mtime_ns != stamp
  assert open(path + ".recipe").read().strip() == pit.recipe(c, 3)
  # A tower without its recipe (e.g. written by an older version): remade.
  os.remove(path + ".recipe")
  assert not pit.is_current(path, c, 3)
  _made(pit, c)
  assert pit.is_current(path, c, 3)
