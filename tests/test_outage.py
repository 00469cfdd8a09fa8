"""A run on object storage through the cluster's bad days: its shards read
from S3 and its checkpoints kept there (moto on 127.0.0.1; the shards
through an OutageProxy and a FaultProxy, tests/netservers.py: outages, and
503s and resets mid-body), one run after another in one workdir, against
the uninterrupted run on local disk:

1. SIGTERM while the shards are being indexed: exit 75 before step 1;
2. the store refuses connections twice: for 1.5 s (within
   config.data.remote_outage_s = 4 s: the reads ride through, retried,
   counted and said), then until the run gives up: exit 75 with the step
   reached saved on S3 (through TensorStore's S3 driver) and one line
   naming the URL and the budget;
3. the rerun, the store back: resumes from S3 and ends with the metrics
   and parameters of the uninterrupted run, bitwise.

train.log alone tells all of it: the bad members' ``shard:key: reason``
lines, the retries, the outage, the preemption and the skipped examples by
reason.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import lit_fixtures
from tests import test_preemption as pre
from tests.netservers import FaultProxy
from tests.netservers import OutageProxy
from tests.netservers import moto_endpoint  # noqa: F401  (fixture)
from tests.netservers import s3  # noqa: F401  (fixture)

pytest.importorskip("s3fs", reason="the cloud extra")
pytest.importorskip("moto", reason="the dev extra")

ROOT = lit_fixtures.ROOT
STEPS = 32  # 8 chunks of 64 stream positions, read 2 chunks ahead.
BUDGET_S = 4
PLANTED = ("corrupt_jpeg", "empty_caption", "orphan")


def _args(workdir, name, directory, *extra):
  return ["--config", os.path.join(ROOT, "configs/lit_demo.py") + ":tiny",
          "--workdir", str(workdir), f"--config.data.name={name}",
          "--config.data.eval_split=", "--config.data.image_size=16",
          "--config.data.max_bad_fraction=0.5",
          "--config.data.cache_max_mb=0",
          "--config.precompute_image_embeddings=False",
          f"--config.total_steps={STEPS}", "--config.eval.every_steps=0",
          "--config.checkpoint.every_steps=8",
          f"--config.checkpoint.directory={directory}",
          f"--config.data.remote_outage_s={BUDGET_S}",
          f"--config.data.shard_index_cache={workdir}-index", *extra]


def _cmd(*args):
  return [sys.executable, "-c", pre._HARNESS, *args]  # pylint: disable=protected-access


def _env(**extra):
  # Retry lines: a new burst after 0.5 s without a retry (the two outages
  # are seconds apart).
  return pre._env(REMOTE_BURST_GAP_S=0.5, **extra)  # pylint: disable=protected-access


def _rows(workdir):
  rows = pre._metrics(workdir)  # pylint: disable=protected-access
  for r in rows:
    r.pop("data/retries", None)  # The outage's, in the run through it.
  return rows


def _committed(s3, prefix):
  listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix)
  return sorted(int(o["Key"][len(prefix):].split("/")[0])
                for o in listed.get("Contents", [])
                if o["Key"].endswith("/commit_success.txt")
                and o["Key"].count("/") == prefix.count("/") + 1)


def _flat(tree):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.tree_util.tree_flatten_with_path(tree)[0]


@pytest.mark.slow
def test_an_outage_and_a_signal_on_s3_lose_nothing(s3, tmp_path):
  from train import train as train_lib  # pylint: disable=import-outside-toplevel
  root = tmp_path / "shards"
  sh = lit_fixtures.shards(root, "train", num=40, per_shard=8,
                           planted=PLANTED)
  base = s3.put_dir(str(root), "shards")
  name = "webdataset:" + base + "/" + os.path.basename(sh.pattern)
  ref, work = tmp_path / "ref", tmp_path / "work"

  r = subprocess.run(
      _cmd(*_args(ref, "webdataset:" + sh.pattern, str(tmp_path / "ckpt"))),
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]

  with FaultProxy(s3.host_port, seed=5, fraction=0.1, max_faults=8,
                  kinds=("503", "reset"), methods=("GET",)) as faults, \
      OutageProxy(("127.0.0.1", faults.port)) as proxy:
    options = json.dumps({"s3": {"endpoint_url": proxy.url}})
    args = _args(work, name, s3.url("work"),
                 f"--config.data.storage_options={options}")

    # 1. A signal while the shards are being indexed, 2 at a time.
    r = subprocess.run(_cmd(*args), cwd=ROOT, capture_output=True, text=True,
                       env=_env(SIGNAL_PHASE="indexing", INDEX_CHUNK=2),
                       timeout=600)
    assert r.returncode == 75, r.stderr[-3000:]
    assert ("[lit] preempted before step 1 (indexing the training shards, 2 "
            "of 6 done); rerun to resume") in r.stdout, r.stdout[-2000:]
    assert _committed(s3, "work/") == []

    # 2. Two outages: 1.5 s from the first read after step 2, then from the
    # first read after step 10 until the run gives up.
    proc = subprocess.Popen(_cmd(*args), cwd=ROOT, env=_env(STEP_SLEEP=0.15),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    t0, armed = time.time(), []
    while proc.poll() is None:
      assert time.time() - t0 < pre.TIMEOUT_S, "the run hung"
      step = pre._logged_step(work)  # pylint: disable=protected-access
      if step >= 2 and not armed:
        proxy.arm(1.5)
        armed.append(step)
      if step >= 10 and len(armed) == 1:
        proxy.arm(None)
        armed.append(step)
      time.sleep(0.02)
    out, err = proc.communicate()
    assert proc.returncode == 75, (out + err)[-3000:]
    assert len(proxy.outages) == 2 and proxy.outages[0][1] is not None
    lines = [l for l in out.splitlines() if l.startswith("[lit] storage")]
    assert len(lines) == 1, (out + err)[-3000:]
    reached = int(lines[0].split("at step ")[1].split(":")[0])
    assert 10 <= reached < STEPS, lines
    assert lines[0].startswith(
        f"[lit] storage outage at step {reached}: cannot read {base}/train-")
    assert (f"the store kept failing for config.data.remote_outage_s="
            f"{BUDGET_S} s (") in lines[0]
    assert lines[0].endswith("; checkpoint saved; rerun to resume")
    retried = [l for l in err.splitlines()
               if l.startswith(f"[data] s3: retrying {base}/train-")]
    assert len(retried) >= 2, err[-3000:]  # One line per burst.
    assert reached in _committed(s3, "work/")
    assert pre._logged_step(work) == reached  # pylint: disable=protected-access
    assert max(r["data/retries"] for r in pre._metrics(work)) > 0  # pylint: disable=protected-access
    proxy.up()

    # 3. The rerun, the store back.
    r = subprocess.run(_cmd(*args), cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert [f for f in faults.faults if f[0] != "slow"], faults.faults
  assert f"resumed from the checkpoint of step {reached}" in r.stdout
  assert _rows(work) == _rows(ref)
  got, want = (_flat(train_lib.load_params(str(w))) for w in (work, ref))
  assert got and [p for p, _ in got] == [p for p, _ in want]
  for (path, a), (_, b) in zip(got, want):
    np.testing.assert_array_equal(a, b, err_msg=str(path))
  assert not os.path.exists(work / "checkpoints")  # On S3 only.

  log = (work / "train.log").read_text()
  assert log.count("# run started") == 3
  for where in sh.bad:  # Each bad member named, with its reason.
    assert f"skipped a bad example of the training data: {where}: " in log
  assert "[lit] preempted before step 1 (indexing the training shards" in log
  assert lines[0] in log and retried[0] in log
  summary = [l for l in log.splitlines() if l.startswith(
      "[lit] training data: ")]
  assert summary == [l for l in r.stdout.splitlines()
                     if l.startswith("[lit] training data: ")]
  assert summary[0].startswith("[lit] training data: 3 bad example(s) "
                               "skipped (")
