"""Checkpoints on gs://, against a local GCS server (tests/netservers.py:
gcp-storage-emulator's JSON API on 127.0.0.1).

A run whose config.checkpoint.directory is a bucket, and whose webdataset
shards are read from the same bucket, saves its checkpoints there (orbax:
the arrays through TensorStore's GCS driver, the rest through gcsfs); a
rerun of a run stopped after an earlier checkpoint resumes from the bucket
and ends with the same metrics and parameters, bitwise.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import lit_fixtures
from tests.netservers import gcs  # noqa: F401  (fixture)
from tests.netservers import gcs_env
from tests.netservers import gcs_server  # noqa: F401  (fixture)

pytest.importorskip("gcsfs", reason="the cloud extra")
pytest.importorskip("orbax.checkpoint")

ROOT = lit_fixtures.ROOT


def _train(workdir, name, directory, endpoint):
  cmd = [sys.executable, "-m", "train.main", "--config",
         os.path.join(ROOT, "configs/lit_demo.py") + ":tiny",
         "--workdir", str(workdir), f"--config.data.name={name}",
         "--config.data.eval_split=", "--config.data.image_size=16",
         "--config.data.cache_max_mb=0",
         "--config.precompute_image_embeddings=False", "--config.total_steps=4",
         "--config.checkpoint.every_steps=2", "--config.log_every_steps=1",
         f"--config.checkpoint.directory={directory}",
         f"--config.data.shard_index_cache={workdir}-index"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             **gcs_env(endpoint))
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f if '"loss"' in line]
  for row in rows:
    row.pop("steps_per_sec")  # Wall time: the one key that may differ.
  return r, rows


def _flat(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _steps(gcs, prefix):
  """The checkpoint steps complete in the bucket under ``prefix``."""
  done = [n[len(prefix):].split("/")[0] for n in gcs.list(prefix)
          if n.endswith("/commit_success.txt") and n.count("/") == 2]
  return sorted(int(s) for s in done if s.isdigit())


@pytest.mark.slow
def test_a_run_checkpoints_to_gcs_and_a_rerun_resumes_bitwise(gcs, tmp_path):
  from train import train as train_lib  # pylint: disable=import-outside-toplevel
  shards = lit_fixtures.shards(tmp_path / "shards", num=40, per_shard=8)
  gcs.put_dir(str(tmp_path / "shards"), "shards")
  name = "webdataset:" + gcs.url("shards/" + os.path.basename(shards.pattern))
  directory = gcs.url("run")
  work = tmp_path / "w"

  first, rows = _train(work, name, directory, gcs.endpoint)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert _steps(gcs, "run/") == [2, 4]
  assert not os.path.exists(work / "checkpoints")
  params = train_lib.load_params(str(work))  # From the bucket.

  # The run as if stopped after the checkpoint of step 2.
  for key in gcs.list("run/4/"):
    gcs.delete(key)
  assert _steps(gcs, "run/") == [2]
  second, resumed_rows = _train(work, name, directory, gcs.endpoint)
  assert "resumed from the checkpoint of step 2" in second.stdout, (
      second.stdout[-2000:])
  assert _steps(gcs, "run/") == [2, 4]
  assert resumed_rows == rows  # Steps 3 and 4 again, bitwise.
  flat, want = _flat(train_lib.load_params(str(work))), _flat(params)
  assert flat and [p for p, _ in flat] == [p for p, _ in want]
  for (path, a), (_, b) in zip(flat, want):
    np.testing.assert_array_equal(a, b, err_msg=str(path))
