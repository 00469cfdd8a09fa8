"""Pretrains the image tower on the synthetic training split and writes a .npz.

LiT needs a *useful* locked image tower, and nothing may be downloaded, so
this script makes one: a short supervised run of the tower of
``config.model.image`` on synthetic_shapes' training split, with one linear
classifier per attribute the dataset records (shape, color, size, horizontal
and vertical position, background), half of each batch with permuted color
channels for the color-invariant attributes (so shape is not read from
color). Only the training split is used, so the
(shape, color) combinations held out for zero-shot evaluation are never seen
here either. The classifiers are dropped; the tower's output (the
pre-logits, ``config.model.embed_dim`` wide) is what LiT locks.

    .venv/bin/python -m train.pretrain_image_tower --config configs/lit_demo.py \
        --out ~/.cache/infcl_jax/towers/demo_cnn.npz --steps 600

The trainer runs this itself (with a log line) when ``config.model.image.init``
is empty and the ``config.model.image.pretrain_path`` it names instead does
not exist yet, or was made by another recipe (``make_current``): a
cached tower is only as good as the code and config that made it, so
``pretrain`` writes ``recipe(...)`` beside it (``PATH.recipe``) and a file
whose recipe differs is made again rather than used silently.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax

from train.towers import own
from train.data.sources import tfds
from train.data.decode.host import preprocess_image

# Attribute features of synthetic_shapes and their number of classes.
ATTRIBUTES = {"label": 8, "color": 8, "size": 3, "hpos": 3, "vpos": 3,
              "background": 3}
# Attributes that do not change when the color channels are permuted.
COLOR_INVARIANT = ("label", "size", "hpos", "vpos")


def recipe(config, steps: int, batch_size: int = 128, lr: float = 3e-3,
           seed: int = 0) -> str:
  """A fingerprint of what a pretraining's result depends on: the data
  config (not where it is stored), the tower config (not where it is read
  from or saved to), the schedule (``pretrain``'s arguments; its defaults are
  what the trainer runs), and this code and the tower's."""
  data = {k: v for k, v in config.data.to_dict().items() if k != "data_dir"}
  image = {k: v for k, v in config.model.image.to_dict().items()
           if k not in ("init", "pretrain_path", "locked")}
  code = [open(m.__file__, "rb").read() for m in (sys.modules[__name__], own)]
  h = hashlib.sha256(json.dumps(
      {"data": data, "image": image, "embed_dim": config.model.embed_dim,
       "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed},
      sort_keys=True, default=str).encode())
  for c in code:
    h.update(c)
  return h.hexdigest()[:16]


def is_current(path: str, config, steps: int) -> bool:
  """Whether ``path`` exists and was made by this recipe."""
  try:
    with open(path + ".recipe") as f:
      return os.path.exists(path) and f.read().strip() == recipe(config, steps)
  except OSError:
    return False


def make_current(config) -> None:
  """Makes config.model.image.pretrain_path (an own tower, ``init`` empty)
  where it does not exist or was made by another recipe, saying so in one
  line; the trainer calls it before it loads the tower."""
  ic = config.model.image
  path = os.path.expanduser(ic.pretrain_path)
  if ic.kind == "pretrained" or ic.init or not path or is_current(
      path, config, ic.pretrain_steps):
    return
  why = "made by another recipe" if os.path.exists(path) else "not made yet"
  print(f"[lit] pretraining the image tower -> {path} ({why}; "
        f"{ic.pretrain_steps} steps, config.model.image.pretrain_path)",
        flush=True)
  pretrain(config, path, steps=ic.pretrain_steps)


class _Classifier(nn.Module):
  """The tower plus one linear head per attribute."""
  tower: nn.Module
  num_classes: dict

  @nn.compact
  def __call__(self, images):
    z = self.tower(images)
    z = nn.relu(z)  # The heads see a nonlinearity of the locked embedding.
    return {k: nn.Dense(n, name=f"cls_{k}")(z)
            for k, n in self.num_classes.items()}


def load_split(data_config, split: str, limit: int = 0):
  """Images (preprocessed like the train pipeline) and attribute labels."""
  builder = tfds.builder_for(data_config)
  source = builder.as_data_source(split=split)
  n = len(source) if not limit else min(limit, len(source))
  examples = []
  for start in range(0, n, 512):
    examples.extend(source.__getitems__(list(range(start, min(n, start + 512)))))
  keys = [k for k in ATTRIBUTES if k in examples[0]]
  if "label" not in keys:
    raise ValueError(f"dataset {data_config.name!r} has no 'label' feature to "
                     "pretrain the image tower on")
  images = np.stack([preprocess_image(e["image"], data_config.image_size)
                     for e in examples]).astype(np.float32)
  labels = {k: np.asarray([int(e[k]) for e in examples], np.int32)
            for k in keys}
  return images, labels


def pretrain(config, out_path: str, *, steps: int, batch_size: int = 128,
             lr: float = 3e-3, seed: int = 0, log=print) -> dict:
  """Trains the tower of ``config.model.image`` and saves it to ``out_path``.

  Returns:
    Accuracies of each attribute head on the held-out test split.
  """
  if config.data.name != "synthetic_shapes":
    raise ValueError("train.pretrain_image_tower pretrains on synthetic_shapes "
                     f"only, not {config.data.name!r}; give "
                     "config.model.image.init a pretrained checkpoint")
  t0 = time.time()
  images, labels = load_split(config.data, config.data.split)
  test_images, test_labels = load_split(config.data, config.data.eval_split)
  num_classes = {k: ATTRIBUTES[k] for k in labels}
  tower = own.make_module(config.model.image, config.model.embed_dim,
                          jnp.float32)
  model = _Classifier(tower, num_classes)
  params = jax.jit(model.init)(jax.random.key(seed), images[:1])["params"]
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, lr, min(100, steps // 10), max(steps, 1))
  tx = optax.adamw(schedule, weight_decay=1e-4)
  opt_state = jax.jit(tx.init)(params)

  def ce(logits, y, keys):
    return sum(optax.softmax_cross_entropy_with_integer_labels(
        logits[k], y[k]).mean() for k in keys if k in logits)

  def loss_fn(params, x, y, x_perm, y_perm):
    # Held-out evaluation pairs shapes with colors they never had in
    # training, so a shape feature that leans on color fails there. The
    # second half of the batch has its RGB channels permuted (new colors)
    # and trains only the color-invariant heads: shape must be read from
    # the outline.
    logits = model.apply({"params": params}, x)
    logits_perm = model.apply({"params": params}, x_perm)
    return ce(logits, y, logits) + ce(logits_perm, y_perm, COLOR_INVARIANT)

  @jax.jit
  def train_step(params, opt_state, x, y, x_perm, y_perm):
    loss, g = jax.value_and_grad(loss_fn)(params, x, y, x_perm, y_perm)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def predict(params, x):
    return {k: jnp.argmax(v, -1)
            for k, v in model.apply({"params": params}, x).items()}

  rng = np.random.default_rng(seed)
  n = images.shape[0]
  channel_perms = np.array([p for p in itertools.permutations(range(3))
                            if p != (0, 1, 2)])
  perm, pos = rng.permutation(n), 0
  half = batch_size // 2
  for i in range(steps):
    if pos + batch_size > n:
      perm, pos = rng.permutation(n), 0
    idx, idx_p = perm[pos:pos + half], perm[pos + half:pos + batch_size]
    pos += batch_size
    cp = channel_perms[rng.integers(len(channel_perms), size=len(idx_p))]
    x_perm = np.take_along_axis(images[idx_p], cp[:, None, None, :], axis=-1)
    params, opt_state, loss = train_step(
        params, opt_state, images[idx], {k: v[idx] for k, v in labels.items()},
        x_perm, {k: v[idx_p] for k, v in labels.items()})
    if (i + 1) % max(steps // 5, 1) == 0:
      log(f"[pretrain] step {i + 1}/{steps} loss {float(loss):.3f} "
          f"({time.time() - t0:.0f}s)")
  correct = {k: 0 for k in labels}
  for start in range(0, test_images.shape[0], 256):
    pred = jax.device_get(predict(params, test_images[start:start + 256]))
    for k in labels:
      correct[k] += int(np.sum(pred[k] == test_labels[k][start:start + 256]))
  acc = {k: c / test_images.shape[0] for k, c in correct.items()}
  log("[pretrain] held-out accuracy: " + ", ".join(
      f"{'shape' if k == 'label' else k} {100 * v:.0f}%"
      for k, v in acc.items()))
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  own.save_npz(out_path, params["tower"])
  # After the tower, atomically: a crash in between leaves a file without
  # its recipe, which is made again.
  tmp = f"{out_path}.recipe.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(recipe(config, steps, batch_size, lr, seed) + "\n")
  os.replace(tmp, out_path + ".recipe")
  log(f"[pretrain] image tower saved to {out_path} ({time.time() - t0:.0f}s)")
  return acc


def _main(argv):
  del argv
  FLAGS = flags.FLAGS  # pylint: disable=invalid-name
  ic = FLAGS.config.model.image
  out = os.path.expanduser(FLAGS.out or ic.init or ic.pretrain_path)
  if not out:
    print("error: give --out, config.model.image.init or "
          "config.model.image.pretrain_path", file=sys.stderr)
    sys.exit(2)
  steps = FLAGS.steps or FLAGS.config.model.image.pretrain_steps or 600
  try:
    pretrain(FLAGS.config, out, steps=steps)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", None, "Trainer config file.")
  flags.DEFINE_string("out", "", "Output .npz (default: model.image.init, "
                      "else model.image.pretrain_path).")
  flags.DEFINE_integer("steps", 0, "Steps (default: model.image."
                       "pretrain_steps, else 600).")
  app.run(_main)
