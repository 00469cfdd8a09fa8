"""The locked tower streamed per micro-batch, precomputed embeddings, and the
trainer end to end from webdataset shards and a CSV.

- The streamed step (uint8 micro-batches embedded one by one, then the text
  tower under GradCache and one loss) equals the whole-batch step on the
  same data: bitwise on one device, and to float rounding on 8.
- ``train.precompute`` writes bf16 shards that resume and refuse another
  tower; training from them gives the on-the-fly loss at step 1 (to bf16
  rounding of the embeddings).
- configs/lit_demo.py:tiny trains from webdataset shards and from a CSV of
  the spoiled corpus (bad examples skipped and counted in the metrics),
  evaluated zero-shot on the labelled synthetic_shapes test split; a run
  stopped at step 5 and resumed ends bitwise where an uninterrupted run does.
"""
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from types import SimpleNamespace as NS

from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from tests import corpus as corpus_lib
from tests.helpers import set_overrides
from train.towers import own
from train.towers import text as text_lib
from train import precompute as precompute_lib
from train import step as step_lib
from train import streamed_tower
from train import train as train_lib
from train.data.sources import embeddings as emb_lib
from train.towers import tower as tower_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, MB, L, S, D = 32, 8, 8, 16, 16


def _parts(loss="softmax", seed=0):
  img = own.make_module(NS(kind="cnn", cnn_features=(4, 8)), D,
                                jnp.float32)
  txt = text_lib.from_scratch(NS(width=16, depth=1, num_heads=2, mlp_dim=32),
                               50, L, D, jnp.float32)
  head = ContrastiveLoss(loss=loss, backend="xla",
                         block_sizes=BlockSizes(8, 16))
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (B, S, S, 3), dtype=np.uint8)
  tokens = rng.integers(1, 50, (B, L)).astype(np.int32)
  tokens[:, L - 2:] = 0
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  e = jnp.zeros((2, D))
  params = {"img": img.init(k1, jnp.zeros((1, S, S, 3)))["params"],
            "txt": txt.init(k2, tokens[:1])["params"],
            "head": head.init(k3, e, e)["params"]}
  tower = tower_lib.Tower(module=img, params=params["img"], image_size=S,
                          normalization=tower_lib.SYMMETRIC, embed_dim=D)
  return tower, txt, head, params, images, tokens


def streamed_and_whole(tower, txt, head, params, images, tokens, n_dev, mb):
  """The whole-batch step and the streamed step on the same micro-batches:
  (loss, grads) of each, the device-major host batch and the streamed
  step's inputs. Equal bitwise on one device, to rounding on more."""
  b = len(images)
  mesh = Mesh(np.array(jax.devices()[:n_dev]), (step_lib.AXIS,))
  kw = dict(mesh=mesh, image_tower=tower, text_tower=txt, head=head,
            microbatch_size=mb, global_batch=b, image_locked=True)
  whole = jax.jit(step_lib.make_grad_fn(precomputed=False, **kw))
  streamed = jax.jit(step_lib.make_grad_fn(precomputed=True, **kw))
  micro = [{"image": images[i:i + mb], "text": tokens[i:i + mb]}
           for i in range(0, b, mb)]
  # Today's step: the whole batch of uint8 images, in the device-major
  # order the streamed step builds (each device's rows of each micro-batch).
  batch = {k: streamed_tower.device_major([m[k] for m in micro], n_dev)
           for k in ("image", "text")}
  loss0, g0 = whole(params, step_lib.shard_batch(mesh, batch))
  streamer = streamed_tower.StreamedImageTower(mesh, tower, params["img"],
                                           depth=1)
  inputs = streamer.step_inputs(iter(micro), b // mb)
  loss1, g1 = streamed(params, inputs)
  if n_dev == 1:
    assert float(loss1) == float(loss0)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
      np.testing.assert_array_equal(x, y)
  else:
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    for x, y in zip(jax.tree.leaves(g1["txt"]), jax.tree.leaves(g0["txt"])):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  return batch, inputs


@pytest.mark.parametrize("n_dev,loss", [(1, "softmax"), (8, "sigmoid")])
def test_streamed_step_equals_the_whole_batch_step(n_dev, loss):
  tower, txt, head, params, images, tokens = _parts(loss)
  batch, inputs = streamed_and_whole(tower, txt, head, params, images,
                                     tokens, n_dev, MB)
  assert inputs["image_emb"].shape == (B, D)
  # The embeddings are those of the whole-batch tower, row for row.
  want = np.asarray(tower(batch["image"]))
  np.testing.assert_allclose(np.asarray(inputs["image_emb"]), want,
                             rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  c = corpus_lib.make_corpus(root / "train", num=96)
  held_out = corpus_lib.make_corpus(root / "test", num=32, split="test")
  return c, held_out


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


def _tiny(name, eval_split, shapes_dir, **overrides):
  spec = importlib.util.spec_from_file_location(
      "lit_demo_config", os.path.join(ROOT, "configs", "lit_demo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config("tiny")
  c.progress_bar = False
  c.data.name = name
  c.data.eval_split = eval_split
  c.data.image_size = S
  c.data.max_bad_fraction = 0.2
  c.data.wds_label_field = "label"
  c.data.table_label_column = "label"
  # Zero-shot on the labelled held-out split of synthetic_shapes.
  c.data.zeroshot_name = "synthetic_shapes"
  c.data.data_dir = str(shapes_dir)
  c.data.num_train_examples = 64
  c.data.num_eval_examples = 32
  return set_overrides(c, overrides)


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f if l.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["webdataset", "csv"])
def test_lit_demo_trains_from_webdataset_and_csv(tmp_path, corpus, shapes_dir,
                                                 fmt):
  train, held_out = corpus
  if fmt == "webdataset":
    name, ev = "webdataset:" + train.pattern, "webdataset:" + held_out.pattern
  else:
    name, ev = "csv:" + train.tables["csv"], "csv:" + held_out.tables["csv"]
  # On the fly: the locked tower streamed per micro-batch of 8 (2 a step).
  config = _tiny(name, ev, shapes_dir, precompute_image_embeddings=False,
                 microbatch_size=8)
  summary = train_lib.train_and_evaluate(config, str(tmp_path / "w"))
  assert summary["steps"] == 8
  assert np.isfinite(summary["loss"])
  assert "eval/zeroshot_top1" in summary and "eval/i2t_r1" in summary
  assert summary["eval/zeroshot_num_classes"] == 8
  rows = [r for r in _rows(tmp_path / "w") if "loss" in r]
  # 8 steps x 16 = 128 > 96 examples: every bad example has been met once.
  bad = [r["data/bad_examples"] for r in rows]
  n_bad = len(train.wds_bad) if fmt == "webdataset" else 3
  assert bad[-1] >= n_bad and bad == sorted(bad), bad


@pytest.mark.slow
def test_precompute_then_train_gives_the_on_the_fly_loss(tmp_path, corpus,
                                                         shapes_dir, capsys):
  train, held_out = corpus
  name, ev = "webdataset:" + train.pattern, "webdataset:" + held_out.pattern
  fly = _tiny(name, ev, shapes_dir, precompute_image_embeddings=False,
              microbatch_size=8, total_steps=2)
  train_lib.train_and_evaluate(fly, str(tmp_path / "fly"))
  # The command, resumable: three shards of 40 rows, the second then lost.
  out = tmp_path / "emb"
  tokenizer = train_lib.data_lib.make_tokenizer(fly)
  tower = train_lib.make_locked_tower(fly, tokenizer)
  precompute_lib.precompute(fly, str(out), tower, rows_per_shard=40)
  npy1, js1 = emb_lib.shard_paths(str(out), 1)
  first = open(npy1, "rb").read()
  os.remove(js1)
  capsys.readouterr()
  precompute_lib.precompute(fly, str(out), tower, rows_per_shard=40)
  log = capsys.readouterr().out
  assert "2 shard(s) of this process already complete" in log
  assert "shard 2/3" in log and "shard 1/3" not in log
  assert open(npy1, "rb").read() == first
  source = emb_lib.EmbeddingSource(str(out))
  assert len(source) == len(train_lib.data_lib.open_source(fly.data, "train"))
  # A row is the tower's embedding of the example, to bf16 rounding.
  i = 11
  ex = train_lib.data_lib.open_source(fly.data, "train")[i]
  from train.data.decode import host as host_lib  # pylint: disable=g-import-not-at-top
  pix = host_lib.resize_crop(host_lib.decode_host(ex["image"], "", S), S)
  want = np.asarray(tower(pix[None]))[0]
  assert source.row_of(ex["key"]) == i
  np.testing.assert_allclose(source[i]["image_emb"], want, rtol=8e-3,
                             atol=1e-3)
  # Training from them: the same batches, the same loss to bf16 rounding.
  pre = _tiny("embeddings:" + str(out), ev, shapes_dir, total_steps=2,
              microbatch_size=8)
  train_lib.train_and_evaluate(pre, str(tmp_path / "pre"))
  l_fly = [r["loss"] for r in _rows(tmp_path / "fly") if "loss" in r]
  l_pre = [r["loss"] for r in _rows(tmp_path / "pre") if "loss" in r]
  np.testing.assert_allclose(l_pre[0], l_fly[0], rtol=2e-3)
  # Another tower is refused in one line.
  other = _tiny("embeddings:" + str(out), ev, shapes_dir, seed=1)
  with pytest.raises(ValueError, match=r"computed by another image tower .* "
                     r"than config.model.image"):
    train_lib.train_and_evaluate(other, str(tmp_path / "other"))
  with pytest.raises(ValueError, match="holds embeddings of another tower"):
    other_fly = _tiny(name, ev, shapes_dir, seed=1)
    precompute_lib.precompute(other_fly, str(out), train_lib.make_locked_tower(
        other_fly, tokenizer), rows_per_shard=40)


@pytest.mark.slow
def test_stopped_and_resumed_run_on_webdataset_is_bitwise(tmp_path, corpus,
                                                          shapes_dir):
  train, held_out = corpus
  name, ev = "webdataset:" + train.pattern, "webdataset:" + held_out.pattern
  config = _tiny(name, ev, shapes_dir, precompute_image_embeddings=False,
                 microbatch_size=8)
  ref = tmp_path / "ref"
  train_lib.train_and_evaluate(config, str(ref))

  def stop_at_5(step, row):
    if step == 5 and "loss" in row:
      raise KeyboardInterrupt

  work = tmp_path / "stopped"
  with pytest.raises(KeyboardInterrupt):
    train_lib.train_and_evaluate(config, str(work), on_metrics=stop_at_5)
  summary = train_lib.train_and_evaluate(config, str(work))
  assert summary["resumed_from"] == 4
  a, b = train_lib.load_params(str(work)), train_lib.load_params(str(ref))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)
  ra = [r for r in _rows(work) if "loss" in r]
  rb = [r for r in _rows(ref) if "loss" in r]
  assert [(r["step"], r["loss"], r["data/bad_examples"]) for r in ra] == [
      (r["step"], r["loss"], r["data/bad_examples"]) for r in rb]
