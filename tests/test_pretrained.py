"""train.towers.pretrained against the reference implementations' own
embeddings.

The fixtures (tests/fixtures/towers/) are tiny random checkpoints written by
transformers, timm and open_clip in the layouts users get, plus the
embeddings those libraries compute of fixed uint8 images in float64
(scripts/make_tower_fixtures.py; CI regenerates them with the libraries and
checks them against the committed ones, scripts/tower_oracles.sh). Here only
numpy and safetensors are needed.
"""
import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from safetensors.numpy import save_file

from train.towers import pretrained
from train import towers
from train.data import tokenizer as tokenizer_lib
from train.towers import text as text_lib

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "towers")
EXPECTED = np.load(os.path.join(FIX, "expected.npz"))

# fixture -> (path, format, image mean)
CASES = {
    "hf_clip_vision": ("hf_clip_vision", "hf-clip", (0.485, 0.456, 0.406)),
    "hf_clip": ("hf_clip", "hf-clip", (0.48145466, 0.4578275, 0.40821073)),
    "hf_siglip": ("hf_siglip", "hf-siglip", (0.5, 0.5, 0.5)),
    "bv_siglip": ("bv_siglip.npz", "big_vision", (0.5, 0.5, 0.5)),
    "bv_classifier": ("bv_classifier.npz", "big_vision", (0.5, 0.5, 0.5)),
    "timm_token": ("timm_token", "timm", (0.485, 0.456, 0.406)),
    "timm_gap": ("timm_gap", "timm", (0.5, 0.5, 0.5)),
    "timm_map": ("timm_map", "timm", (0.5, 0.5, 0.5)),
    "open_clip": ("open_clip", "open_clip", (0.48145466, 0.4578275,
                                             0.40821073)),
}


def _rel(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - b))
               / np.max(np.abs(b)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_embedding_equals_the_reference_implementation(name):
  path, fmt, mean = CASES[name]
  tower = pretrained.load_image_tower(os.path.join(FIX, path))
  assert f"({fmt}:" in tower.source
  assert tower.image_size == 32
  np.testing.assert_allclose(tower.normalization.mean, mean, rtol=1e-6)
  images = EXPECTED[f"{name}/images"]
  ref = EXPECTED[f"{name}/embedding"]
  emb = tower(images)
  assert emb.dtype == jnp.float32 and emb.shape == ref.shape
  assert tower.embed_dim == ref.shape[1]
  assert _rel(emb, ref) <= 1e-5, _rel(emb, ref)
  # A batch of one gives the same row (no cross-talk through the batch).
  assert _rel(tower(images[1:2]), ref[1:2]) <= 1e-5


def test_big_vision_npz_equals_the_hf_siglip_it_was_built_from():
  bv = pretrained.load_image_tower(os.path.join(FIX, "bv_siglip.npz"))
  hf = pretrained.load_image_tower(os.path.join(FIX, "hf_siglip"))
  images = np.random.default_rng(7).integers(0, 256, (5, 32, 32, 3),
                                             dtype=np.uint8)
  np.testing.assert_allclose(bv(images), hf(images), rtol=1e-5, atol=1e-6)


def test_position_embeddings_resampled_to_another_size():
  path = os.path.join(FIX, "hf_clip_vision")
  native = pretrained.load_image_tower(path)
  same = pretrained.load_image_tower(path, image_size=32)
  for a, b in zip(jax.tree.leaves(native.params), jax.tree.leaves(same.params)):
    np.testing.assert_array_equal(a, b)  # The identity at the native size.
  big = pretrained.load_image_tower(path, image_size=48)
  pos, pos48 = native.params["pos_embedding"], big.params["pos_embedding"]
  assert pos.shape == (1, 1 + 16, 32) and pos48.shape == (1, 1 + 36, 32)
  np.testing.assert_array_equal(pos48[:, 0], pos[:, 0])  # Class token kept.
  # Bilinear over the grid, against a float64 reference.
  g = np.asarray(pos[0, 1:], np.float64).reshape(4, 4, 32)
  ref = _bilinear_half_pixel(g, 6).reshape(36, 32)
  np.testing.assert_allclose(pos48[0, 1:], ref, rtol=1e-5, atol=1e-6)
  images = np.random.default_rng(3).integers(0, 256, (2, 48, 48, 3),
                                             dtype=np.uint8)
  emb = big(images)
  assert emb.shape == (2, 24) and np.isfinite(np.asarray(emb)).all()
  with pytest.raises(ValueError, match="not a multiple of the patch size 8"):
    pretrained.load_image_tower(path, image_size=36)


def _bilinear_half_pixel(g, n):
  """Reference bilinear resize (half-pixel centres, edge clamp) in numpy."""
  m = g.shape[0]
  c = (np.arange(n) + 0.5) * m / n - 0.5
  c = np.clip(c, 0, m - 1)
  lo = np.floor(c).astype(int)
  hi = np.minimum(lo + 1, m - 1)
  w = c - lo
  rows = g[lo] * (1 - w)[:, None, None] + g[hi] * w[:, None, None]
  return rows[:, lo] * (1 - w)[None, :, None] + rows[:, hi] * w[None, :, None]


def test_tower_exposes_what_the_trainer_needs():
  tower = pretrained.load_image_tower(os.path.join(FIX, "hf_siglip"),
                                      dtype=jnp.bfloat16)
  images = EXPECTED["hf_siglip/images"]
  x = tower.normalization(images)
  np.testing.assert_allclose(x, images / 127.5 - 1.0, rtol=1e-6, atol=1e-6)
  out = tower.module.apply({"params": tower.params}, x.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  emb = tower(images)
  assert emb.dtype == jnp.float32
  assert _rel(emb, EXPECTED["hf_siglip/embedding"]) < 3e-2  # bf16 compute.
  # The fingerprint names params and preprocessing: the same checkpoint
  # loaded again gives it again; another param value or another
  # normalisation does not (stored embeddings are never reused for them).
  f32 = pretrained.load_image_tower(os.path.join(FIX, "hf_clip_vision"))
  assert len(f32.fingerprint) == 32
  again = pretrained.load_image_tower(os.path.join(FIX, "hf_clip_vision"))
  assert again.fingerprint == f32.fingerprint
  nudged = jax.tree.map(np.asarray, f32.params)
  leaf = nudged["embedding"]["kernel"]
  leaf = leaf.copy()
  leaf.flat[0] += 1e-3
  nudged["embedding"]["kernel"] = leaf
  assert dataclasses.replace(f32, params=nudged).fingerprint != f32.fingerprint
  assert dataclasses.replace(
      f32, normalization=towers.SYMMETRIC).fingerprint != f32.fingerprint


# ------------------------------------------------------------ bad input


def _one_line(excinfo, *parts):
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  for p in parts:
    assert p in msg, msg
  return msg


def test_missing_path():
  with pytest.raises(FileNotFoundError) as e:
    pretrained.load_image_tower("/nonexistent/clip")
  _one_line(e, "/nonexistent/clip", "not found")


def test_directory_without_a_checkpoint(tmp_path):
  (tmp_path / "README.md").write_text("hi")
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(tmp_path))
  _one_line(e, str(tmp_path), "no recognisable image tower checkpoint",
            "open_clip_config.json", "README.md")


def _copy(tmp_path, name):
  d = tmp_path / name
  shutil.copytree(os.path.join(FIX, name), d)
  return d


def test_truncated_safetensors(tmp_path):
  d = _copy(tmp_path, "hf_clip_vision")
  f = d / "model.safetensors"
  data = f.read_bytes()
  f.write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, str(f), "truncated")


def test_pickled_weights_only_are_refused(tmp_path):
  d = _copy(tmp_path, "hf_siglip")
  os.rename(d / "model.safetensors", d / "pytorch_model.bin")
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, str(d), "no model.safetensors", "pytorch_model.bin")


def test_missing_and_unexpected_keys_name_the_architecture(tmp_path):
  d = _copy(tmp_path, "timm_token")
  t = load_file(str(d / "model.safetensors"))
  del t["blocks.1.mlp.fc2.weight"]
  t["blocks.0.attn.q_norm.weight"] = np.ones(8, np.float32)
  save_file(t, str(d / "model.safetensors"))
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, str(d / "model.safetensors"), "timm vit_base_patch16_224",
            "width 32, depth 2, 4 heads", "missing blocks.1.mlp.fc2.weight",
            "unexpected blocks.0.attn.q_norm.weight")


def test_shapes_that_do_not_fit(tmp_path):
  d = _copy(tmp_path, "open_clip")
  t = load_file(str(d / "open_clip_model.safetensors"))
  t["visual.ln_post.weight"] = np.ones(31, np.float32)
  save_file(t, str(d / "open_clip_model.safetensors"))
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, str(d), "OpenCLIP ViT", "norm/scale has shape (31,)",
            "wants (32,)")


def test_bad_config_json(tmp_path):
  d = _copy(tmp_path, "hf_clip_vision")
  cfg = json.loads((d / "config.json").read_text())
  cfg["model_type"] = "bert"
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, "config.json", "'bert'", "clip")
  (d / "config.json").write_text("{not json")
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, "config.json", "not a readable JSON file")


def test_timm_heads_from_the_name_when_model_args_are_absent(tmp_path):
  """Hub configs carry no model_args: the head count comes from the name
  (base: 12), which does not fit this tiny width: one line says so."""
  d = _copy(tmp_path, "timm_token")
  cfg = json.loads((d / "config.json").read_text())
  del cfg["model_args"]
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, str(d), "12 heads", "not divisible by num_heads 12")
  cfg["model_args"] = {"num_heads": 4, "act_layer": "silu"}
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(d))
  _one_line(e, "config.json", "act_layer 'silu'")
  cfg["model_args"] = {"num_heads": 4}
  (d / "config.json").write_text(json.dumps(cfg))
  tower = pretrained.load_image_tower(str(d))
  assert _rel(tower(EXPECTED["timm_token/images"]),
              EXPECTED["timm_token/embedding"]) <= 1e-5


def test_npz_with_pickled_objects_is_refused(tmp_path):
  f = tmp_path / "obj.npz"
  np.savez(f, a=np.array([{"x": 1}], dtype=object))
  with pytest.raises(ValueError) as e:
    pretrained.load_image_tower(str(f))
  _one_line(e, str(f), "pickled")


# ---------------------------------------------------- CLIP text tower


@pytest.mark.parametrize("max_len", [16, 15])
def test_clip_text_tower_equals_hf_get_text_features(max_len):
  """Our tokenizer + the text tower initialised from HF CLIP == HF's
  get_text_features of CLIPTokenizer's ids (odd max_len: the padded row)."""
  kwargs, params = pretrained.load_text_tower(os.path.join(FIX, "hf_clip"))
  tok = tokenizer_lib.ClipBpeTokenizer(os.path.join(FIX, "clip_bpe"), max_len)
  assert kwargs["vocab_size"] == tok.vocab_size
  module = text_lib.TextTransformer(**kwargs)
  texts = json.load(open(os.path.join(FIX, "tokenizer_expected.json")))[
      "texts"]
  tokens = tok.encode(texts)
  emb = module.apply({"params": params}, jnp.asarray(tokens))
  ref = EXPECTED["hf_clip/text_embedding"]
  assert _rel(emb, ref) <= 1e-5, _rel(emb, ref)


def test_text_tower_not_clip_is_refused(tmp_path):
  with pytest.raises(ValueError) as e:
    pretrained.load_text_tower(os.path.join(FIX, "hf_siglip"))
  _one_line(e, "no CLIP text tower")
