"""What the trainer logs and how it is installed: the loss diagnostics of a
train step (against numpy), and the packaging that README describes."""
import os
import re
import tomllib
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from infcl_jax.flax import ContrastiveLoss
from train import diagnostics
from train.towers import own
from train.towers import text as text_lib
from train import optim
from train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_loss_diagnostics_equal_numpy_on_a_sample(loss):
  rng = np.random.default_rng(0)
  b, s, d = 9, 5, 7
  img = rng.normal(size=(b, d)).astype(np.float32)
  txt = (img + rng.normal(size=(b, d))).astype(np.float32)
  head = ContrastiveLoss(loss=loss, backend="xla")
  hp = head.init(jax.random.key(0), img, txt)["params"]
  hp = jax.tree.map(lambda x: x + 0.3, hp)  # Not the initial values.
  sample = diagnostics.make_sample_embedder(
      embed_img=None, embed_txt=lambda p, t: t * p, sample_size=s)
  batch = {"image_emb": jnp.asarray(img), "text": jnp.asarray(txt)}
  got = jax.jit(lambda p, bt: diagnostics.loss_diagnostics(head, p, bt,
                                                           sample))(
      {"head": hp, "txt": jnp.float32(2.0)}, batch)
  scale = np.exp(float(hp["log_scale"]))
  bias = float(hp["bias"]) if loss == "sigmoid" else 0.0
  unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
  logits = scale * unit(img[:s].astype(np.float64)) @ unit(
      2.0 * txt[:s].astype(np.float64)).T + bias
  pos, neg = np.diag(logits), logits[~np.eye(s, dtype=bool)]
  want = {"logit_scale": scale, "temperature": 1 / scale, "logit_bias": bias,
          "pos_logit_mean": pos.mean(), "pos_logit_min": pos.min(),
          "pos_logit_max": pos.max(), "neg_logit_mean": neg.mean(),
          "neg_logit_min": neg.min(), "neg_logit_max": neg.max()}
  assert set(got) == set(want)
  for k, v in want.items():
    assert float(got[k]) == pytest.approx(v, rel=1e-5, abs=1e-5), k
  one = diagnostics.loss_diagnostics(
      head, {"head": hp, "txt": 1.0}, batch,
      diagnostics.make_sample_embedder(embed_img=None,
                                       embed_txt=lambda p, t: t,
                                       sample_size=1))
  assert "neg_logit_mean" not in one and "pos_logit_mean" in one


@pytest.mark.slow  # ~10 s on 2 cores: compiles a train step.
def test_train_step_metrics_carry_the_diagnostics():
  """The step's metrics (what metrics.jsonl and TensorBoard get) hold the
  diagnostics of the parameters the step's loss saw."""
  L, S, D, B = 6, 8, 8, 16
  img = own.make_module(NS(kind="cnn", cnn_features=(4,)), D,
                                jnp.float32)
  txt = text_lib.from_scratch(NS(width=8, depth=1, num_heads=2, mlp_dim=16),
                               40, L, D, jnp.float32)
  head = ContrastiveLoss(backend="xla")
  rng = np.random.default_rng(1)
  images = rng.uniform(-1, 1, (B, S, S, 3)).astype(np.float32)
  tokens = rng.integers(1, 40, (B, L)).astype(np.int32)
  k = jax.random.split(jax.random.key(0), 3)
  params = {"img": img.init(k[0], images[:1])["params"],
            "txt": txt.init(k[1], tokens[:1])["params"],
            "head": head.init(k[2], jnp.zeros((2, D)), jnp.zeros((2, D)))[
                "params"]}
  mesh = Mesh(np.array(jax.devices()[:1]), (step_lib.AXIS,))
  schedule = optim.make_schedule(lr=1e-2, total_steps=4, warmup_steps=0)
  optimizer = optim.make_optimizer(name="adamw", schedule=schedule,
                                   params=params, image_locked=True)
  grad_fn = step_lib.make_grad_fn(
      mesh=mesh, image_tower=img, text_tower=txt, head=head,
      microbatch_size=0, global_batch=B, precomputed=False, image_locked=True)
  embed_sample = diagnostics.make_sample_embedder(
      embed_img=lambda p, x: img.apply({"params": p}, x),
      embed_txt=lambda p, t: txt.apply({"params": p}, t), sample_size=B)
  step = step_lib.make_train_step(grad_fn=grad_fn, head=head,
                                  optimizer=optimizer, schedule=schedule,
                                  embed_sample=embed_sample)
  # A copy: the step donates (frees) the state's buffers.
  state = step_lib.init_state(mesh, jax.tree.map(jnp.copy, params),
                              optimizer)
  batch = step_lib.shard_batch(mesh, {"image": images, "text": tokens})
  _, metrics = step(state, batch)
  metrics = jax.device_get(metrics)
  for key in ("loss", "temperature", "logit_bias", "pos_logit_mean",
              "pos_logit_min", "pos_logit_max", "neg_logit_mean",
              "neg_logit_min", "neg_logit_max", "grad_norm", "lr"):
    assert np.isfinite(metrics[key]), key
  assert metrics["pos_logit_min"] <= metrics["pos_logit_mean"] <= metrics[
      "pos_logit_max"]
  # With the whole batch as the sample, the CLIP loss follows from the same
  # logits: a check that they are the loss's logits.
  e_i = img.apply({"params": params["img"]}, images)
  e_t = txt.apply({"params": params["txt"]}, tokens)
  unit = lambda x: x / jnp.linalg.norm(x, axis=1, keepdims=True)
  logits = np.asarray(float(metrics["logit_scale"]) * unit(e_i) @ unit(e_t).T,
                      np.float64)
  ce = lambda z: np.mean(np.log(np.exp(z).sum(1)) - np.diag(z))
  assert float(metrics["loss"]) == pytest.approx(
      (ce(logits) + ce(logits.T)) / 2, rel=1e-4)


def test_the_trainer_runs_from_the_checkout_as_readme_says():
  """The package is the library only; the trainer (``train/``, ``configs/``)
  runs from a clone, as big_vision's does, and README says so."""
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)
  assert project["tool"]["setuptools"]["packages"]["find"]["include"] == [
      "infcl_jax*"]
  assert "scripts" not in project["project"]
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = " ".join(f.read().split())
  assert re.search(r"The trainer is not installed as a package: it runs "
                   r"from the checkout", readme)
  assert 'pip install -e ".[train]" # + the dependencies of the LiT trainer' \
      in readme
