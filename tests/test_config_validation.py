"""The checks of a LiT config, in the order a user thinks of the run, on
real files: a safetensors checkpoint from the fixtures, webdataset shards.

The image checkpoint is checked first, with the loader's own message; then
the tokenizer (the checkpoint's files only when config.tokenizer.bpe_path is
unset); then the data. A config that fails leaves no workdir behind.
Zero-shot runs on the held-out shards' labels with class names, and says
why in one line when it cannot.
"""
import os
import subprocess
import sys

import pytest

from tests import helpers
from tests import lit_fixtures
from tests.netservers import moto_endpoint, s3  # noqa: F401  pylint: disable=unused-import

ROOT = lit_fixtures.ROOT
sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("user")
  return {"ckpt": lit_fixtures.checkpoint(root),
          "train": lit_fixtures.shards(root, "train", num=24).pattern,
          "val": lit_fixtures.shards(root, "val", num=16, split="test",
                                     seed=1).pattern,
          "classnames": lit_fixtures.classnames(root),
          "root": str(root)}


def _config(files, **overrides):
  from configs import lit_pretrained  # pylint: disable=g-import-not-at-top
  c = lit_pretrained.get_config("user_small")
  c.model.image.init = files["ckpt"]
  c.data.name = "webdataset:" + files["train"]
  c.data.eval_split = "webdataset:" + files["val"]
  c.data.zeroshot_classnames_file = files["classnames"]
  return helpers.set_overrides(c, overrides)


def _fails(config, workdir, error, match):
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  with pytest.raises(error, match=match):
    train_lib.train_and_evaluate(config, str(workdir))
  assert not os.path.exists(workdir), "a failed validation made the workdir"


def test_the_user_configs_validate(files):
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  from configs import lit_pretrained  # pylint: disable=g-import-not-at-top
  train_lib.validate(_config(files))
  user = lit_pretrained.get_config("user")
  small = lit_pretrained.get_config("user_small")
  assert user.data.wds_label_field == small.data.wds_label_field == "label"
  assert user.model.image.locked and user.precompute_image_embeddings
  assert 1024 <= user.batch_size <= 4096 and 1000 <= user.total_steps <= 10000
  assert 0 < user.eval.every_steps < user.total_steps
  assert small.total_steps <= 10 and not small.precompute_image_embeddings


def test_a_mistyped_checkpoint_path_names_the_checkpoint(files, tmp_path):
  typo = files["ckpt"].replace("checkpoint", "chekpoint")
  _fails(_config(files, **{"model.image.init": typo}), tmp_path / "w",
         FileNotFoundError,
         "config.model.image.init: image tower checkpoint not found: "
         + typo)


def test_a_directory_that_is_no_checkpoint_names_what_it_holds(files,
                                                                 tmp_path):
  d = tmp_path / "notes"
  d.mkdir()
  (d / "readme.txt").write_text("not weights")
  _fails(_config(files, **{"model.image.init": str(d)}), tmp_path / "w",
         ValueError, r"no recognisable image tower checkpoint .*found "
         r"\['readme.txt'\]")


def test_the_tokenizer_defaults_to_the_checkpoint_only_when_unset(files,
                                                                  tmp_path):
  from train.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  c = _config(files)
  assert c.tokenizer.bpe_path == ""
  assert tok_lib.resolve_tokenizer_config(c).bpe_path == files["ckpt"]
  assert tok_lib.make_tokenizer(c).vocab_size > 258
  # A checkpoint without tokenizer files: the error names the checkpoint
  # the tokenizer was looked for in, after the checkpoint itself passed.
  bare = tmp_path / "bare"
  bare.mkdir()
  for name in ("config.json", "model.safetensors"):
    os.symlink(os.path.join(files["ckpt"], name), bare / name)
  _fails(_config(files, **{"model.image.init": str(bare)}), tmp_path / "w",
         ValueError, r"config.tokenizer.bpe_path is unset and "
         r"config.model.image.init=.*bare.* has no CLIP tokenizer files")
  # Set on its own, bpe_path is used and the image tower stays where it is.
  vocab = os.path.join(lit_fixtures.TOWERS, "clip_bpe")
  c = _config(files, **{"model.image.init": str(bare),
                        "tokenizer.bpe_path": vocab})
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  train_lib.validate(c)
  assert tok_lib.resolve_tokenizer_config(c).bpe_path == vocab
  assert c.model.image.init == str(bare)
  _fails(_config(files, **{"tokenizer.bpe_path": str(tmp_path / "nope")}),
         tmp_path / "w", ValueError,
         r"config.tokenizer.bpe_path='.*nope': expected a tokenizer.json")


def test_a_missing_shard_fails_before_the_workdir_exists(files, tmp_path):
  _fails(_config(files, **{"data.name": "webdataset:" + files["root"]
                           + "/train-{000000..000009}.tar"}),
         tmp_path / "w", ValueError, "shard .*train-000002.tar.* does not "
         "exist")


def test_the_command_line_says_the_loaders_line_and_leaves_no_workdir(
    files, tmp_path):
  typo = files["ckpt"] + "x"
  work = tmp_path / "runs" / "lit_mine"
  r = subprocess.run(
      [sys.executable, "-m", "train.main", "--config",
       "configs/lit_pretrained.py:user_small", "--workdir", str(work),
       f"--config.model.image.init={typo}",
       f"--config.data.name=webdataset:{files['train']}",
       f"--config.data.eval_split=webdataset:{files['val']}",
       f"--config.data.zeroshot_classnames_file={files['classnames']}"],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
      capture_output=True, text=True, timeout=300)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert lines == [f"error: config.model.image.init: image tower checkpoint "
                   f"not found: {typo}"], r.stderr[-2000:]
  assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------ zero-shot


def test_zero_shot_runs_on_the_held_out_shards_labels(files):
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  sets = data_lib.eval_sets_of(_config(files))
  zs = sets.zeroshot
  assert zs is not None and sets.zeroshot_skipped == ""
  assert zs.split is sets.retrieval.split  # Read and embedded once.
  assert zs.classnames == list(lit_fixtures.synthetic.SHAPES)
  assert zs.templates == ["a photo of a {}."]
  got = zs.labels
  assert len(got) == 16 and got.min() >= 0 and got.max() < len(zs.classnames)


@pytest.mark.parametrize("case,why", [
    ("no field", "config.data.wds_label_field is empty"),
    ("no names", "no class names: set config.data.zeroshot_classnames"),
    ("no json", r"none of the 8 held-out examples of .* has a label "
                r"\(config.data.wds_label_field='label'\)"),
])
def test_without_labels_or_names_one_line_says_why(files, tmp_path, case,
                                                   why):
  import re  # pylint: disable=g-import-not-at-top
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  over = {"no field": {"data.wds_label_field": ""},
          "no names": {"data.zeroshot_classnames_file": ""}}.get(case, {})
  if case == "no json":
    over = {"data.eval_split": "webdataset:" + lit_fixtures.shards(
        tmp_path, "nolabels", num=8, labels=False).pattern}
  sets = data_lib.eval_sets_of(_config(files, **over))
  assert sets.zeroshot is None and re.search(why, sets.zeroshot_skipped), (
      sets.zeroshot_skipped)
  # Retrieval still reads every held-out example.
  split = sets.retrieval.split
  assert all("bad" not in e for e in split.read(range(split.num_examples)))


def test_a_label_outside_the_class_names_is_an_error_before_training(
    files, tmp_path):
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  val = lit_fixtures.shards(tmp_path, "val", num=8, label_offset=100)
  with pytest.raises(ValueError, match=r"config.data.eval_split: the label "
                     r"10\d of val-000000.tar:000000 is outside the 8 class "
                     r"names \(labels 0..7\)"):
    data_lib.eval_sets_of(_config(files, **{
        "data.eval_split": "webdataset:" + val.pattern}))


def test_zero_shot_metrics_on_webdataset_eval(files):
  """The evaluator of the recipe's config reports zero-shot top-1/top-5 and
  retrieval on the held-out shards (random text tower: any value)."""
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  from train.data import tokenizer as tok_lib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  c = _config(files)
  tok = tok_lib.make_tokenizer(c)
  img, txt, head = train_lib.make_models(c, tok)
  params = train_lib.init_params(c, img, txt, head, tok)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  ev = train_lib.make_evaluator(c, mesh, img, txt, tok)
  assert any("zero-shot eval: 16 images" in l for l in ev.describe())
  m = ev(params)
  for k in ("zeroshot_top1", "zeroshot_top5", "i2t_r1", "t2i_r1"):
    assert 0.0 <= m[k] <= 1.0, (k, m)
  assert m["retrieval_num_images"] == 16.0


def test_zero_shot_on_a_table_label_column(files, tmp_path):
  """A CSV held-out set with a label column, class names keyed by the
  integer labels ("label<TAB>name", any order)."""
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  from train.data.sources import synthetic  # pylint: disable=g-import-not-at-top
  rows = ["image,caption,label"]
  for i in range(6):
    image, attrs, _ = synthetic.render_example(2, "test", i, 16)
    name = f"img{i}.jpg"
    (tmp_path / name).write_bytes(synthetic._encode(image, "jpg", 95))  # pylint: disable=protected-access
    rows.append(f"{name},a {attrs['shape']},{attrs['shape_id']}")
  (tmp_path / "val.csv").write_text("\n".join(rows) + "\n")
  names = list(synthetic.SHAPES)
  (tmp_path / "names.tsv").write_text("".join(
      f"{i}\t{n}\n" for i, n in reversed(list(enumerate(names)))))
  sets = data_lib.eval_sets_of(_config(files, **{
      "data.eval_split": f"csv:{tmp_path / 'val.csv'}",
      "data.table_label_column": "label",
      "data.zeroshot_classnames_file": str(tmp_path / "names.tsv")}))
  assert sets.zeroshot is not None, sets.zeroshot_skipped
  assert sets.zeroshot.classnames == names
  want = [synthetic.render_example(2, "test", i, 16)[1]["shape_id"]
          for i in range(6)]
  assert sets.zeroshot.labels.tolist() == want
  no_column = data_lib.eval_sets_of(_config(files, **{
      "data.eval_split": f"csv:{tmp_path / 'val.csv'}"}))
  assert no_column.zeroshot_skipped.startswith(
      "config.data.table_label_column is empty")


def test_training_shards_need_no_labels(files, tmp_path):
  """The label field serves the held-out shards: training shards without a
  .json read every example, none counted bad."""
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  from train import data as data_lib  # pylint: disable=g-import-not-at-top
  bare = lit_fixtures.shards(tmp_path, "bare", num=16, labels=False)
  c = _config(files, **{"data.name": "webdataset:" + bare.pattern})
  assert c.data.wds_label_field == "label"
  source = train_lib._training_source(c, str(tmp_path), None, True)  # pylint: disable=protected-access
  it = data_lib.make_train_iterator(c, batch_size=8, source=source)
  for _ in range(4):
    next(it)
  assert it.bad == 0 and it.seen == 16


# ----------------------------------------- checkpoints, preemption, workdir


def _tiny(**overrides):
  from configs import lit_demo  # pylint: disable=g-import-not-at-top
  return helpers.set_overrides(lit_demo.get_config("tiny"), overrides)


@pytest.mark.parametrize("overrides,match", [
    ({"checkpoint.every_minutes": -1.0},
     r"^config.checkpoint.every_minutes=-1.0 must be a finite number >= 0"),
    ({"checkpoint.every_minutes": float("nan")},
     r"^config.checkpoint.every_minutes=nan must be"),
    ({"preemption_signals": ("SIGTERM", "SIGKILL")},
     r"^config.preemption_signals: 'SIGKILL' cannot be caught"),
    ({"checkpoint.directory": "https://host/run"},
     r"^config.checkpoint.directory=https://host/run: orbax-checkpoint cannot "
     r"write checkpoints to https://"),
])
def test_checkpoint_and_preemption_keys_are_checked(overrides, match):
  from train import config_base  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match=match) as e:
    config_base.check_config(_tiny(**overrides))
  assert "\n" not in str(e.value)
  config_base.check_config(_tiny(**{"checkpoint.every_minutes": 0.5,
                                    "preemption_signals": ()}))


@pytest.mark.slow
def test_a_workdir_on_object_storage_is_one_line_at_start_up(tmp_path):
  r = subprocess.run(
      [sys.executable, "-m", "train.main", "--config",
       os.path.join(ROOT, "configs", "lit_demo.py") + ":tiny", "--workdir",
       "s3://bucket/run"], cwd=ROOT, capture_output=True, text=True,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), timeout=120)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "error: workdir s3://bucket/run: a workdir is a local or mounted "
      "directory"), lines
  assert "--config.checkpoint.directory=gs://" in lines[0]


def test_orbax_alone_cannot_write_checkpoints_to_s3(s3, tmp_path,
                                                    monkeypatch):
  """Why train/checkpoint.py wraps orbax's TensorStore spec builder for
  s3:// (``_s3_kvstores``): orbax writes the metadata through s3fs but
  builds the arrays' TensorStore spec for a local path, and refuses it.
  (When an orbax release writes to S3 by itself, this fails: then drop the
  wrapper.)"""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  build = tensorstore_utils.build_kvstore_tspec  # Unwrapped, if it is.
  monkeypatch.setattr(tensorstore_utils, "build_kvstore_tspec",
                      getattr(build, "__wrapped__", build))
  monkeypatch.chdir(tmp_path)  # It would make a local "s3:" folder.
  mngr = ocp.CheckpointManager(
      s3.url("run"), item_names=("state",),
      options=ocp.CheckpointManagerOptions(create=True,
                                           enable_async_checkpointing=False))
  with pytest.raises(ValueError, match="Checkpoint path should be absolute"):
    mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(
        {"w": jnp.arange(5.0)})), force=True)
  mngr.close()
