"""The step's memory (train/memory.py) and the progress of long steps.

- ``size_microbatch``: "auto" takes the largest micro-batch that plans at
  most 90% of the memory (from the largest down in steps that double,
  then bisection: a compile each); a set one that cannot fit is one line naming the memory needed,
  the memory there and the micro-batch that fits.
- An out-of-memory error is one line (which memory, the phase, the bytes
  asked for) in the trainer (``phase``) and in a benchmark row (``oom: ``,
  also for a child that died of it), never a bare "oom".
- The text blocks' rematerialisation (config.model.text.remat) keeps the
  params and gives the gradients to float rounding, under GradCache too.
- The trainer: a micro-batch that cannot fit stops it before any data is
  read; "auto" picks one from XLA's plan with the limit injected
  (config.device_memory_gb) and logs it, and a streamed step of several
  micro-batches prints its progress line.
"""
import contextlib
import io
import json
import re
import sys
import time
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from benchmarks import harness
from configs import lit_demo
from infcl_jax import BlockSizes
from infcl_jax.flax import ContrastiveLoss
from train import memory
from train import step as step_lib
from train import streamed_tower
from train import train as train_lib
from train.towers import text as text_lib


def _affine_plans(calls):
  """plan_fn of 1000 + 100 bytes per example, recording its calls."""
  def plan_fn(m):
    calls.append(m)
    return memory.Plan(m, 1000 + 60 * m, 40 * m)
  return plan_fn


def test_auto_takes_the_largest_that_fits_in_few_compiles():
  calls = []
  # 90% of 29,000 bytes: 1000 + 100 m <= 26,100 -> m <= 251: 128 of the
  # multiples of 8 that divide 1024 (8, 16, ..., 1024; at most 512 here).
  s = memory.size_microbatch(requested="auto", batch=1024, multiple=8,
                             plan_fn=_affine_plans(calls), limit=29_000,
                             source="a test", largest=512)
  assert s.microbatch == 128 and s.plan.total == 13_800
  # From the largest down (512, 256, then 64 fits), then bisection (128).
  assert calls == [512, 256, 64, 128], calls
  assert s.line == ("[lit] micro-batch auto: 128 of the batch 1024, planning "
                    "13.8 KB per device (the step 8.68 KB + the image stream "
                    "5.12 KB), of 29 KB there (a test); up to 90% planned")
  # A large device: the largest size, in one compile.
  calls.clear()
  s = memory.size_microbatch(requested="auto", batch=1024, multiple=8,
                             plan_fn=_affine_plans(calls), limit=10**9,
                             source="a test", largest=512)
  assert (s.microbatch, calls) == (512, [512])
  # Unknown memory: the largest, nothing compiled.
  s = memory.size_microbatch(requested="auto", batch=96, multiple=8,
                             plan_fn=_affine_plans(calls), limit=None,
                             source="cpu:0 reports no memory limit")
  assert s.microbatch == 96 and calls == [512]
  assert memory.candidates(96, 8, 8192) == [8, 16, 24, 32, 48, 96]


def test_a_set_microbatch_that_cannot_fit_is_one_line_naming_the_one_that_does():
  calls = []
  with pytest.raises(ValueError) as e:
    memory.size_microbatch(requested=512, batch=1024, multiple=8,
                           plan_fn=_affine_plans(calls), limit=29_000,
                           source="config.device_memory_gb")
  msg = str(e.value)
  assert "\n" not in msg
  assert msg == (
      "config.microbatch_size=512 does not fit the device's memory: it needs "
      "52.2 KB per device (the step 31.7 KB + the image stream 20.5 KB), 29 "
      "KB there (config.device_memory_gb); micro-batch 128 fits (13.8 KB): "
      "set config.microbatch_size=128 or \"auto\"")
  # One that fits is taken as it is (up to the whole limit), and logged.
  s = memory.size_microbatch(requested=256, batch=1024, multiple=8,
                             plan_fn=_affine_plans(calls), limit=29_000,
                             source="x")
  assert s.microbatch == 256 and s.line.startswith("[lit] micro-batch 256: ")
  # 0: the un-chunked step, checked as such.
  with pytest.raises(ValueError, match=r"microbatch_size=0 does not fit .* "
                     r"no smaller micro-batch fits either: set "
                     r"config.model.text.remat=\"block\""):
    memory.size_microbatch(requested=0, batch=1024, multiple=8,
                           plan_fn=_affine_plans(calls), limit=900,
                           source="x")
  with pytest.raises(ValueError, match=r"^config.microbatch_size=\"auto\": no "
                     r"micro-batch fits the device's memory \(90% of 900 B "
                     r"there \(x\)\); the smallest, 8, plans 1.8 KB"):
    memory.size_microbatch(requested="auto", batch=1024, multiple=8,
                           plan_fn=_affine_plans(calls), limit=900,
                           source="x")


class _XlaError(RuntimeError):
  """Stands in for jaxlib's XlaRuntimeError (its text is what counts)."""


def test_out_of_memory_is_one_line_with_memory_phase_and_bytes():
  dev = jax.devices()[0]
  text = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
          "44.85GiB.\nBFC allocator details ...")
  with pytest.raises(memory.OutOfMemory) as e:
    with memory.phase("step", dev, memory.STEP_HINT):
      raise _XlaError(text)
  msg = str(e.value)
  assert isinstance(e.value, MemoryError) and "\n" not in msg
  assert msg == (f"out of device memory of {dev} in the step: 48.2 GB asked "
                 "for; " + memory.STEP_HINT)
  assert isinstance(e.value.__cause__, _XlaError)
  assert memory.oom_line("RESOURCE_EXHAUSTED: Failed to allocate 2048 bytes "
                         "of pinned host memory", "eval") == (
                             "out of host memory in the eval: 2.05 KB asked "
                             "for")
  with pytest.raises(KeyError):  # Anything else passes through.
    with memory.phase("eval"):
      raise KeyError("x")
  # A benchmark row: "oom: " and the same line, never a bare "oom".
  assert harness.failure(_XlaError(text), "compile").startswith(
      f"oom: out of device memory of {dev} in the compile: 48.2 GB asked for")
  assert harness.failure(ValueError("x")) == "error: ValueError: x"


def test_a_child_that_dies_of_memory_or_runs_long_says_so(capsys):
  # Died of it: the row names the memory and the size from its stderr.
  code = ("import sys; sys.stderr.write('jaxlib.XlaRuntimeError: "
          "RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
          "1.50GiB.\\n'); sys.exit(1)")
  r = harness.run_child(["-c", code], timeout_s=30)
  assert r["status"] == ("oom: out of device memory in the compile: 1.61 GB "
                         "asked for"), r
  # Ran past its deadline after compiling: its progress lines were echoed
  # as they came, and the status ends with the last.
  code = ("import json, time; print('PHASE ' + json.dumps({'compile_s': 1}),"
          " flush=True); print('[x] step 1, 10 s in: 3/8 micro-batches "
          "embedded', flush=True); print('other', flush=True); "
          "time.sleep(30)")
  r = harness.run_child(["-c", code], timeout_s=3, phase_tag="PHASE ",
                        echo_tag="[x] step")
  assert r["status"].startswith("timeout>3s while running (compiled in 1s)")
  assert r["status"].endswith("; last progress: [x] step 1, 10 s in: 3/8 "
                              "micro-batches embedded"), r
  out = capsys.readouterr().out
  assert "[x] step 1, 10 s in" in out and "other" not in out


def test_remat_keeps_the_params_and_the_gradients_to_rounding():
  tokens = np.random.default_rng(0).integers(2, 30, (16, 12)).astype(np.int32)
  tokens[:, 9:] = 0
  tokens[:, 8] = 1
  # Mean pooling (lengths) and CLIP's EOS pooling (causal, one query in
  # the last block), each against one policy.
  for pool, remat in (("mean", "block"), ("eos", "dots")):
    kw = dict(vocab_size=30, max_len=12, width=16, depth=2, num_heads=2,
              mlp_dim=32, embed_dim=8, pool=pool)
    ref = text_lib.TextTransformer(**kw)
    params = jax.jit(ref.init)(jax.random.key(1), tokens)["params"]

    def grads(module):
      return jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(
          module.apply({"params": p}, tokens)))))(params)
    module = text_lib.TextTransformer(**kw, remat=remat)
    got_params = jax.jit(module.init)(jax.random.key(1), tokens)["params"]
    assert jax.tree.all(jax.tree.map(np.array_equal, got_params, params))
    for a, b in zip(jax.tree.leaves(grads(module)),
                    jax.tree.leaves(grads(ref))):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="remat must be one of none, block, "
                     "dots, got 'all'"):
    text_lib.TextTransformer(**kw, remat="all").init(jax.random.key(0),
                                                      tokens)


def test_remat_under_gradcache_gives_the_plain_step():
  b, d = 32, 16
  rng = np.random.default_rng(1)
  batch = {"image_emb": rng.standard_normal((b, d)).astype(np.float32),
           "text": rng.integers(1, 50, (b, 8)).astype(np.int32)}
  batch["text"][:, 6:] = 0
  head = ContrastiveLoss(loss="softmax", backend="xla",
                         block_sizes=BlockSizes(8, 16))
  mesh = Mesh(np.array(jax.devices()[:1]), (step_lib.AXIS,))
  out = []
  for remat, mb in (("none", 0), ("block", 8)):
    txt = text_lib.from_scratch(NS(width=16, depth=2, num_heads=2, mlp_dim=32,
                                   remat=remat), 50, 8, d, jnp.float32)
    k = jax.random.split(jax.random.key(0), 2)
    e = jnp.zeros((2, d))
    params = {"img": {}, "txt": txt.init(k[0], batch["text"][:1])["params"],
              "head": head.init(k[1], e, e)["params"]}
    grad_fn = jax.jit(step_lib.make_grad_fn(
        mesh=mesh, image_tower=txt, text_tower=txt, head=head,
        microbatch_size=mb, global_batch=b, precomputed=True,
        image_locked=True))
    out.append(grad_fn(params, batch))
  (l0, g0), (loss, g) = out
  np.testing.assert_allclose(loss, l0, rtol=1e-6)
  for a, c in zip(jax.tree.leaves(g["txt"]), jax.tree.leaves(g0["txt"])):
    np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------- trainer


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def _streamed(data_dir, **overrides):
  """The demo's tiny run, streamed (the locked tower per micro-batch)."""
  c = lit_demo.get_config("tiny")
  c.data.data_dir = data_dir
  c.progress_bar = False
  c.precompute_image_embeddings = False
  c.total_steps = 2
  c.eval.every_steps = 0
  c.checkpoint.every_steps = 0
  for k, v in overrides.items():
    setattr(c, k, v)
  return c


def test_a_microbatch_that_cannot_fit_stops_before_any_data_is_read(
    tmp_path, data_dir, monkeypatch):
  def no_data(*a, **k):
    raise AssertionError("the input pipeline was started")
  monkeypatch.setattr(train_lib, "_training_source", no_data)
  monkeypatch.setattr(train_lib.data_lib, "make_train_iterator", no_data)
  config = _streamed(data_dir, microbatch_size=16, device_memory_gb=1e-6)
  with pytest.raises(ValueError) as e:
    train_lib.train_and_evaluate(config, str(tmp_path / "w"))
  assert "\n" not in str(e.value)
  assert re.fullmatch(
      r"config.microbatch_size=16 does not fit the device's memory: it "
      r"needs [\d.]+ [KM]B per device \(XLA's plan of the step\), 1 KB there "
      r"\(config.device_memory_gb\); no smaller micro-batch fits either: "
      r".*", str(e.value)), e.value


def test_auto_microbatch_is_logged_and_a_long_step_reports_progress(
    tmp_path, data_dir, monkeypatch):
  # The limit: what micro-batch 8 plans (1 image a device on the suite's
  # 8 CPU devices), over the margin; "auto" tries 8 and 16 of the batch 32
  # (up to 16 here: the un-chunked step of these tiny towers plans less
  # per device than a streamed one).
  real = memory.size_microbatch

  def sized(**kw):
    kw["limit"] = int(kw["plan_fn"](8).total / memory.MARGIN) + 1
    return real(**kw, largest=16)
  monkeypatch.setattr(memory, "size_microbatch", sized)
  # A step of 4 micro-batches, each 50 ms late: several progress lines.
  monkeypatch.setattr(train_lib, "PROGRESS_INTERVAL_S", 0.02)
  embed = streamed_tower.StreamedImageTower.embed_microbatch

  def slow(self, images):
    time.sleep(0.05)
    return embed(self, images)
  monkeypatch.setattr(streamed_tower.StreamedImageTower, "embed_microbatch",
                      slow)
  config = _streamed(data_dir, microbatch_size="auto", device_memory_gb=1.0,
                     batch_size=32)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    summary = train_lib.train_and_evaluate(config, str(tmp_path / "w"))
  log = out.getvalue()
  assert np.isfinite(summary["loss"])
  assert re.search(r"^\[lit\] micro-batch auto: 8 of the batch 32, planning "
                   r"[\d.]+ [KM]B per device \(the step [\d.]+ [KM]B \+ the "
                   r"image stream [\d.]+ [KM]B\), of [\d.]+ [KM]B there "
                   r"\(config.device_memory_gb\); up to 90% planned$", log,
                   re.M), log
  assert "GradCache micro-batch 8;" in log
  lines = re.findall(r"^\[lit\] step [12], \d+ s in: .*$", log, re.M)
  assert any(re.search(r": [0-4]/4 micro-batches embedded", l)
             for l in lines), log
  with open(tmp_path / "w" / "config.json") as f:
    assert json.load(f)["microbatch_size"] == "auto"
