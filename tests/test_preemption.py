"""Preemption: a signal lets the step in progress finish, a checkpoint of it
is saved, the run exits 75 (train/preemption.py) and the rerun resumes to
exactly the uninterrupted run; a signal before the first step stops the run
at the next safe point with what can be resumed kept (2 jax.distributed
CPU processes of which only one gets the signal:
tests/test_train_multiprocess.py, beside that file's uninterrupted
2-process run). A second signal during the save changes nothing; SIGKILL
during it leaves the previous checkpoint usable. Time-based checkpoints
(config.checkpoint.every_minutes) on an injected clock.

The command runs through a small harness (``_HARNESS``) that can slow each
step (so that an external signal lands mid-run, not after the end), send a
signal to itself at a given step or phase (SIGNAL_PHASE), delay orbax's
finalize of the checkpoint saved after a signal and send another signal
while it waits.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import free_port
from train import preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "lit_demo.py") + ":tiny"
STEPS = 8  # configs/lit_demo.py:tiny, checkpoints every 2 steps, keep 2.
TIMEOUT_S = 300

_HARNESS = """
import os, signal, sys, threading, time
import orbax.checkpoint as ocp
from orbax.checkpoint._src.checkpointers import async_checkpointer
from absl import app
from train import main, preemption
env = os.environ
sleep = float(env.get("STEP_SLEEP", "0"))
at = int(env.get("SIGNAL_AT", "0"))
poll = preemption.SaveTriggers.poll
def slow_poll(self, step):
  time.sleep(sleep)
  if step == at:  # A signal while the step is in progress.
    os.kill(os.getpid(), signal.SIGTERM)
  return poll(self, step)
preemption.SaveTriggers.poll = slow_poll
if "SLOW_COMMIT" in env:  # The first checkpoint saved after a signal (the
  # preemption's): finalized late, and SLOW_COMMIT (a signal name) arrives
  # while the trainer waits for it.
  save, commit = ocp.CheckpointManager.save, async_checkpointer._on_commit_callback
  slow = []
  def slow_commit(tmpdir, *args, **kw):
    if slow and os.path.basename(str(tmpdir.get())).startswith(f"{slow[0]}."):
      time.sleep(4)
    return commit(tmpdir, *args, **kw)
  def save_then_signal(self, step, *args, **kw):
    if not slow and preemption.first_signal() is not None:
      slow.append(step)
    out = save(self, step, *args, **kw)
    if slow == [step]:
      sig = signal.Signals[env["SLOW_COMMIT"]]
      threading.Timer(1.0, os.kill, (os.getpid(), sig)).start()
    return out
  async_checkpointer._on_commit_callback = slow_commit
  ocp.CheckpointManager.save = save_then_signal
# SIGNAL_PHASE: SIGTERM to this process (with SIGNAL_PROCESS, only to that
# --process_id) once, at a phase before the first step: "start" (the config
# check), "indexing" (the first shard indexed), "precompute" (the first
# precomputed shard written), "compile" (the first train step called).
phase = env.get("SIGNAL_PHASE", "")
if phase and env.get("SIGNAL_PROCESS", "0") != next(
    (a.split("=")[1] for a in sys.argv if a.startswith("--process_id=")), "0"):
  phase = ""
sent = []
def signal_once():
  if not sent:
    sent.append(1)
    os.kill(os.getpid(), signal.SIGTERM)
def before(module, name):
  fn = getattr(module, name)
  def wrapped(*args, **kw):
    signal_once()
    return fn(*args, **kw)
  setattr(module, name, wrapped)
from train import precompute, step, train
from train.data.sources import remote, webdataset
if "REMOTE_BURST_GAP_S" in env:
  remote.BURST_GAP_S = float(env["REMOTE_BURST_GAP_S"])
if "INDEX_CHUNK" in env:
  webdataset.INDEX_CHUNK = int(env["INDEX_CHUNK"])
if "PRECOMPUTE_ROWS" in env:
  precompute.DEFAULT_ROWS_PER_SHARD = int(env["PRECOMPUTE_ROWS"])
if phase == "start":
  before(train, "validate")
elif phase == "indexing":
  before(webdataset, "_index_shard")
elif phase == "precompute":
  before(precompute, "_atomic_write")
elif phase == "compile":
  make_step = step.make_train_step
  def make_train_step(**kw):
    fn = make_step(**kw)
    def first(*args):
      signal_once()
      return fn(*args)
    first.lower = fn.lower  # The step's memory plan lowers it first.
    return first
  step.make_train_step = make_train_step
sys.argv[0] = main.__file__
app.run(main.main, flags_parser=main._parse_flags)
"""


def _env(devices=None, **extra):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             **{k: str(v) for k, v in extra.items()})
  if devices is not None:
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={devices}"])
  return env


def _args(workdir, data_dir, *extra):
  return ["--config", CONFIG, "--workdir", str(workdir),
          f"--config.data.data_dir={data_dir}", *extra]


def _run(workdir, data_dir, *extra, **env):
  r = subprocess.run([sys.executable, "-c", _HARNESS,
                      *_args(workdir, data_dir, *extra)],
                     cwd=ROOT, env=_env(**env), capture_output=True,
                     text=True, timeout=TIMEOUT_S)
  return r, r.stdout + r.stderr


def _metrics(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(l) for l in f if l.strip()]
  for r in rows:
    r.pop("steps_per_sec", None)  # A rate of the wall clock.
  return rows


def _logged_step(workdir):
  return max((r["step"] for r in _metrics(workdir) if "loss" in r), default=0)


def _steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  return sorted(int(s) for s in os.listdir(d) if s.isdigit())


def _state(workdir, step):
  """The train state of a checkpoint as host arrays, whatever processes
  and devices wrote it."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as c:
    state = c.restore(
        os.path.join(workdir, "checkpoints", str(step), "state"),
        args=ocp.args.StandardRestore(fallback_sharding=device))
  return jax.tree.map(np.asarray, state)


def _data_state(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "data",
                         "metadata")) as f:
    return json.load(f)["processes"]


def _assert_trees_equal(a, b, what):
  import jax  # pylint: disable=g-import-not-at-top
  fa = jax.tree_util.tree_flatten_with_path(a)[0]
  fb = jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in fa] == [p for p, _ in fb], what
  for (path, x), (_, y) in zip(fa, fb):
    np.testing.assert_array_equal(x, y, err_msg=f"{what}: {path}")


def _assert_same_run(work, ref, what):
  """``work`` ended exactly as the uninterrupted ``ref``: the final train
  state, every metrics row (train and eval, in order) and the summary's
  metrics, bitwise."""
  assert _steps(work)[-1] == STEPS, (what, _steps(work))
  _assert_trees_equal(_state(work, STEPS), _state(ref, STEPS), what)
  assert _metrics(work) == _metrics(ref), what
  with open(os.path.join(work, "summary.json")) as f:
    got = json.load(f)
  with open(os.path.join(ref, "summary.json")) as f:
    want = json.load(f)
  for k in ("wall_s", "resumed_from", "steps_per_sec"):
    got.pop(k), want.pop(k)
  assert got == want, what


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """The uninterrupted run (through the harness, untouched)."""
  work = tmp_path_factory.mktemp("reference")
  r, out = _run(work, data_dir)
  assert r.returncode == 0, out[-3000:]
  return work


# ------------------------------------------------------------ quick checks


@pytest.mark.parametrize("names,message", [
    (("SIGTERM", "SIGKILL"), "'SIGKILL' cannot be caught"),
    (("SIGINT",), "'SIGINT' is Ctrl-C"),
    (("SIGTERMS",), "'SIGTERMS' is not a signal name"),
    ("SIGTERM", "must be a tuple of signal names"),
])
def test_preemption_signals_are_checked_in_one_line(names, message):
  with pytest.raises(ValueError, match=message) as e:
    preemption.check_signal_names(names)
  assert "\n" not in str(e.value)
  preemption.check_signal_names(("SIGTERM", "SIGUSR1", "SIGUSR2"))
  preemption.check_signal_names(())


def test_triggers_of_one_process_signals_and_clock():
  """A caught signal is recorded, not acted on by the OS (the process
  lives); the clock asks for a save every_minutes after the last one."""
  now = [1000.0]
  preemption.catch(("SIGUSR2",))
  try:
    triggers = preemption.SaveTriggers(every_minutes=2, clock=lambda: now[0],
                                       process_count=1, process_index=0)
    assert triggers.poll(1) == (False, False)
    now[0] += 119
    assert triggers.poll(2) == (False, False)
    now[0] += 1
    assert triggers.poll(3) == (False, True)
    triggers.saved()
    assert triggers.poll(4) == (False, False)
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGUSR2)  # A second one: still alive.
    assert triggers.poll(5) == (True, False)
    assert triggers.agreed_signal() == "SIGUSR2"
    assert triggers.final_agreement() == "SIGUSR2"
    # Every signal since catch() is the run's, however early: triggers
    # made after it see it (the trainer's are made after start-up).
    assert preemption.SaveTriggers(process_count=1, process_index=0).poll(
        1) == (True, False)
    preemption.catch(("SIGUSR2",))  # Again, still installed: the same run.
    assert preemption.first_signal() == "SIGUSR2"
    off = preemption.SaveTriggers(process_count=1, process_index=0,
                                  enabled=False)
    assert off.poll(1) == (False, False) and off.final_agreement() is None
  finally:
    preemption.release()
  assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None)
  # A new run in the same process (released, caught again) does not see
  # the old signals.
  preemption.catch(("SIGUSR2",))
  try:
    assert preemption.first_signal() is None
    assert preemption.SaveTriggers(process_count=1, process_index=0).poll(
        1) == (False, False)
  finally:
    preemption.release()


def test_a_signal_ends_a_wait_for_data():
  """While the main thread waits (for a step's data: a store in an
  outage), a caught signal ends the wait at once (WaitInterrupted), once;
  outside such a wait, or with waits not interrupted, it is only
  recorded."""
  import queue  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  preemption.catch(("SIGUSR2",))
  try:
    never = queue.Queue()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2)).start()
    t0 = time.monotonic()
    with pytest.raises(preemption.WaitInterrupted) as e:
      with preemption.interrupting_waits(True):
        never.get(timeout=20)
    assert time.monotonic() - t0 < 10 and e.value.args == ("SIGUSR2",)
    # A signal that came before the wait ends it on entry.
    with pytest.raises(preemption.WaitInterrupted):
      with preemption.interrupting_waits(True):
        pass
    with preemption.interrupting_waits(False):
      os.kill(os.getpid(), signal.SIGUSR2)  # Recorded only.
    os.kill(os.getpid(), signal.SIGUSR2)
    assert [n for n, _ in preemption._received[-3:]] == ["SIGUSR2"] * 3  # pylint: disable=protected-access
  finally:
    preemption.release()


# -------------------------------------------------------- one process


@pytest.mark.slow
def test_a_signal_at_any_phase_stops_the_run_and_loses_nothing(
    tmp_path, data_dir, reference):
  """SIGTERM at each phase of a run, one run after another in one workdir
  (the precompute pass in 4 shards of 32 rows): at the config check
  (before any indexing), during the precompute pass, during the first
  step's compilation, from outside during the training of a resumed run
  and again while its checkpoint is saved. Each run exits 75 with its one
  line and keeps what can be resumed (the shards precomputed, the step
  reached); the workdir is moved between two runs; the last run ends
  exactly as the uninterrupted run. Then a rerun of the finished run with
  another lr trains nothing and leaves config.json as it was. (Indexing
  shards: tests/test_outage.py.)"""
  rows = {"PRECOMPUTE_ROWS": 32}
  work = tmp_path / "w"

  def stopped(*extra, **env):
    r, out = _run(work, data_dir, *extra, **env, **rows)
    assert r.returncode == 75, out[-3000:]
    lines = [l for l in r.stdout.splitlines() if l.startswith(
        "[lit] preempted")]
    assert len(lines) == 1, out[-3000:]
    for bad in ("Traceback", "error:"):
      assert bad not in out, out[-3000:]
    return lines[0], out

  line, _ = stopped(SIGNAL_PHASE="start")
  assert line == "[lit] preempted before step 1 (starting); rerun to resume"
  assert _steps(work) == [] and not os.path.exists(work / "image_embeddings")

  line, _ = stopped(SIGNAL_PHASE="precompute")
  assert line == ("[lit] preempted before step 1 (precomputing the image "
                  "embeddings; 1 of this process's 4 shard(s) written, kept "
                  "for the rerun); rerun to resume")
  assert sorted(f for f in os.listdir(work / "image_embeddings")
                if f.endswith(".json")) == ["meta.json", "shard-00000.json"]
  assert _steps(work) == []

  line, out = stopped(SIGNAL_PHASE="compile")
  assert "1 shard(s) of this process already complete, skipped" in out
  assert line == "[lit] preempted at step 1; checkpoint saved; rerun to resume"
  assert _steps(work) == [1]

  # Moved: the embeddings' directory is not where the checkpoint saw it.
  moved = tmp_path / "moved"
  os.rename(work, moved)
  work = moved
  # SIGTERM from outside once step 2 is logged, and again while the
  # checkpoint of the step reached is being saved.
  proc = subprocess.Popen(
      [sys.executable, "-c", _HARNESS, *_args(work, data_dir)], cwd=ROOT,
      env=_env(STEP_SLEEP=0.4, SLOW_COMMIT="SIGTERM", **rows),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  t0 = time.time()
  while _logged_step(work) < 2 and proc.poll() is None:
    assert time.time() - t0 < TIMEOUT_S, "training did not reach step 2"
    time.sleep(0.02)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=TIMEOUT_S)
  assert proc.returncode == preemption.EXIT_PREEMPTED == 75, out[-3000:]
  assert "resumed from the checkpoint of step 1" in out
  lines = [l for l in out.splitlines() if l.startswith("[lit] preempted")]
  assert len(lines) == 1, out[-3000:]
  step = int(lines[0].split("step ")[1].split(";")[0])
  assert lines[0] == (f"[lit] preempted at step {step}; checkpoint saved; "
                      "rerun to resume")
  assert 2 <= step < STEPS, out[-3000:]
  # The checkpoint of that very step, complete, with the data state of it.
  assert _steps(work)[-1] == step and not [
      d for d in os.listdir(work / "checkpoints") if not d.isdigit()]
  assert _data_state(work, step)[0]["next_position"] == 16 * step
  if step in _steps(reference):  # The uninterrupted run's, bitwise.
    _assert_trees_equal(_state(work, step), _state(reference, step),
                        f"checkpoint of step {step}")

  r, out = _run(work, data_dir, **rows)
  assert r.returncode == 0, out[-3000:]
  assert f"resumed from the checkpoint of step {step}" in out
  _assert_same_run(work, reference, "a signal at every phase")
  log = (work / "train.log").read_text()
  assert log.count("# run started") == 5
  assert log.count("[lit] preempted") == 4 and "[lit] done" in log

  recorded = (work / "config.json").read_bytes()
  r, out = _run(work, data_dir, "--config.optim.lr=0.001", **rows)
  assert r.returncode == 0, out[-3000:]
  assert "nothing to train" in r.stdout and "resuming" not in out
  assert ("config keys changed since the run in " in r.stdout
          and "are not used (nothing trains): optim.lr (0.002 -> 0.001)"
          in r.stdout), r.stdout[-2000:]
  assert (work / "config.json").read_bytes() == recorded


@pytest.mark.slow
@pytest.mark.parametrize("second", ["SIGKILL"])
def test_a_signal_during_the_preemption_save(tmp_path, data_dir, reference,
                                              second):
  """SIGTERM at step 5, and a second signal while its checkpoint waits to
  be finalized: a second SIGTERM changes nothing (step 5 is saved, exit
  75: test_a_signal_at_any_phase_stops_the_run_and_loses_nothing);
  SIGKILL loses the checkpoint in flight but not the one before it.
  Either way the rerun ends exactly as the uninterrupted run."""
  work = tmp_path / "w"
  r, out = _run(work, data_dir, SIGNAL_AT=5, SLOW_COMMIT=second)
  if second == "SIGTERM":
    assert r.returncode == 75, out[-3000:]
    assert "[lit] preempted at step 5; checkpoint saved; rerun to resume" in (
        r.stdout), out[-3000:]
    assert sorted(os.listdir(work / "checkpoints")) == ["4", "5"]
  else:
    assert r.returncode == -signal.SIGKILL, out[-3000:]
    left = sorted(os.listdir(work / "checkpoints"))
    # The checkpoint of step 5 never reached its atomic rename.
    assert left[:2] == ["2", "4"] and all(
        d.startswith("5.") for d in left[2:]), left
    _state(work, 4)  # The previous checkpoint restores.
  for bad in ("Traceback", "Fatal Python error"):
    assert bad not in out, out[-3000:]
  r, out = _run(work, data_dir)
  assert r.returncode == 0, out[-3000:]
  resumed = 5 if second == "SIGTERM" else 4
  assert f"resumed from the checkpoint of step {resumed}" in out
  _assert_same_run(work, reference, f"second signal {second}")


@pytest.mark.slow
def test_every_minutes_saves_on_the_clock(tmp_path, data_dir):
  """checkpoint.every_minutes=1 with steps-based saves off, on a clock that
  advances 25 s per logged step: a save at the first step done 60 s or
  more after the last save (steps 3 and 6), and the final one."""
  from tests import helpers  # pylint: disable=g-import-not-at-top
  from train import train as train_lib  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  from configs import lit_demo  # pylint: disable=g-import-not-at-top
  config = helpers.set_overrides(lit_demo.get_config("tiny"), {
      "data.data_dir": str(data_dir), "checkpoint.every_steps": 0,
      "checkpoint.keep": 10, "checkpoint.every_minutes": 1.0,
      "progress_bar": False, "eval.every_steps": 0})
  logged = [0]

  def on_metrics(step, row):
    if "loss" in row:
      logged[0] = step

  train_lib.train_and_evaluate(config, str(tmp_path / "w"),
                               on_metrics=on_metrics,
                               clock=lambda: 25.0 * logged[0])
  # Step s is done at 25 s; the clock restarts at each save.
  assert _steps(tmp_path / "w") == [3, 6, 8]


# ---------------------------------------------------- several processes


def _launch(workdir, data_dir, n, *extra, signal_to=None, after_step=3,
            sig=signal.SIGTERM, **env):
  """``n`` processes of the command (4 CPU devices each); with
  ``signal_to``, ``sig`` to that process only, once step ``after_step`` is
  logged; ``env``: the harness's (SIGNAL_PHASE, ...). Returns (exit codes,
  outputs)."""
  port = free_port()
  procs, logs = [], []
  for i in range(n):
    log = open(os.path.join(os.path.dirname(workdir), f"p{i}.log"), "w+")
    logs.append(log)
    procs.append(subprocess.Popen(
        [sys.executable, "-c", _HARNESS, *_args(workdir, data_dir, *extra),
         "--jax_distributed", f"--coordinator_address=localhost:{port}",
         f"--num_processes={n}", f"--process_id={i}"],
        cwd=ROOT, env=_env(devices=4, **{
            "STEP_SLEEP": 0.4 if signal_to is not None else 0, **env}),
        stdout=log, stderr=subprocess.STDOUT))
  t0 = time.time()
  try:
    sent = False
    while any(p.poll() is None for p in procs):
      assert time.time() - t0 < TIMEOUT_S, "the processes hung"
      if signal_to is not None and not sent and (
          _logged_step(workdir) >= after_step):
        procs[signal_to].send_signal(sig)
        sent = True
      if any(p.poll() not in (None, 0, 75) for p in procs):
        break
      time.sleep(0.05)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  outputs = []
  for log in logs:
    log.seek(0)
    outputs.append(log.read())
    log.close()
  return [p.returncode for p in procs], outputs
