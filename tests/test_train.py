"""The LiT trainer: GradCache, data parallelism, precomputed embeddings, the
optimizer mask, evaluation, the command line, errors, and kill/resume.

Tiny towers and the demo's ``:tiny`` mode keep this to a few CPU minutes.
tests/conftest.py gives the process (and its subprocesses) 8 CPU devices.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from train.eval import embed as embed_lib
from train.eval import evaluator
from train.towers import own
from train.towers import text as text_lib
from train import optim
from train import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, L, S, D = 32, 8, 16, 16


def _towers(loss="softmax"):
  img = own.make_module(NS(kind="cnn", cnn_features=(4, 8)), D,
                                jnp.float32)
  txt = text_lib.from_scratch(NS(width=16, depth=1, num_heads=2, mlp_dim=32),
                               50, L, D, jnp.float32)
  head = ContrastiveLoss(loss=loss, backend="xla",
                         block_sizes=BlockSizes(8, 16))
  return img, txt, head


def _batch(seed=0, n=B):
  rng = np.random.default_rng(seed)
  images = rng.uniform(-1, 1, (n, S, S, 3)).astype(np.float32)
  tokens = rng.integers(1, 50, (n, L)).astype(np.int32)
  tokens[:, L - 2:] = 0  # Padding.
  return images, tokens


def _params(img, txt, head, images, tokens):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  e = jnp.zeros((2, D))
  return {"img": img.init(k1, images[:1])["params"],
          "txt": txt.init(k2, tokens[:1])["params"],
          "head": head.init(k3, e, e)["params"]}


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), (step_lib.AXIS,))


def _assert_grads_close(got, want, rtol=1e-4):
  """Per tower, max abs error relative to the tower's largest gradient (a
  per-leaf relative check would fail on leaves whose exact gradient is 0,
  such as attention key biases, where only rounding noise remains)."""
  for name in want:
    scale = max(float(np.max(np.abs(v))) for v in jax.tree.leaves(want[name]))
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(got[name]),
                              jax.tree.leaves(want[name])))
    assert err <= rtol * scale + 1e-12, (name, err, scale)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_gradcache_and_data_parallel_grads_equal_the_plain_step(loss):
  """Un-chunked 1-device step == GradCache (4 chunks) == 8 devices (the
  ring) with and without GradCache; the image tower is unlocked here so
  that both towers go through the chunked backward."""
  img, txt, head = _towers(loss)
  images, tokens = _batch()
  params = _params(img, txt, head, images, tokens)
  out = {}
  for n_dev, mb in [(1, 0), (1, 8), (8, 0), (8, 16)]:
    if jax.device_count() < n_dev:
      pytest.skip("needs 8 devices (tests/conftest.py)")
    mesh = _mesh(n_dev)
    fn = step_lib.make_grad_fn(
        mesh=mesh, image_tower=img, text_tower=txt, head=head,
        microbatch_size=mb, global_batch=B, precomputed=False,
        image_locked=False)
    out[(n_dev, mb)] = jax.device_get(jax.jit(fn)(
        params, step_lib.shard_batch(mesh, {"image": images,
                                            "text": tokens})))
  loss0, g0 = out[(1, 0)]
  assert all(np.any(np.asarray(v) != 0) for v in jax.tree.leaves(g0["img"])
             if np.asarray(v).size > 1)
  for key, (l, g) in out.items():
    np.testing.assert_allclose(l, loss0, rtol=1e-5, err_msg=str(key))
    _assert_grads_close(g, g0)


def test_sum_convention_not_mean():
  """Data-parallel grads are the gradient of the global loss: a mean over 8
  devices would be 8x too small and fail the equality above; check it
  explicitly on the head's scalar."""
  img, txt, head = _towers()
  images, tokens = _batch(1)
  params = _params(img, txt, head, images, tokens)
  grads = {}
  for n in (1, 8):
    mesh = _mesh(n)
    fn = step_lib.make_grad_fn(mesh=mesh, image_tower=img, text_tower=txt,
                               head=head, microbatch_size=0, global_batch=B,
                               precomputed=False, image_locked=True)
    grads[n] = jax.jit(fn)(params, step_lib.shard_batch(
        mesh, {"image": images, "text": tokens}))[1]
  np.testing.assert_allclose(grads[8]["head"]["log_scale"],
                             grads[1]["head"]["log_scale"], rtol=1e-4)
  # The locked tower's gradient is not computed at all.
  assert all(not np.any(np.asarray(v)) for v in jax.tree.leaves(grads[8]["img"]))


def _train(params, optimizer, schedule, batches, *, precomputed, mb, mesh):
  img, txt, head = _towers()
  fn = step_lib.make_grad_fn(mesh=mesh, image_tower=img, text_tower=txt,
                             head=head, microbatch_size=mb, global_batch=B,
                             precomputed=precomputed, image_locked=True)
  train_step = step_lib.make_train_step(grad_fn=fn, head=head,
                                        optimizer=optimizer, schedule=schedule)
  state = step_lib.init_state(mesh, jax.tree.map(jnp.copy, params), optimizer)
  embed = embed_lib.make_embed_fn(mesh, img)
  for images, tokens in batches:
    inputs = {"text": tokens}
    if precomputed:
      # Embedded apart from the step, in batches of 16 (as precomputing
      # does, in batches of its own).
      inputs["image_emb"] = evaluator.embed_all(embed, params["img"], images,
                                                16)
    else:
      inputs["image"] = images
    state, _ = train_step(state, step_lib.shard_batch(mesh, inputs))
  return jax.device_get(state)


def test_precomputed_embeddings_train_like_the_on_the_fly_path():
  img, txt, head = _towers()
  pool_images, pool_tokens = _batch(2, n=48)
  params = _params(img, txt, head, pool_images, pool_tokens)
  rng = np.random.default_rng(3)
  # Batches drawn from a pool of 48 images: images repeat across steps.
  batches = []
  for _ in range(4):
    idx = rng.choice(48, B, replace=False)
    batches.append((pool_images[idx], pool_tokens[idx]))
  schedule = optim.make_schedule(lr=1e-2, total_steps=4, warmup_steps=1)
  optimizer = optim.make_optimizer(name="adamw", schedule=schedule,
                                      weight_decay=1e-2, grad_clip_norm=1.0,
                                      params=params, image_locked=True)
  mesh = _mesh(2)
  on_the_fly = _train(params, optimizer, schedule, batches,
                      precomputed=False, mb=0, mesh=mesh)
  cached = _train(params, optimizer, schedule, batches,
                  precomputed=True, mb=0, mesh=mesh)
  # Embedded in batches of their own, the embeddings differ from
  # the on-the-fly ones by rounding (~1e-6). Attention key biases are not
  # compared: their exact gradient is 0 (a softmax over keys ignores a bias
  # shared by all keys), so only rounding noise drives them, and Adam turns
  # any noise into lr-sized steps.
  flat = jax.tree_util.tree_flatten_with_path(on_the_fly["params"])[0]
  compared = 0
  for (path, a), b in zip(flat, jax.tree.leaves(cached["params"])):
    name = jax.tree_util.keystr(path)
    if "['qkv']['bias']" in name:  # Fused [q, k, v]: leave out k's.
      a, b = np.asarray(a)[::2], np.asarray(b)[::2]
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6, err_msg=name)
    compared += 1
  assert compared >= len(flat) - 2
  # Training moved the text tower; the locked image tower did not move at
  # all, although AdamW's weight decay is on.
  moved = [np.any(a != b) for a, b in zip(
      jax.tree.leaves(params["txt"]), jax.tree.leaves(cached["params"]["txt"]))]
  assert all(moved)
  for a, b in zip(jax.tree.leaves(params["img"]),
                  jax.tree.leaves(cached["params"]["img"])):
    np.testing.assert_array_equal(a, b)


# ------------------------------------------------------- command line


def _cmd(workdir, data_dir, *extra):
  return [sys.executable, "-m", "train.main",
          "--config", os.path.join(ROOT, "configs/lit_demo.py") + ":tiny",
          "--workdir", str(workdir), f"--config.data.data_dir={data_dir}",
          *extra]


def _run(cmd, env_extra=None, **kw):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             **(env_extra or {}))
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("tfds")


@pytest.mark.parametrize("extra,message", [
    (["--config.total_stepz=3"], "total_stepz"),
    (["--config.model.image.init=/nonexistent/tower.npz"],
     "image tower checkpoint not found"),
    (["--config.batch_size=12"], "not divisible by the device count 8"),
    (["--config.data.name=no_such_dataset"], "no_such_dataset"),
])
def test_usage_errors_are_one_clear_line(tmp_path, data_dir, extra, message):
  r = _run(_cmd(tmp_path / "w", data_dir, *extra))
  assert r.returncode == 2, r.stderr[-2000:]
  lines = [l for l in r.stderr.splitlines() if l.startswith("error: ")]
  assert len(lines) == 1 and message in lines[0], r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def _startup_error_cases(tmp):
  (tmp / "a_file").write_text("")
  ro = tmp / "read_only"
  ro.mkdir()
  ro.chmod(0o555)
  cfg = os.path.join(ROOT, "configs/lit_demo.py") + ":tiny"
  cases = {
      "missing config file": (
          ["--config", str(tmp / "nope.py"), "--workdir", str(tmp / "w")],
          f"--config {tmp / 'nope.py'}: no such config file"),
      "misspelled key": (
          ["--config", cfg, "--workdir", str(tmp / "w"),
           "--config.batchsize=8"],
          "--config.batchsize: unknown config key 'batchsize' (did you mean "
          "'batch_size'?)"),
      "misspelled section": (
          ["--config", cfg, "--workdir", str(tmp / "w"),
           "--config.model.imag.kind=vit"],
          "unknown config key 'imag' (did you mean 'image'?)"),
      "workdir is a file": (
          ["--config", cfg, "--workdir", str(tmp / "a_file")],
          f"workdir {tmp / 'a_file'} is an existing file, not a directory"),
      "workdir cannot be created": (
          ["--config", cfg, "--workdir", str(tmp / "a_file" / "sub")],
          f"workdir {tmp / 'a_file' / 'sub'} cannot be created"),
  }
  if not os.access(ro, os.W_OK):  # root may write there anyway.
    cases["read-only workdir"] = (
        ["--config", cfg, "--workdir", str(ro)],
        f"workdir {ro} is not writable")
  return cases


def test_startup_errors_are_one_line_before_any_work(tmp_path):
  """A missing config file, a misspelled key and a workdir that is not a
  writable directory: one line naming it, exit status 2, at start-up."""
  try:
    for name, (args, message) in _startup_error_cases(tmp_path).items():
      r = _run([sys.executable, "-m", "train.main", *args])
      assert r.returncode == 2, (name, r.stderr[-2000:])
      lines = r.stderr.strip().splitlines()
      assert len(lines) == 1 and lines[0].startswith("error: "), (name, lines)
      assert message in lines[0] and "\\" not in lines[0], (name, lines)
      # Checked before JAX is imported, let alone any work.
      assert not (tmp_path / "w" / "checkpoints").exists(), name
  finally:
    (tmp_path / "read_only").chmod(0o755)


def _final_params(workdir, step=None):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  ckpt_dir = os.path.join(workdir, "checkpoints")
  steps = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
  with ocp.PyTreeCheckpointer() as c:
    state = c.restore(os.path.join(ckpt_dir, str(steps[-1] if step is None
                                                 else step), "state"))
  return steps, state


def _assert_states_equal(state, want, what):
  flat_ref = jax.tree_util.tree_flatten_with_path(want)[0]
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  assert [p for p, _ in flat] == [p for p, _ in flat_ref]
  for (path, a), (_, b) in zip(flat, flat_ref):
    np.testing.assert_array_equal(a, b, err_msg=f"{path} ({what})")


def _metrics_step(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    steps = [json.loads(l).get("step", 0) for l in f if l.strip()]
  return max(steps, default=0)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, data_dir):
  """An uninterrupted run of the command (8 steps, checkpoints every 2,
  keep 2): its checkpoints of steps 6 and 8."""
  work = tmp_path_factory.mktemp("ref")
  ref = _run(_cmd(work, data_dir))
  assert ref.returncode == 0, ref.stderr[-3000:]
  assert "zero-shot top-1" in ref.stdout and "chance" in ref.stdout
  with open(work / "summary.json") as f:
    summary = json.load(f)
  assert summary["steps"] == 8 and summary["resumed_from"] == 0
  steps, _ = _final_params(work)
  assert steps == [6, 8], steps  # keep-last-K (K=2).
  return work


def _assert_resumes_to_the_reference(work, data_dir, reference_run, what):
  resumed = _run(_cmd(work, data_dir))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from the checkpoint of step" in resumed.stdout, (
      what, resumed.stdout)
  steps, state = _final_params(work)
  assert steps[-1] == 8
  _, ref_state = _final_params(reference_run)
  _assert_states_equal(state["params"], ref_state["params"], what)
  _assert_states_equal(state["opt_state"], ref_state["opt_state"], what)
  # The metrics log reads like one uninterrupted run.
  with open(work / "metrics.jsonl") as f:
    train_steps = [json.loads(l)["step"] for l in f
                   if "loss" in json.loads(l)]
  assert train_steps == list(range(1, 9))
  return resumed


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bitwise_identical(
    tmp_path, data_dir, reference_run):
  # The command SIGKILLed once it has logged a random step (3..7) and a
  # checkpoint is complete (every 2 steps; they are written asynchronously,
  # so the newest may still be in flight, and is then lost).
  kill_at = random.Random(os.urandom(8)).randint(3, 7)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  work = tmp_path / "killed"
  proc = subprocess.Popen(_cmd(work, data_dir), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

  def complete_checkpoints():
    d = work / "checkpoints"
    return [s for s in os.listdir(d) if s.isdigit()] if d.is_dir() else []

  t0 = time.time()
  while (_metrics_step(work) < kill_at or not complete_checkpoints()) and (
      proc.poll() is None):
    assert time.time() - t0 < 300, "training did not reach the kill step"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, f"finished before the kill at {kill_at}"
  # Every checkpoint left behind restores (orbax commits atomically; a save
  # in flight is lost, never half-written).
  steps_left, _ = _final_params(work)
  assert steps_left and steps_left[-1] < 8, steps_left
  for s in steps_left:
    _final_params(work, s)
  _assert_resumes_to_the_reference(work, data_dir, reference_run,
                                   f"kill at {kill_at}")


# Runs train.main with orbax patched: the checkpoint of step INTERRUPT_AT
# waits 2 s before orbax's atomic finalize (the rename of its temporary
# directory), and SIGINT (Ctrl-C) arrives as soon as its asynchronous save has
# started, i.e. while it is surely in flight. With INTERRUPT_TWICE, a second
# SIGINT follows 1 s later, while the trainer waits for that save (delayed
# 6 s then).
_INTERRUPTED_MAIN = """
import os, signal, threading, time
import orbax.checkpoint as ocp
from orbax.checkpoint._src.checkpointers import async_checkpointer
from absl import app
from train import main
signal.signal(signal.SIGINT, signal.default_int_handler)
at, twice = int(os.environ["INTERRUPT_AT"]), "INTERRUPT_TWICE" in os.environ
save, commit = ocp.CheckpointManager.save, async_checkpointer._on_commit_callback
def slow_commit(tmpdir, *args, **kw):
  if os.path.basename(str(tmpdir.get())).startswith(f"{at}."):
    time.sleep(6 if twice else 2)
  return commit(tmpdir, *args, **kw)
def save_then_interrupt(self, step, *args, **kw):
  out = save(self, step, *args, **kw)
  if step == at:
    if twice:
      threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    os.kill(os.getpid(), signal.SIGINT)
  return out
async_checkpointer._on_commit_callback = slow_commit
ocp.CheckpointManager.save = save_then_interrupt
app.run(main.main, flags_parser=main._parse_flags)
"""


def _run_interrupted(work, data_dir, at, twice=False):
  env = {"INTERRUPT_AT": str(at), **({"INTERRUPT_TWICE": "1"} if twice else {})}
  r = _run([sys.executable, "-c", _INTERRUPTED_MAIN, *_cmd(work, data_dir)[3:]],
           env_extra=env)
  out = r.stdout + r.stderr
  assert r.returncode == 130, out[-3000:]
  assert f"finishing the checkpoint of step {at}" in r.stdout, out[-3000:]
  for bad in ("Traceback", "Fatal Python error", "terminate called"):
    assert bad not in out, out[-3000:]
  return r


@pytest.mark.slow
def test_ctrl_c_during_an_async_save_finishes_it_and_resumes(
    tmp_path, data_dir, reference_run):
  work = tmp_path / "interrupted"
  r = _run_interrupted(work, data_dir, 6)
  assert ("interrupted at step 6; last checkpoint step 6; rerun to resume"
          in r.stdout), r.stdout
  # The checkpoint in flight was finalized (no temporary directory is left)
  # and restores to exactly the uninterrupted run's checkpoint of step 6.
  assert sorted(os.listdir(work / "checkpoints")) == ["4", "6"]
  _, state = _final_params(work)
  _, ref_state = _final_params(reference_run, 6)
  _assert_states_equal(state, ref_state, "checkpoint of step 6")
  _assert_resumes_to_the_reference(work, data_dir, reference_run,
                                   "Ctrl-C at step 6")
  # A rerun of the finished run trains nothing, says how to go on, and
  # leaves the summary (with its train metrics) and the logs as they are.
  with open(work / "summary.json") as f:
    summary = f.read()
  tb_files = sorted(os.listdir(work / "tb"))
  # TensorBoard's scalars reached the disk in both runs (the interrupted one
  # closes its writer too: they are not flushed per row).
  assert len(tb_files) == 2 and all(
      b"loss" in (work / "tb" / f).read_bytes() for f in tb_files), tb_files
  again = _run(_cmd(work, data_dir))
  assert again.returncode == 0, again.stderr[-3000:]
  assert "is already at config.total_steps=8: nothing to train" in again.stdout
  assert "--config.total_steps=N (N > 8)" in again.stdout
  assert "final train loss" in again.stdout and "done:" not in again.stdout
  with open(work / "summary.json") as f:
    assert f.read() == summary
  assert sorted(os.listdir(work / "tb")) == tb_files


@pytest.mark.slow
def test_second_ctrl_c_abandons_the_save_in_flight(tmp_path, data_dir):
  work = tmp_path / "abandoned"
  r = _run_interrupted(work, data_dir, 4, twice=True)
  assert ("interrupted at step 4; last checkpoint step 2; rerun to resume "
          "(the checkpoint of step 4 in flight was abandoned" in r.stdout), (
              r.stdout)
  # Orbax never finalized it: what is left is a temporary directory, which
  # the next run ignores and deletes; the checkpoint of step 2 restores.
  left = sorted(os.listdir(work / "checkpoints"))
  assert left[0] == "2" and len(left) == 2 and left[1].startswith("4."), left
  from train import checkpoint  # pylint: disable=g-import-not-at-top
  ckpt = checkpoint.Checkpointer(str(work / "checkpoints"), every_steps=2,
                                 keep=2)
  try:
    assert ckpt.latest_step() == 2
    assert ckpt.restore_params()["head"]
  finally:
    ckpt.close()
  assert os.listdir(work / "checkpoints") == ["2"]


@pytest.mark.parametrize("name,arg", [("lit_demo", None), ("lit_demo", "tiny"),
                                      ("lit_coco", None), ("lit_coco", "tiny"),
                                      ("lit_b16_large_batch", None)])
def test_configs_load_and_pass_the_key_check(name, arg):
  import importlib.util  # pylint: disable=g-import-not-at-top
  from train import config_base  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(
      f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  config_base.check_config(config)
  if name == "lit_b16_large_batch":
    assert config.batch_size >= 256 * 1024
    assert 0 < config.microbatch_size < config.batch_size
    assert config.precompute_image_embeddings


def test_config_check_names_the_bad_key():
  from train import config_base  # pylint: disable=g-import-not-at-top
  c = config_base.base_config()
  c.optim.warmup_step = 5  # Typo of warmup_steps.
  with pytest.raises(ValueError, match="optim.warmup_step.*did you mean"):
    config_base.check_config(c)
  c = config_base.base_config()
  c.microbatch_size = 100
  with pytest.raises(ValueError, match="microbatch_size=100 must divide"):
    config_base.check_config(c)


@pytest.mark.slow
def test_bench_train_quick_smoke(tmp_path):
  r = _run([sys.executable, os.path.join(ROOT, "benchmarks/bench_train.py"),
            "--quick", "--modes", "precomputed", "--ladder", "", "--reps", "1",
            "--out", str(tmp_path)])
  assert r.returncode == 0, r.stderr[-3000:]
  with open(tmp_path / "bench_train.json") as f:
    out = json.load(f)
  (row,) = out["results"]
  assert row["status"] == "ok", row
  assert row["step_s"] > 0 and 0 < row["loss_s"] and row["loss_share"] > 0
  assert "loss %" in r.stdout


@pytest.mark.slow
def test_bench_train_stream_quick_smoke(tmp_path):
  """The streamed step through the real input path (a decode worker), with
  the host's time split into pipeline wait, device_put and the rest."""
  r = _run([sys.executable, os.path.join(ROOT, "benchmarks/bench_train.py"),
            "--quick", "--step_batches", "", "--ladder", "",
            "--stream_batches", "512", "--microbatch", "128", "--workers", "1",
            "--out", str(tmp_path)])
  assert r.returncode == 0, r.stderr[-3000:]
  with open(tmp_path / "bench_train.json") as f:
    (row,) = json.load(f)["results"]
  assert row["status"] == "ok", row
  parts = row["host_wait_s"] + row["host_put_s"] + row["device_wait_s"]
  assert min(row["host_wait_s"], row["host_put_s"]) > 0
  assert abs(parts - row["step_inputs_s"]) < 1e-9
  assert 0 < row["step_inputs_s"] < row["step_s"]
  # The embedding phase ends after step_inputs returns (micro-batches in
  # flight) and before the step does; the floor is the step at the
  # device-alone rate.
  assert row["step_inputs_s"] <= row["embed_s"] < row["step_s"]
  assert row["embed_img_s"] == pytest.approx(512 / row["embed_s"])
  assert row["embed_share"] == pytest.approx(
      row["embed_img_s"] / row["device_embed_img_s"])
  assert row["input_bound"] == (row["embed_share"] < 0.95)
  assert row["device_floor_s"] == pytest.approx(
      512 / row["device_embed_img_s"] + row["step_s"] - row["embed_s"])
  assert "device_put" in r.stdout and "device floor" in r.stdout


def test_image_tower_loads_from_npz_and_orbax_and_rejects_mismatch(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  img, _, _ = _towers()
  images, _ = _batch(5, n=2)
  trained = img.init(jax.random.key(1), images)["params"]
  fresh = img.init(jax.random.key(2), images)["params"]
  own.save_npz(str(tmp_path / "tower.npz"), trained)
  with ocp.PyTreeCheckpointer() as c:
    c.save(str(tmp_path / "tower_orbax"), trained)
  for path in ("tower.npz", "tower_orbax"):
    loaded = own.load_npz(str(tmp_path / path), fresh)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
      np.testing.assert_array_equal(a, b)
  other = own.make_module(NS(kind="cnn", cnn_features=(4, 6)), D,
                                  jnp.float32).init(jax.random.key(0), images)
  with pytest.raises(ValueError, match="shape"):
    own.load_npz(str(tmp_path / "tower.npz"), other["params"])
  with pytest.raises(FileNotFoundError, match="not found"):
    own.load_npz(str(tmp_path / "missing.npz"), fresh)


def test_main_sets_the_ring_xla_flags_before_jax_starts(monkeypatch, capsys):
  """train.main adds infcl_jax.xla_flags' flags to XLA_FLAGS (keeping the
  user's); if JAX has already started it warns in one line and goes on."""
  from infcl_jax import xla_flags  # pylint: disable=g-import-not-at-top
  from train import main  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_experimental_parallel_collective_overlap_limit=3")
  monkeypatch.setattr(xla_flags, "_backends_initialized", lambda: False)
  main._set_xla_flags()  # pylint: disable=protected-access
  assert os.environ["XLA_FLAGS"].split() == [
      "--xla_gpu_experimental_parallel_collective_overlap_limit=3",
      "--xla_gpu_enable_latency_hiding_scheduler=true"]
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(xla_flags, "_backends_initialized", lambda: True)
  main._set_xla_flags()  # pylint: disable=protected-access
  assert os.environ["XLA_FLAGS"] == ""
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("[lit] warning: "), err
