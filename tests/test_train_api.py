"""The trainer's in-process API (what notebooks/lit_demo.ipynb uses):
``train_and_evaluate(..., on_metrics=...)`` and ``load_params(workdir)``.

One tiny in-process run (the demo's ``:tiny`` config) serves every check.
"""
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from configs import lit_demo
from train import data as data_lib
from train import evaluate
from train import step as step_lib
from train import train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("lit"))
  config = lit_demo.get_config("tiny")
  config.data.data_dir = str(tmp_path_factory.mktemp("tfds"))
  config.total_steps = 6
  config.eval.every_steps = 3
  config.checkpoint.every_steps = 2
  config.checkpoint.keep = 3
  config.progress_bar = False
  calls = []
  summary = train.train_and_evaluate(
      config, workdir, on_metrics=lambda step, row: calls.append((step, row)))
  return config, workdir, summary, calls


def test_on_metrics_sees_every_row_of_metrics_jsonl(run):
  _, workdir, _, calls = run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f if l.strip()]
  assert [row for _, row in calls] == rows
  assert all(step == row["step"] for step, row in calls)
  # Train rows every step (log_every_steps=1) and eval rows at 3 and the end.
  assert [s for s, r in calls if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert [s for s, r in calls if "eval/zeroshot_top1" in r] == [3, 6]


def test_load_params_gives_the_final_parameters(run):
  config, workdir, summary, _ = run
  params = train.load_params(workdir)
  assert set(params) == {"img", "txt", "head"}
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
  # The trainer's own evaluation of the loaded parameters reproduces the
  # final evaluation of the run.
  tokenizer = data_lib.make_tokenizer(config)
  image_tower, text_tower, _ = train.make_models(config, tokenizer)
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  zs, rs = data_lib.make_eval_sets(config, tokenizer)
  bs = -(-config.eval.batch_size // mesh.size) * mesh.size
  got = evaluate.evaluate(step_lib.make_embed_fn(mesh, image_tower),
                          step_lib.make_embed_fn(mesh, text_tower), params,
                          tokenizer, zs, rs, bs)
  for k, v in got.items():
    assert v == pytest.approx(summary[f"eval/{k}"], abs=1e-6), k


def test_load_params_of_an_earlier_step(run):
  _, workdir, _, _ = run
  final, earlier = train.load_params(workdir), train.load_params(workdir, 4)
  # The image tower is locked; the text tower trained between steps 4 and 6.
  for a, b in zip(jax.tree.leaves(final["img"]), jax.tree.leaves(earlier["img"])):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(final["txt"]), jax.tree.leaves(earlier["txt"])))
  # Reading does not delete older checkpoints.
  assert train.load_params(workdir, 2) is not None


def test_load_params_errors_name_the_missing_checkpoint(run, tmp_path):
  _, workdir, _, _ = run
  with pytest.raises(FileNotFoundError, match="no checkpoints in"):
    train.load_params(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="of step 5"):
    train.load_params(workdir, 5)
