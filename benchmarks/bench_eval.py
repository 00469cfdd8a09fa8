"""Evaluation embeddings in float32 vs bfloat16: metrics, memory and time.

Streamed evaluation keeps only the (N, D) embeddings of a split. This
measures what storing them in bfloat16 instead of float32 would change, on
COCO-shaped retrieval (N images, 5 captions each) and ImageNet-shaped
zero-shot (N images, C classes) with synthetic embeddings that have a
controlled difficulty (each caption / image is its image / class plus
Gaussian noise), and, with ``--workdir``, on a trained run's own eval split.

  python benchmarks/bench_eval.py [--images 5000] [--dim 768] [--classes 1000]
      [--workdir /tmp/lit_demo --config configs/lit_demo.py]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

# Run from the checkout (the trainer is not an installed package).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import harness  # noqa: E402  pylint: disable=wrong-import-position


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _bf16(x):
  """Rounds float32 to bfloat16 (round to nearest even) and back."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(
      np.float32)


def _once(fn, *args):
  """(fn(*args), its seconds): one synchronized call, no warm-up, timed by
  the harness (a pass over a whole split is too long to repeat)."""
  got = []
  t = harness.timeit(lambda: got.append(fn(*args)), reps=1, warmup=0)
  return got[0], t.median


def _compare(name, metrics_fn, *arrays):
  f32, t_f32 = _once(metrics_fn, *arrays)
  bf = metrics_fn(*[_bf16(a) if a.dtype == np.float32 else a
                    for a in arrays])
  emb_mb = sum(a.nbytes for a in arrays if a.dtype == np.float32) / 2**20
  print(f"\n{name}: embeddings {emb_mb:.1f} MiB in float32, "
        f"{emb_mb / 2:.1f} MiB in bfloat16; metrics in {t_f32:.1f} s")
  print(f"{'metric':<16}{'float32':>10}{'bfloat16':>10}{'diff (pts)':>12}")
  for k in f32:
    if k.startswith(("i2t", "t2i", "zeroshot_top")):
      print(f"{k:<16}{100 * f32[k]:>10.2f}{100 * bf[k]:>10.2f}"
            f"{100 * (bf[k] - f32[k]):>12.2f}")


def synthetic(args):
  from train.eval import retrieval  # pylint: disable=import-outside-toplevel
  from train.eval import zeroshot  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  n, d = args.images, args.dim
  img = _unit(rng.normal(size=(n, d))).astype(np.float32)
  owner = np.repeat(np.arange(n), 5)
  txt = _unit(img[owner] + rng.normal(size=(5 * n, d)) * args.noise /
              np.sqrt(d)).astype(np.float32)
  _compare(f"retrieval, {n} images x 5 captions, D={d}, noise {args.noise}",
           lambda i, t, o: retrieval.recall(_unit(i), _unit(t), o),
           img, txt, owner)
  c = args.classes
  cls = _unit(rng.normal(size=(c, d))).astype(np.float32)
  labels = rng.integers(0, c, args.zs_images)
  zimg = _unit(cls[labels] + rng.normal(size=(len(labels), d)) * args.noise /
               np.sqrt(d)).astype(np.float32)
  _compare(f"zero-shot, {len(labels)} images, {c} classes, D={d}",
           lambda i, k, l: zeroshot.accuracy(_unit(i), _unit(k), l),
           zimg, cls, labels)


def trained(args):
  """A finished run's own eval split, through the trainer's evaluator."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  from train import data as data_lib  # pylint: disable=import-outside-toplevel
  from train.eval import evaluator  # pylint: disable=import-outside-toplevel
  from train import step as step_lib  # pylint: disable=import-outside-toplevel
  from train import train  # pylint: disable=import-outside-toplevel
  from train.eval import retrieval  # pylint: disable=import-outside-toplevel
  from train.eval import embed as embed_lib  # pylint: disable=import-outside-toplevel
  from train.eval import zeroshot  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("cfg", args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  params = train.load_params(args.workdir)
  tokenizer = data_lib.make_tokenizer(config)
  image_tower, text_tower, _ = train.make_models(config, tokenizer)
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  ev = train.make_evaluator(config, mesh, image_tower, text_tower, tokenizer)
  got, t_eval = _once(ev, params)
  print(f"\n{args.workdir}: the evaluator's pass in {t_eval:.1f} s: "
        + ", ".join(f"{k} {v:.4f}" for k, v in got.items()))
  emb = embed_lib.embed_split(ev.zeroshot.split, mesh=mesh,
                              image_embed=ev._embed_img,  # pylint: disable=protected-access
                              params=params["img"], batch_size=ev.batch_size)
  cls = evaluator.class_embeddings(ev._embed_txt, params["txt"], tokenizer,  # pylint: disable=protected-access
                                   ev.zeroshot.classnames,
                                   ev.zeroshot.templates, ev.batch_size)
  texts, owner = evaluator.caption_table(emb.captions)
  txt = evaluator.embed_all(ev._embed_txt, params["txt"],  # pylint: disable=protected-access
                            tokenizer.encode(texts), ev.batch_size)
  _compare("trained run, zero-shot",
           lambda i, k, l: zeroshot.accuracy(_unit(i), _unit(k), l),
           emb.images, cls, emb.labels)
  _compare("trained run, retrieval",
           lambda i, t, o: retrieval.recall(_unit(i), _unit(t), o),
           emb.images, txt, owner)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--images", type=int, default=5000)
  ap.add_argument("--zs_images", type=int, default=50000)
  ap.add_argument("--classes", type=int, default=1000)
  ap.add_argument("--dim", type=int, default=768)
  ap.add_argument("--noise", type=float, default=1.3,
                  help="noise norm relative to the unit signal")
  ap.add_argument("--workdir", default="")
  ap.add_argument("--config", default="configs/lit_demo.py")
  args = ap.parse_args()
  synthetic(args)
  if args.workdir:
    trained(args)


if __name__ == "__main__":
  main()
