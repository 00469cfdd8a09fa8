"""The trainer's command line as 2 processes x 4 CPU devices (jax.distributed).

The launch a cluster uses (one process per host or per GPU), on localhost:
``python -m train.main ... --jax_distributed --coordinator_address=...
--num_processes=2 --process_id=P``, gloo collectives between the processes.
Checked:

- both processes train to the end; only process 0 writes metrics and the
  summary;
- the checkpoints are written once (keep-last-K, no leftover temporary
  directories) and hold one data-iterator state per process, each for its
  own shard;
- the final parameters (and the loss at every step) equal those of one
  process on 8 devices fed the same global batches: process 0's shard
  batch followed by process 1's. Two processes reading the same shard would
  not match (checked by hand: every step's loss differs); the order of the
  two halves would not show (the loss is symmetric in the pairs);
- a preemption signal to one of the processes stops both at the same step,
  and the rerun ends bitwise as the uninterrupted 2-process run (the
  harness and checks of tests/test_preemption.py; the uninterrupted run is
  that same run).

Equality with the 1-process run is to float32 rounding, not bitwise: the
sums across devices (the loss's and the gradients' psum) cross the process
boundary over gloo, which adds the same 8 values in another order than the
in-process all-reduce; the first step's loss already differs in its last
bit, and AdamW carries such differences on.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests import test_preemption as preemption_tests
from tests.helpers import free_port
from tests.helpers import run_processes
from train import data as data_lib
from train import train as train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "lit_demo.py")
NUM_PROCESSES = 2
TIMEOUT_S = 300
STEPS = 8  # configs/lit_demo.py:tiny


def _launch(workdir, data_dir, *extra):
  """Runs the 2-process command (plus ``extra`` arguments); returns the
  processes' outputs."""
  port = free_port()
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  # Each process has 4 devices; conftest's 8 are for the in-process run.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
  cmds = [[sys.executable, "-m", "train.main", "--config", CONFIG + ":tiny",
           "--workdir", str(workdir), f"--config.data.data_dir={data_dir}",
           "--jax_distributed", f"--coordinator_address=localhost:{port}",
           f"--num_processes={NUM_PROCESSES}", f"--process_id={i}", *extra]
          for i in range(NUM_PROCESSES)]
  codes, outputs, timed_out = run_processes(cmds, env=env, timeout_s=TIMEOUT_S,
                                            cwd=ROOT)
  report = "\n---\n".join(f"process {i} (exit {c}):\n{out[-3000:]}"
                           for i, (c, out) in enumerate(zip(codes, outputs)))
  assert not timed_out, f"hung past {TIMEOUT_S}s:\n{report}"
  assert codes == [0] * NUM_PROCESSES, report
  return outputs


def _tiny_config(data_dir):
  spec = importlib.util.spec_from_file_location("lit_demo_config", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("tiny")
  config.data.data_dir = str(data_dir)
  return config


class _ConcatenatedShards:
  """One process reading the global batches of a 2-process run.

  ``jax.make_array_from_process_local_data`` puts process p's rows on
  process p's devices, and the mesh orders devices by process: the global
  batch is process 0's batch followed by process 1's.
  """

  def __init__(self, make_iterator, config, tokenizer, source):
    self.shards = [make_iterator(
        config, batch_size=config.batch_size // NUM_PROCESSES,
        process_index=p, process_count=NUM_PROCESSES, seed=config.seed,
        tokenizer=tokenizer, source=source) for p in range(NUM_PROCESSES)]
    self.ledger = self.shards[0].ledger
    self.bad = 0

  def __next__(self):
    batches = [next(s) for s in self.shards]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

  def get_state(self):
    return {"shards": [s.get_state() for s in self.shards]}


def _train_losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(l) for l in f if l.strip()]
  return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def _flat(params):
  return jax.tree_util.tree_flatten_with_path(params)[0]


@pytest.mark.slow
def test_two_processes_train_like_one_process_on_the_same_batches(
    tmp_path, monkeypatch):
  data_dir = tmp_path / "tfds"
  work = tmp_path / "two_processes"
  # Through the preemption tests' harness, untouched (the same program as
  # train.main): this run is also the preempted one's reference below.
  codes, outputs = preemption_tests._launch(work, data_dir, NUM_PROCESSES)  # pylint: disable=protected-access
  assert codes == [0] * NUM_PROCESSES, "\n---\n".join(
      o[-3000:] for o in outputs)

  # Trained to the end; the summary and the metrics come from process 0 only.
  assert "2 process(es)" in outputs[0], outputs[0][-3000:]
  assert f"[lit] done: {STEPS} steps" in outputs[0], outputs[0][-3000:]
  assert "[lit] done" not in outputs[1], outputs[1][-3000:]
  losses = _train_losses(work)
  assert [s for s, _ in losses] == list(range(1, STEPS + 1)), losses
  with open(work / "summary.json") as f:
    summary = json.load(f)
  assert summary["steps"] == STEPS and "eval/zeroshot_top1" in summary

  # Checkpoints: written once each, keep-last-2 (every 2 steps), committed.
  ckpt_dir = work / "checkpoints"
  assert sorted(os.listdir(ckpt_dir)) == ["6", "8"], os.listdir(ckpt_dir)
  for step in ("6", "8"):
    assert {"_CHECKPOINT_METADATA", "data", "state"} <= set(
        os.listdir(ckpt_dir / step)), os.listdir(ckpt_dir / step)
    with open(ckpt_dir / step / "data" / "metadata") as f:  # orbax JsonSave
      per_process = json.load(f)["processes"]
    # One iterator state per process, each for its own shard.
    # (No bad examples: a step moves each stream by its 8 examples.)
    per = _tiny_config(data_dir).batch_size // NUM_PROCESSES
    assert [(s["process_index"], s["process_count"], s["next_position"])
            for s in per_process] == [(p, NUM_PROCESSES, int(step) * per)
                                      for p in range(NUM_PROCESSES)]
  params = train_lib.load_params(str(work))
  # Before this workdir goes on: a preempted run must end exactly as it.
  _preempt_one_process_and_resume(tmp_path, data_dir, ref=work)

  # The final evaluation, streamed over 2 processes (each reading and
  # embedding only its own rows of every batch), equals one process's
  # evaluation of the same checkpoint (8 devices, --reevaluate).
  single = train_lib.train_and_evaluate(_tiny_config(data_dir), str(work),
                                        reevaluate=True)
  evals = {k: v for k, v in summary.items() if k.startswith("eval/")}
  assert "eval/t2i_r10" in evals and "eval/zeroshot_top5" in evals
  for k, v in evals.items():
    assert single[k] == pytest.approx(v, abs=1e-6), k

  # One process, 8 devices (conftest), the same global batches.
  assert jax.device_count() == 8 and jax.process_count() == 1
  make_iterator = data_lib.make_train_iterator
  monkeypatch.setattr(
      data_lib, "make_train_iterator",
      lambda config, tokenizer, source, **_: _ConcatenatedShards(
          make_iterator, config, tokenizer, source))
  ref_dir = tmp_path / "one_process"
  train_lib.train_and_evaluate(_tiny_config(data_dir), str(ref_dir))
  ref_params = train_lib.load_params(str(ref_dir))
  ref_losses = _train_losses(ref_dir)
  np.testing.assert_allclose([l for _, l in losses],
                             [l for _, l in ref_losses], rtol=2e-5)
  assert [p for p, _ in _flat(params)] == [p for p, _ in _flat(ref_params)]
  config = _tiny_config(data_dir)
  for (path, a), (_, b) in zip(_flat(params), _flat(ref_params)):
    name = jax.tree_util.keystr(path)
    if "['qkv']['bias']" in name:
      # Attention key biases (k of the fused [q, k, v]) shift every logit of
      # a query equally: their exact gradient is 0, and AdamW turns the
      # rounding noise left in it into steps of up to ~lr, whose sign
      # differs between the two runs. Only their bound is checked.
      bound = 1.5 * config.optim.lr * STEPS
      a, b = np.asarray(a), np.asarray(b)
      assert np.max(np.abs(a[1])) <= bound and np.max(np.abs(b[1])) <= bound, name
      a, b = a[::2], b[::2]
    scale = max(float(np.max(np.abs(b))), 1e-6)
    err = float(np.max(np.abs(np.asarray(a, np.float64) - b)))
    assert err <= 1e-5 * scale, (name, err, scale)
  # Resuming restores every process's state and its own data state: the
  # preempted run above resumes on 2 processes and ends bitwise as this one
  # (a process handed another's data state would fail the iterator's
  # fingerprint check). A longer total_steps resuming: tests/test_train_api.py.


@pytest.mark.parametrize("extra,message", [
    (["--process_id=0"], "--process_id needs --jax_distributed"),
    (["--jax_distributed", "--num_processes=2", "--process_id=0"],
     "missing --coordinator_address"),
    (["--jax_distributed", "--coordinator_address=localhost:1",
      "--num_processes=2", "--process_id=2"], "--process_id=2 must be in"),
])
def test_distributed_flag_errors_are_one_clear_line(tmp_path, extra, message):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  r = subprocess.run(
      [sys.executable, "-m", "train.main", "--config", CONFIG + ":tiny",
       "--workdir", str(tmp_path / "w"), *extra],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]
  assert not os.path.exists(tmp_path / "w")


# ------------------------------------------ preemption of one of the processes


def _preempt_one_process_and_resume(tmp_path, data_dir, ref):
  """SIGTERM to process 1 only while it precomputes its first shard (of 4,
  2 per process): both stop after that round of shards and exit 75, the
  shards written kept. Then SIGUSR1 (SLURM's --signal=USR1@...) to process
  1 only during training: both save the same step and exit 75; the rerun
  ends exactly as an uninterrupted 2-process run. Time-based checkpoints
  on process 0's clock are taken by both processes on the way."""
  n, pre = NUM_PROCESSES, preemption_tests
  work = tmp_path / "run" / "w"
  work.parent.mkdir()
  rows = {"PRECOMPUTE_ROWS": 32}
  codes, outs = pre._launch(work, data_dir, n, SIGNAL_PHASE="precompute",  # pylint: disable=protected-access
                            SIGNAL_PROCESS=1, **rows)
  report = "\n---\n".join(o[-2000:] for o in outs)
  assert codes == [75] * n, report
  assert ("[lit] preempted before step 1 (precomputing the image embeddings;"
          " 1 of this process's 2 shard(s) written, kept for the rerun); "
          "rerun to resume") in outs[0], report
  assert sorted(f for f in os.listdir(work / "image_embeddings")
                if f.startswith("shard-") and f.endswith(".json")) == [
                    "shard-00000.json", "shard-00001.json"], report
  # Also time-based checkpoints, due at every check (0.06 s) on process 0's
  # clock: every process must take part in each save (orbax gathers the
  # data states from all), so a disagreement would hang.
  codes, outs = pre._launch(  # pylint: disable=protected-access
      work, data_dir, n, "--config.checkpoint.every_steps=3",
      "--config.checkpoint.every_minutes=0.001", "--config.checkpoint.keep=20",
      signal_to=1, sig=signal.SIGUSR1, **rows)
  report = "\n---\n".join(o[-2000:] for o in outs)
  assert codes == [75] * n, report
  assert "1 shard(s) of this process already complete, skipped" in outs[0]
  # Step 2: neither every_steps' nor the preemption's, the clock's.
  assert {2, 3} <= set(pre._steps(work)), (pre._steps(work), report)
  lines = [l for l in outs[0].splitlines() if "[lit] preempted at" in l]
  assert len(lines) == 1, report
  step = int(lines[0].split("step ")[1].split(";")[0])
  assert 3 <= step < STEPS, report
  # One checkpoint of that step, holding each process's data state at it.
  assert pre._steps(work)[-1] == step
  per = 16 // n
  assert [(s["process_index"], s["next_position"])
          for s in pre._data_state(work, step)] == [  # pylint: disable=protected-access
              (p, per * step) for p in range(n)]
  codes, outs = pre._launch(work, data_dir, n, **rows)
  assert codes == [0] * n, "\n---\n".join(o[-2000:] for o in outs)
  assert all(f"resumed from the checkpoint of step {step}" in o for o in outs)
  pre._assert_same_run(work, ref, f"2 processes, preempted at step {step}")
  # train.log holds process 0's output (both print these lines) and
  # process 1's warnings, prefixed.
  log = (work / "train.log").read_text()
  assert log.count("# run started") == 3
  assert log.count("[lit] preempted at step") == 1
  assert log.count("[lit] preempted before step 1") == 1
  assert log.count("resumed from the checkpoint of step") == 1
  assert log.count("[process 1] W") >= 3, log
