"""The trainer's in-process API (what notebooks/lit_demo.ipynb uses):
``train_and_evaluate(..., on_metrics=...)`` and ``load_params(workdir)``.

One tiny in-process run (the demo's ``:tiny`` config) serves every check.
"""
import contextlib
import io
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from configs import lit_demo
from train import data as data_lib
from train import step as step_lib
from train import train


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
  workdir = str(tmp_path_factory.mktemp("lit"))
  config = lit_demo.get_config("tiny")
  config.data.data_dir = data_dir
  config.total_steps = 6
  config.eval.every_steps = 3
  config.checkpoint.every_steps = 2
  config.checkpoint.keep = 3
  config.progress_bar = False
  calls = []
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    summary = train.train_and_evaluate(
        config, workdir,
        on_metrics=lambda step, row: calls.append((step, row)))
  return config, workdir, summary, calls, out.getvalue()


def test_on_metrics_sees_every_row_of_metrics_jsonl(run):
  _, workdir, _, calls, _ = run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f if l.strip()]
  assert [row for _, row in calls] == rows
  assert all(step == row["step"] for step, row in calls)
  # Train rows every step (log_every_steps=1) and eval rows at 3 and the end.
  assert [s for s, r in calls if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert [s for s, r in calls if "eval/zeroshot_top1" in r] == [3, 6]


def test_load_params_gives_the_final_parameters(run):
  config, workdir, summary, _, _ = run
  params = train.load_params(workdir)
  assert set(params) == {"img", "txt", "head"}
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params))
  # The trainer's own evaluation of the loaded parameters reproduces the
  # final evaluation of the run.
  tokenizer = data_lib.make_tokenizer(config)
  image_tower, text_tower, _ = train.make_models(config, tokenizer)
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  got = train.make_evaluator(config, mesh, image_tower, text_tower,
                             tokenizer)(params)
  for k, v in got.items():
    assert v == pytest.approx(summary[f"eval/{k}"], abs=1e-6), k


def test_load_params_of_an_earlier_step(run):
  _, workdir, _, _, _ = run
  final, earlier = train.load_params(workdir), train.load_params(workdir, 4)
  # The image tower is locked; the text tower trained between steps 4 and 6.
  for a, b in zip(jax.tree.leaves(final["img"]), jax.tree.leaves(earlier["img"])):
    np.testing.assert_array_equal(a, b)
  assert any(not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(final["txt"]), jax.tree.leaves(earlier["txt"])))
  # Reading does not delete older checkpoints.
  assert train.load_params(workdir, 2) is not None


def test_load_params_errors_name_the_missing_checkpoint(run, tmp_path):
  _, workdir, _, _, _ = run
  with pytest.raises(FileNotFoundError, match="no checkpoints in"):
    train.load_params(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="of step 5"):
    train.load_params(workdir, 5)


def test_mid_run_evaluations_are_printed(run):
  *_, stdout = run
  lines = [l for l in stdout.splitlines() if l.startswith("[lit] eval at")]
  assert len(lines) == 1 and lines[0].startswith("[lit] eval at step 3: "
                                                 "zero-shot top-1 "), stdout
  assert "retrieval R@1 image->text" in lines[0]


def _snapshot(workdir):
  files = {}
  for name in ("summary.json", "metrics.jsonl"):
    with open(os.path.join(workdir, name)) as f:
      files[name] = f.read()
  return files, sorted(os.listdir(os.path.join(workdir, "tb")))


def test_rerun_of_a_finished_run_trains_nothing_and_keeps_its_logs(
    run, capsys):
  config, workdir, summary, _, _ = run
  before = _snapshot(workdir)
  again = train.train_and_evaluate(config, workdir)
  out = capsys.readouterr().out
  assert (f"{workdir} is already at config.total_steps=6: nothing to train. "
          "To train further, rerun with --config.total_steps=N (N > 6)") in out
  assert "--reevaluate" in out and "done:" not in out
  assert "final train loss" in out and "zero-shot top-1" in out
  assert again == json.loads(json.dumps(summary))
  assert "loss" in again and "temperature" in again
  # No second TensorBoard event file, no rewritten metrics or summary.
  assert _snapshot(workdir) == before


def test_reevaluate_a_finished_run_keeps_the_train_metrics(run, capsys):
  config, workdir, summary, _, _ = run
  again = train.train_and_evaluate(config, workdir, reevaluate=True)
  assert "nothing to train" in capsys.readouterr().out
  for k, v in summary.items():
    assert again[k] == pytest.approx(v, abs=1e-6), k
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f) == again


@pytest.mark.slow
def test_interrupt_finishes_the_checkpoint_and_says_where_to_resume(
    tmp_path, data_dir, capsys):
  """KeyboardInterrupt (here raised by the metrics callback at step 3)
  leaves the checkpoint of step 2 and the message; the rerun resumes."""
  config = lit_demo.get_config("tiny")
  config.data.data_dir = data_dir
  config.total_steps = 4
  config.checkpoint.every_steps = 2
  config.progress_bar = False

  def interrupt_at_3(step, row):
    if step == 3 and "loss" in row:
      raise KeyboardInterrupt

  workdir = str(tmp_path / "lit")
  with pytest.raises(KeyboardInterrupt):
    train.train_and_evaluate(config, workdir, on_metrics=interrupt_at_3)
  out = capsys.readouterr().out
  assert ("[lit] interrupted at step 3; last checkpoint step 2; rerun to "
          "resume\n") in out, out
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
  summary = train.train_and_evaluate(config, workdir)
  assert "resumed from the checkpoint of step 2" in capsys.readouterr().out
  assert summary["steps"] == 4 and summary["resumed_from"] == 2
  # The finished run, total_steps raised, trains on from its last step (on
  # 2 processes each restores its own data state: the preempted run of
  # tests/test_train_multiprocess.py).
  config.total_steps = 5
  summary = train.train_and_evaluate(config, workdir)
  assert "resumed from the checkpoint of step 4" in capsys.readouterr().out
  assert summary["steps"] == 5 and summary["resumed_from"] == 4
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [json.loads(l)["step"] for l in f if '"loss"' in l]
  assert steps[-3:] == [3, 4, 5], steps

