"""Benchmark of the LiT train step: step time, loss share, largest batch.

    python benchmarks/bench_train.py --out OUT                       # GPU
    python benchmarks/bench_train.py --quick --out /tmp/bench_train  # CPU smoke

The trainer's own step (``train.step``) with ViT-B/16-size towers (or a
ViT-B/32 or ViT-L/14 image tower: --image_model), softmax loss,
``backend="auto"``, synthetic inputs;
each case in a fresh process (``harness.run_child``: peak memory from zero,
an out-of-memory or timed-out case costs only its row). Cases: ``step``
(image embeddings precomputed, or the locked tower on the fly; the loss
alone timed too, for its share), ``stream`` (the trainer's real input path
from JPEG bytes through decode workers and the streamed tower),
``precompute`` (``train.precompute``: a JPEG shard set embedded once by the
locked tower, img/s), ``stages`` (--stages: the device-alone embedding of
one micro-batch split into its uint8 transfer, resize, normalisation and
tower forward, each timed alone) and the ``max_batch`` ladder (one step
each; stops at the first that does not fit). --microbatch takes several
sizes and "auto" (the trainer's sizing, train/memory.py), --remat the text
blocks' rematerialisation (config.model.text.remat), --loss_dtype the
trainer's config.loss.dtype. A stream case prints the trainer's progress
line every 10 s of a step.
Rows go to bench_train.jsonl as each case ends (--resume runs only what is
missing), bench_train.csv and bench_train.json after each.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # pylint: disable=wrong-import-position

PHASE_TAG = "BENCH_TRAIN_PHASE "
# A stream case's progress lines (train.streamed_tower.StepProgress), echoed
# by the parent into its log as they come.
PROGRESS_TAG = ("[bench_train] step", "[bench_train] micro-batch")
PROGRESS_INTERVAL_S = 10.0
# Where a child is (build, compile, embed, step, stages): an out-of-memory
# row names it.
PHASE = ["build"]

# ViT-B/16-size towers; embed_dim 768.
FULL = dict(embed_dim=768, text_len=16, vocab=32000, text_width=768,
            text_depth=12, text_heads=12, text_mlp=3072, image_size=224,
            vit_patch=16, vit_width=768, vit_depth=12, vit_heads=12,
            vit_mlp=3072, dtype="bfloat16")
# ViT-L/14 image tower (Inf-CL's Table 2 model), the same text tower.
LARGE = dict(FULL, vit_patch=14, vit_width=1024, vit_depth=24, vit_heads=16,
             vit_mlp=4096)
# ViT-B/32 image tower (the smallest CLIP tower, ~4x B/16's rate), the same
# text tower.
B32 = dict(FULL, vit_patch=32)
MODELS = {"b16": FULL, "b32": B32, "l14": LARGE}
QUICK = dict(embed_dim=32, text_len=8, vocab=300, text_width=32, text_depth=1,
             text_heads=2, text_mlp=64, image_size=32, vit_patch=8,
             vit_width=32, vit_depth=1, vit_heads=2, vit_mlp=64,
             dtype="float32")


# ----------------------------------------------------------------- child


def image_tower(m):
  """The locked image tower of model sizes ``m`` (random weights): an own
  ViT, uint8 in (``train.towers.Tower``)."""
  from types import SimpleNamespace as NS  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from train.towers import own  # pylint: disable=g-import-not-at-top
  from train.towers import tower as tower_lib  # pylint: disable=g-import-not-at-top
  dtype = jnp.dtype(m["dtype"])
  img = own.make_module(
      NS(kind="vit", patch_size=m["vit_patch"], width=m["vit_width"],
         depth=m["vit_depth"], num_heads=m["vit_heads"], mlp_dim=m["vit_mlp"]),
      m["embed_dim"], dtype)
  s = m["image_size"]
  return tower_lib.Tower(
      module=img, params=img.init(jax.random.key(2), jnp.zeros(
          (1, s, s, 3)))["params"], image_size=s,
      normalization=tower_lib.SYMMETRIC, embed_dim=m["embed_dim"], dtype=dtype)


def _build(spec):
  """The trainer's step for ``spec`` plus functions making random inputs."""
  from types import SimpleNamespace as NS  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,g-multiple-import
  from train.towers import text as text_lib  # pylint: disable=g-import-not-at-top
  from train import step as step_lib  # pylint: disable=g-import-not-at-top

  from train import streamed_tower  # pylint: disable=g-import-not-at-top

  PHASE[0] = "build"
  m = spec["model"]
  dtype = jnp.dtype(m["dtype"])
  tower = image_tower(m)
  txt = text_lib.from_scratch(
      NS(width=m["text_width"], depth=m["text_depth"],
         num_heads=m["text_heads"], mlp_dim=m["text_mlp"],
         remat=spec.get("remat", "none")),
      m["vocab"], m["text_len"], m["embed_dim"], dtype)
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  s = m["image_size"]
  precomputed = spec["mode"] in ("precomputed", "stream")
  make_step, state, head = harness.lit_steps(
      mesh, tower, txt, spec["batch"], precomputed, spec.get("loss_dtype"))
  steps = {}

  def step_for(mb):
    if mb not in steps:
      steps[mb] = make_step(mb)
    return steps[mb]
  embed = streamed_tower.make_embed(mesh, tower)
  sizing = _size(spec, step_for, state, tower, embed, mesh)
  train_step = step_for(sizing.microbatch)
  # Copies: the train step donates the state's params.
  head_params, img_params = (jax.tree.map(jnp.copy, state["params"][k])
                             for k in ("head", "img"))
  sharded = NamedSharding(mesh, P(step_lib.AXIS))
  b, d = spec["batch"], m["embed_dim"]

  @jax.jit
  def make_batch(key):
    k1, k2, k3 = jax.random.split(key, 3)
    tokens = jax.random.randint(k1, (b, m["text_len"]), 1, m["vocab"])
    lengths = jax.random.randint(k2, (b, 1), 4, m["text_len"] + 1)
    tokens = jnp.where(jnp.arange(m["text_len"])[None] < lengths, tokens, 0)
    batch = {"text": jax.lax.with_sharding_constraint(tokens, sharded)}
    if precomputed:
      emb = jax.random.normal(k3, (b, d), jnp.float32).astype(dtype)
      batch["image_emb"] = jax.lax.with_sharding_constraint(emb, sharded)
    else:
      im = jax.random.randint(k3, (b, s, s, 3), 0, 256).astype(jnp.uint8)
      batch["image"] = jax.lax.with_sharding_constraint(im, sharded)
    return batch

  def loss_only():
    """(fn, args): forward + backward of the loss head alone."""
    hp = head_params
    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.device_put(jax.random.normal(kx, (b, d), jnp.float32).astype(dtype))
    y = jax.device_put(jax.random.normal(ky, (b, d), jnp.float32).astype(dtype))
    fn = jax.jit(jax.value_and_grad(
        lambda hp, x, y: head.apply({"params": hp}, x, y), argnums=(0, 1, 2)))
    return fn, (hp, x, y)

  parts = dict(mesh=mesh, tower=tower, text_len=m["text_len"],
               params_img=img_params, microbatch=sizing.microbatch,
               embed=embed, sizing=sizing)
  return train_step, state, make_batch, loss_only, parts


def _size(spec, step_for, state, tower, embed, mesh):
  """``train.memory.Sizing`` of the case's micro-batch (an int, or "auto":
  the trainer's choice, from XLA's plans of the step and, for a stream
  case, the embedding call and the images in flight)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,g-multiple-import
  from train import memory  # pylint: disable=g-import-not-at-top
  from train import step as step_lib  # pylint: disable=g-import-not-at-top
  m, b, mode = spec["model"], spec["batch"], spec["mode"]
  if spec["microbatch"] != "auto":
    mb = spec["microbatch"]
    return memory.Sizing(mb, None, None, "")
  rows = NamedSharding(mesh, P(step_lib.AXIS))
  shaped = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                     sharding=rows)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  side = spec.get("decode_size") or m["image_size"]
  gpu = spec.get("decoder", "host") != "host"

  def plan_fn(mb):
    PHASE[0] = "compile"
    batch = {"text": shaped((b, m["text_len"]), np.int32)}
    if mode == "stream":
      batch["image_emb"] = shaped((b, tower.embed_dim), np.float32)
    elif mode == "precomputed":
      batch["image_emb"] = shaped((b, tower.embed_dim), m["dtype"])
    else:
      s = m["image_size"]
      batch["image"] = shaped((b, s, s, 3), np.uint8)
    platform = jax.devices()[0].platform
    step_bytes = memory.plan_bytes(step_for(mb).lower(abstract, batch),
                                   platform)
    stream = 0
    if mode == "stream":
      params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=NamedSharding(mesh, P())), tower.params)
      stream = memory.plan_bytes(embed.lower(
          params, shaped((mb, side, side, 3), np.uint8)), platform)
      # In flight (depth 2) and, with the GPU decoder, decoded ahead (2 in
      # its queue, 1 being decoded).
      stream += (2 + (3 if gpu else 0)) * (mb // mesh.size) * side**2 * 3
    return memory.Plan(mb, step_bytes, stream)

  limit, source = memory.device_limit(0, jax.local_devices()[0])
  sizing = memory.size_microbatch(requested="auto", batch=b,
                                  multiple=mesh.size, plan_fn=plan_fn,
                                  limit=limit, source=source)
  print(sizing.line.replace("[lit]", "[bench_train]"), flush=True)
  return sizing


def _sized(out, parts):
  """The row's micro-batch used and its plan when it was sized ("auto")."""
  sizing = parts["sizing"]
  out["microbatch_used"] = sizing.microbatch
  if sizing.plan is not None:
    out["planned_gb"] = sizing.plan.total / 1e9


def _row(spec) -> dict:
  """A case's row: its spec less the model's sizes (the run's summary has
  them)."""
  return {k: v for k, v in spec.items() if k != "model"}


def _peak_gib() -> float:
  peak = harness.device_bytes("peak_bytes_in_use")
  return max(peak) / 2**30 if peak else 0.0  # CPU devices keep no counter.


def _compile(train_step, state, batch, out):
  """The step compiled ahead for ``batch``; tells the parent it compiled (a
  later timeout row then carries the compile time and XLA's memory plan)
  and adds those to ``out``."""
  PHASE[0] = "compile"
  compiled, compile_s = harness.aot(train_step, state, batch)
  phase = dict(compile_s=compile_s, bytes_limit_gb=out.get("bytes_limit_gb"),
               **harness.mem_plan(compiled))
  print(PHASE_TAG + json.dumps(dict(phase, phase="compiled")), flush=True)
  out.update(phase)
  return compiled


def _finish(out, host, t0) -> dict:
  out.update(host_peak_gib=host.peak_gib, total_s=time.perf_counter() - t0,
             status="ok")
  return out


def case_result(spec) -> dict:
  """A child's result: its case's row, or a status row for an exception
  (``harness.failure``: "oom: " with the memory, the phase and the bytes
  asked for, or the error in one line)."""
  try:
    return {"stream": stream_child, "precompute": precompute_child,
            "stages": stages_child}.get(spec["mode"], child)(spec)
  except Exception as e:  # pylint: disable=broad-except
    traceback.print_exc()
    return dict(_row(spec), status=harness.failure(e, PHASE[0]))


def child(spec) -> dict:
  """A step or max_batch case (see the module doc)."""
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  host = harness.HostMemory().__enter__()
  train_step, state, make_batch, loss_only, parts = _build(spec)
  out = dict(_row(spec), **harness.device_meta())
  _sized(out, parts)
  # Two batches alternate in the step cases; one in the ladder (one step; 4M
  # bf16 embeddings are 6 GiB) and for raw 224 px images (19 GiB at 64k).
  batches = [make_batch(jax.random.key(i))
             for i in range(2 if spec["kind"] == "step"
                            and spec["mode"] == "precomputed" else 1)]
  jax.block_until_ready(batches)
  compiled = _compile(train_step, state, batches[0], out)
  holder = {"state": state, "loss": None}

  def one_step(i=[0]):  # pylint: disable=dangerous-default-value
    holder["state"], metrics = compiled(holder["state"],
                                        batches[i[0] % len(batches)])
    i[0] += 1
    holder["loss"] = metrics["loss"]
    return holder["loss"]

  PHASE[0] = "step"
  t = harness.timeit(one_step, reps=spec["reps"],
                     warmup=spec.get("warmup", 1))
  out["step_s"], out["step_min_s"], out["step_max_s"] = t.median, t.min, t.max
  out["loss_value"] = float(holder["loss"])
  out["peak_gib"] = _peak_gib()
  if spec.get("measure_loss"):
    fn, args = loss_only()
    out["loss_s"] = harness.timeit(fn, *args, reps=spec["reps"],
                                   warmup=1).median
    out["loss_share"] = out["loss_s"] / out["step_s"]
  host.__exit__()
  return _finish(out, host, t0)


def default_workers() -> int:
  """Decode workers of the stream cases: the cores less 4 for the main
  process (the hand-over from the workers, the transfers, JAX's threads)."""
  return max(1, len(os.sched_getaffinity(0)) - 4)


def input_config(spec):
  """The input path's config of a stream or precompute case: config.data
  and config.tokenizer, checked (a decoder that cannot run here is a
  one-line error before the towers are built)."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  from train.data import config as data_config  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict()
  config.data = data_config.default_data_config()
  config.tokenizer = data_config.default_tokenizer_config()
  config.tokenizer.max_len = spec["model"]["text_len"]
  config.data.image_size = spec["model"]["image_size"]
  config.data.decode_size = spec["decode_size"]
  # Worker processes (threads alone stop scaling at ~4 cores: bench_data),
  # leaving 4 cores to this process (train/data/config.py num_workers).
  config.data.num_workers = spec.get("workers") or default_workers()
  config.data.num_threads = 1
  # With decoder="gpu" the workers still read the bytes, check each JPEG's
  # markers and tokenize (the device decodes: train/data/decode/gpu.py).
  # --gpu_host_threads N does that in N threads of this process instead,
  # where they share the GIL with the decoder and the tower (bench_data.py
  # --bytes_only on 2 VM cores: 12,979 img/s from 1 thread, 6,032 from 4,
  # 14,430 from 2 workers).
  config.data.decoder = spec.get("decoder", "host")
  for key, value in spec.get("gpu_settings", {}).items():
    config.data["gpu_decoder_" + key] = value
  if config.data.decoder == "gpu" and spec.get("gpu_host_threads"):
    config.data.num_workers = 0
    config.data.num_threads = spec["gpu_host_threads"]
  config.data.prefetch_batches = 2
  config.data.cache_max_mb = 0
  data_config.check_data_config(config)
  return config


def stream_child(spec) -> dict:
  """A stream case: the step on embeddings streamed from JPEG bytes through
  the trainer's input path (train/streamed_tower.py), the host's time split
  into waiting for the pipeline, device_put and the rest; and the device's
  embedding rate alone."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from train import streamed_tower  # pylint: disable=g-import-not-at-top
  from train.data import pipeline  # pylint: disable=g-import-not-at-top
  from train.data.sources import synthetic  # pylint: disable=g-import-not-at-top
  config = input_config(spec)
  t0 = time.perf_counter()
  host = harness.HostMemory().__enter__()
  train_step, state, _, _, parts = _build(spec)
  out = dict(_row(spec), **harness.device_meta())
  _sized(out, parts)
  mesh, tower = parts["mesh"], parts["tower"]
  b, mb = spec["batch"], parts["microbatch"]
  jax_params = jax.device_put(parts["params_img"])
  # The trainer's progress line, every PROGRESS_INTERVAL_S of a step.
  progress = streamed_tower.StepProgress(
      lambda line: print(line, flush=True), interval_s=spec.get(
          "progress_interval_s", PROGRESS_INTERVAL_S), tag="[bench_train]")
  streamer = streamed_tower.StreamedImageTower(mesh, tower, jax_params,
                                               depth=2, embed=parts["embed"],
                                               progress=progress)
  steps = spec.get("steps", 1)
  source = synthetic.JpegPool(b * steps + mb, size=spec["jpeg_size"],
                              pool=1024)
  it = pipeline.make_train_iterator(config, batch_size=b, microbatch_size=mb,
                                    seed=0, source=source)
  # Start the workers (one micro-batch, not part of a step): their start-up
  # is not the step's, and they fill their buffers while the step compiles.
  t1 = time.perf_counter()
  next(it)
  out["pipeline_startup_s"] = time.perf_counter() - t1
  waited = [0.0]
  # Where the host's time in a streamed step goes: waiting for the pipeline
  # (Timed below), putting micro-batches on the device (stream.py calls
  # jax.make_array_from_process_local_data per micro-batch, looked up per
  # call), and the rest of step_inputs (dispatch, waiting for the device).
  put_s = [0.0]
  real_put = jax.make_array_from_process_local_data

  def timed_put(*args, **kwargs):
    t = time.perf_counter()
    r = real_put(*args, **kwargs)
    put_s[0] += time.perf_counter() - t
    return r
  jax.make_array_from_process_local_data = timed_put

  class Timed:
    def __next__(self):
      t = time.perf_counter()
      x = next(it)
      waited[0] += time.perf_counter() - t
      return x

  # Compile ahead (abstract inputs), so the step time is the step.
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  abstract = {"image_emb": jax.ShapeDtypeStruct((b, tower.embed_dim),
                                                np.float32, sharding=sh),
              "text": jax.ShapeDtypeStruct((b, parts["text_len"]), np.int32,
                                           sharding=sh)}
  compiled = _compile(train_step, state, abstract, out)
  # The device alone: the embedding rate on a fixed uint8 micro-batch at
  # the host's size (resized on the device when decode_size is set).
  c = pipeline.host_size(config.data)
  x = np.random.default_rng(0).integers(0, 256, (mb, c, c, 3),
                                         dtype=np.uint8)
  PHASE[0] = "embed"
  t = harness.timeit(streamer.embed_microbatch, x,
                     reps=spec.get("embed_reps", 2), warmup=1)
  out["device_embed_img_s"] = mb / t.median
  del x
  timing = getattr(it, "timing", dict)  # the decode thread's stages
  times = []
  PHASE[0] = "step"
  for i in range(steps):
    progress.step_begins(i + 1)
    waited[0], put_s[0] = 0.0, 0.0
    before = timing()
    # Where the main and the decode threads are, sampled (wall time).
    sampler = harness.StackSampler(("MainThread", "decode"))
    with sampler:
      t1 = time.perf_counter()
      inputs = streamer.step_inputs(Timed(), b // mb)
      inputs_s = time.perf_counter() - t1
      # When the device has embedded the last micro-batch: step_inputs
      # returns with up to `depth` of them still in flight, so its own time
      # is not the embedding phase's. A thread waits for it, so the main
      # thread dispatches the step as the trainer does.
      embedded = harness.ReadyAt(inputs["image_emb"], t1)
      state, metrics = compiled(state, inputs)
      progress.step_dispatched(metrics["loss"])
      loss = float(metrics["loss"])
      times.append(time.perf_counter() - t1)
      embed_s = embedded.seconds()
    del inputs
    after = timing()
  host.__exit__()
  # decoder="gpu": the decode thread's seconds in the last step per stage,
  # wall and CPU (train/data/stopwatch.py).
  out["stack_samples"] = sampler.top(16)
  if after:
    out["decode_thread"] = {
        k: {t: round(v[t] - before.get(k, {}).get(t, 0.0), 4) for t in v}
        for k, v in after.items()}
  out["step_s"] = times[-1]
  out["step_all_s"] = times
  out["host_wait_s"] = waited[0]
  out["host_put_s"] = put_s[0]
  out["step_inputs_s"] = inputs_s
  # Dispatch and waiting for the in-flight micro-batches (the device).
  out["device_wait_s"] = inputs_s - waited[0] - put_s[0]
  out["pipeline_img_s"] = b / times[-1]
  # The device's pace: the host keeps up when the embedding phase runs at
  # the rate of the device alone. Waiting in next() is not the measure: the
  # device works on the micro-batches in flight meanwhile.
  out["embed_s"] = embed_s
  out["embed_img_s"] = b / embed_s
  out["embed_share"] = out["embed_img_s"] / out["device_embed_img_s"]
  out["input_bound"] = out["embed_share"] < 0.95
  # The text tower and the loss, after the last image embedding; the step
  # it would take with the embedding at the device-alone rate.
  out["after_embed_s"] = times[-1] - embed_s
  out["device_floor_s"] = b / out["device_embed_img_s"] + out["after_embed_s"]
  out["loss_value"] = loss
  out["peak_gib"] = _peak_gib()
  out["workers"] = config.data.num_workers
  out["host_image_size"] = c
  out["bad_examples"] = it.bad
  out["progress_lines"] = progress.lines
  progress.close()
  it.close()
  return _finish(out, host, t0)


def precompute_child(spec) -> dict:
  """A precompute case: ``train.precompute`` over ``batch`` JPEGs (a
  JpegPool, 256 px) with the locked image tower, embedding ``microbatch``
  images a call, into a scratch directory; img/s over the shards after the
  first (which compiles), and the device's embedding rate alone."""
  import tempfile  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from train import precompute as precompute_lib  # pylint: disable=g-import-not-at-top
  from train import step as step_lib  # pylint: disable=g-import-not-at-top
  from train.data import pipeline  # pylint: disable=g-import-not-at-top
  from train.data.sources import synthetic  # pylint: disable=g-import-not-at-top
  from train.eval import embed as embed_lib  # pylint: disable=g-import-not-at-top
  config = input_config(spec)
  # precompute reads (and with the host decoder decodes) on threads.
  config.data.num_threads = spec.get("workers") or default_workers()
  t0 = time.perf_counter()
  host = harness.HostMemory().__enter__()
  tower = image_tower(spec["model"])
  out = dict(_row(spec), **harness.device_meta())
  n, bs = spec["batch"], spec["microbatch"]
  source = synthetic.JpegPool(n, size=spec["jpeg_size"], pool=1024)
  shards = max(2, spec.get("shards", 4))
  per_shard = -(-n // shards)
  marks = []  # (time, images done) at each shard's end

  def log(line):
    print(line, flush=True)
    if line.startswith("[precompute] decode stages"):
      out["decode_stages"] = line.split(": ", 1)[1]
    if "[precompute] shard" in line:
      marks.append((time.perf_counter(), int(line.split(": ")[1].split()[0])))
  with tempfile.TemporaryDirectory() as d:
    t1 = time.perf_counter()
    precompute_lib.precompute(config, d, tower, source=source,
                              rows_per_shard=per_shard, batch_size=bs, log=log)
    out["precompute_s"] = time.perf_counter() - t1
  done = np.cumsum([k for _, k in marks])
  out["first_shard_s"] = marks[0][0] - t1
  out["precompute_img_s"] = float((done[-1] - done[0])
                                   / (marks[-1][0] - marks[0][0]))
  # The device alone: the embedding call on a fixed uint8 batch.
  mesh = Mesh(np.array(jax.local_devices()), (step_lib.AXIS,))
  embed = embed_lib.make_embed_fn(mesh, tower)
  params = jax.device_put(tower.params, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  c = pipeline.host_size(config.data)
  x = np.random.default_rng(0).integers(0, 256, (bs, c, c, 3), dtype=np.uint8)
  t = harness.timeit(lambda: embed(params, x), reps=spec.get("embed_reps", 2),
                     warmup=1)
  out["device_embed_img_s"] = bs / t.median
  out["embed_share"] = out["precompute_img_s"] / out["device_embed_img_s"]
  out["input_bound"] = bool(out["embed_share"] < 0.95)
  out["workers"] = config.data.num_threads
  out["host_image_size"] = c
  out["peak_gib"] = _peak_gib()
  host.__exit__()
  return _finish(out, host, t0)


def stages_child(spec) -> dict:
  """A stages case: where the device-alone embedding of one streamed
  micro-batch (``microbatch`` uint8 images at decode_size, or at the
  tower's size) goes. Each stage is timed alone, on its own jitted call,
  median of ``reps``: the uint8 host-to-device transfer, the resize to the
  tower's size (``Tower.preprocess``: float32 passes at HIGHEST precision,
  and for comparison at DEFAULT, which is not the trainer's), the
  normalisation and cast, the tower's forward on normalised images; then
  the fused embedding on images already on the device (``Tower.embed``,
  what the step runs once the images are there), from host images (the
  stream rows' "device alone": transfer, then embedding), with 2 in flight
  over 4 micro-batches (the transfer beside the embedding, as the step
  runs), and at the tower's own size (no resize: decode_size 0). The
  transfer is also timed from page-locked host memory (memory_kind
  "pinned_host", where the platform has it): the pipeline's buffers are
  pageable."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,g-multiple-import
  from train import step as step_lib  # pylint: disable=g-import-not-at-top
  from train import streamed_tower  # pylint: disable=g-import-not-at-top
  from train.towers import resize as resize_lib  # pylint: disable=g-import-not-at-top
  PHASE[0] = "stages"
  t0 = time.perf_counter()
  host = harness.HostMemory().__enter__()
  m, mb = spec["model"], spec["microbatch"]
  s = m["image_size"]
  c = spec.get("decode_size") or s
  tower = image_tower(m)
  out = dict(_row(spec), **harness.device_meta())
  mesh = Mesh(np.array(jax.devices()), (step_lib.AXIS,))
  rows = NamedSharding(mesh, P(step_lib.AXIS))
  params = jax.device_put(tower.params, NamedSharding(mesh, P()))
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (mb, c, c, 3), dtype=np.uint8)
  reps = spec.get("reps", 5)

  def rate(name, fn, *args, per=1):
    """Times fn(*args) (``per`` micro-batches a call): img/s and ms."""
    t = harness.timeit(fn, *args, reps=reps, warmup=1).median / per
    out[f"{name}_img_s"] = mb / t
    out[f"{name}_ms"] = 1e3 * t
    return t

  put = lambda: jax.device_put(x, rows)  # noqa: E731
  t = rate("transfer", put)
  out["transfer_gb_s"] = x.nbytes / t / 1e9
  try:  # From page-locked host memory: what pinned buffers would give.
    pinned = jax.block_until_ready(jax.device_put(x, NamedSharding(
        mesh, P(step_lib.AXIS), memory_kind="pinned_host")))
    t = rate("transfer_pinned", lambda: jax.device_put(pinned, rows))
    out["transfer_pinned_gb_s"] = x.nbytes / t / 1e9
    del pinned
  except Exception as e:  # pylint: disable=broad-except
    out["transfer_pinned"] = f"not run: {type(e).__name__}: {str(e)[:100]}"
  xd = jax.block_until_ready(put())
  hp = jax.lax.Precision.HIGHEST
  resize = jax.jit(lambda a: resize_lib.resize_square(a, s, hp))
  resized = jax.block_until_ready(resize(xd))
  if c != s:
    rate("resize", resize, xd)
    rate("resize_default", jax.jit(lambda a: resize_lib.resize_square(
        a, s, jax.lax.Precision.DEFAULT)), xd)
  norm = jax.jit(lambda a: tower.normalization(a, tower.dtype))
  rate("normalise", norm, resized)
  z = jax.block_until_ready(norm(resized))
  del resized
  forward = jax.jit(lambda p, a: tower.module.apply(
      {"params": p}, a).astype(jnp.float32))
  rate("tower", forward, params, z)
  del z
  embed = streamed_tower.make_embed(mesh, tower)
  rate("embed_device", embed, params, xd)
  streamer = streamed_tower.StreamedImageTower(mesh, tower, params, depth=2,
                                               embed=embed)
  rate("embed_host", streamer.embed_microbatch, x)

  def pipelined(k=4):
    """k micro-batches, at most 2 in flight (the streamed step's bound)."""
    outs = []
    for _ in range(k):
      outs.append(streamer.embed_microbatch(x))
      if len(outs) > 2:
        outs[-3].block_until_ready()
    return outs
  rate("embed_pipelined", pipelined, per=4)
  if c != s:
    del xd
    at_size = jax.block_until_ready(jax.device_put(
        rng.integers(0, 256, (mb, s, s, 3), dtype=np.uint8), rows))
    rate("embed_at_size", embed, params, at_size)
  out["host_image_size"] = c
  out["peak_gib"] = _peak_gib()
  host.__exit__()
  return _finish(out, host, t0)


# The stage fields of a stages row, in the order of the printed line.
STAGES = ("transfer", "transfer_pinned", "resize", "resize_default",
          "normalise", "tower", "embed_device", "embed_host",
          "embed_pipelined", "embed_at_size")


# ----------------------------------------------------------------- parent

# The CSV's columns (the JSONL rows hold every field).
COLS = ["kind", "mode", "batch", "microbatch", "decoder", "gpu_decoder",
        "status", "step_s", "precompute_img_s",
        "loss_s", "loss_share", "peak_gib", "host_peak_gib", "compile_s",
        "xla_total_gb", "host_wait_s", "host_put_s", "device_wait_s",
        "pipeline_img_s", "device_embed_img_s", "embed_img_s", "embed_share",
        "input_bound", "device_floor_s", "workers",
        "decode_size", "image_model", "remat", "loss_dtype",
        "microbatch_used", "planned_gb", "xla_plan_gb",
        *(f"{k}_img_s" for k in STAGES), "transfer_gb_s",
        "transfer_pinned_gb_s",
        "loss_value", "device_kind", "n_devices", "jax", "date"]
# A case's identity, for --resume.
KEY = ("kind", "mode", "batch", "microbatch", "decoder", "gpu_decoder",
       "decode_size", "workers", "gpu_host_threads", "steps", "image_model",
       "remat", "loss_dtype")


def kept(status: str) -> bool:
  """What a resumed run keeps: measured rows and the batches that do not
  fit ("oom: ..."); a timeout, a crash or a skipped case runs again."""
  return status == "ok" or status.startswith("oom")
# The least time a case starts with (a child's start and compilation).
MIN_CASE_S = 60


def run_case(spec, budget, timeout_s) -> dict:
  """One case in a fresh process under its deadline (``timeout_s``, within
  what is left of ``budget``); a skip, a timeout, a crash or an
  out-of-memory end is a status row (``harness.run_child``)."""
  why = budget.skip(MIN_CASE_S)
  if why:
    return dict(_row(spec), status=why)
  timeout_s = int(budget.deadline(timeout_s))
  print(f"[bench_train] {spec['kind']} B={spec['batch']} mode={spec['mode']}"
        f" microbatch={spec['microbatch']} (deadline {timeout_s}s) ...",
        flush=True)
  # Let one case use (nearly) the whole GPU, not JAX's default 75 %.
  env = harness.child_env(XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get(
      "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"))
  t0 = time.time()
  r = harness.run_child([os.path.abspath(__file__), "--case",
                         json.dumps(spec)], timeout_s=timeout_s, env=env,
                        phase_tag=PHASE_TAG, echo_tag=PROGRESS_TAG)
  if r.get("status") == "ok":
    return r
  return dict(_row(spec), total_s=time.time() - t0, **r)


# --gpu_variants: what one stream case with decoder gpu may set, as
# "key=value" words (a variant; variants separated by ";").
_VARIANT_KEYS = ("backend", "option", "cpu_threads", "threads", "read_ahead",
                 "workers")


def gpu_variants(text: str) -> list:
  """--gpu_variants -> one dict per variant: "gpu_decoder" (its words, the
  row's name for it), "gpu_settings" (config.data.gpu_decoder_*) and
  "workers" when it sets them. "" is nvImageCodec's defaults; "option=" may
  repeat ("workers=4 option=:num_cuda_streams=2 cpu_threads=8");
  "threads=N": N nvImageCodec decoders per GPU on their threads;
  "read_ahead=N": N chunks read ahead on a thread of their own. A bad
  variant is a one-line error before any case runs."""
  from train.data.decode import gpu as gpu_decode  # pylint: disable=g-import-not-at-top
  out = []
  for variant in text.split(";"):
    words, settings, extra, options = variant.split(), {}, {}, []
    for w in words:
      key, eq, value = w.partition("=")
      if key not in _VARIANT_KEYS or not eq or not value:
        raise ValueError(f"--gpu_variants: {w!r} in {variant.strip()!r} is "
                         f"not key=value with key one of "
                         f"{', '.join(_VARIANT_KEYS)}")
      if key == "option":
        options.append(value)
      elif key == "backend":
        settings["backend"] = value
      else:
        if not value.isdigit():
          raise ValueError(f"--gpu_variants: {w!r} needs an int")
        (extra if key == "workers" else settings)[key] = int(value)
    if options:
      settings["options"] = " ".join(options)
    gpu_decode.check_settings(settings.get("backend", "auto"),
                              settings.get("options", ""),
                              settings.get("cpu_threads", 0),
                              settings.get("threads", 1))
    out.append(dict(extra, gpu_decoder=" ".join(words) or "default",
                    gpu_settings=settings))
  return out


def microbatches(text) -> list:
  """--microbatch: comma-separated sizes and "auto" (one case each)."""
  out = []
  for w in str(text).split(","):
    w = w.strip()
    if w != "auto" and not w.isdigit():
      raise ValueError(f"--microbatch: {w!r} is not a size or \"auto\"")
    out.append(w if w == "auto" else int(w))
  return out


def _variants(args) -> list:
  """The text tower's settings of a step or stream case: one dict per
  micro-batch x --remat (keys only where not the default, so that earlier
  rows keep their identity for --resume) and --loss_dtype."""
  out = []
  loss_dtype = getattr(args, "loss_dtype", "")
  for mb in microbatches(args.microbatch):
    for remat in getattr(args, "remat", "none").split(","):
      v = dict(microbatch=mb)
      if remat != "none":
        v["remat"] = remat
      if loss_dtype:
        v["loss_dtype"] = loss_dtype
      out.append(v)
  return out


def _capped(v, b):
  """A variant with its micro-batch at most the batch."""
  mb = v["microbatch"]
  return dict(v, microbatch=mb if mb == "auto" else min(mb, b))


def plan(args, model) -> list:
  """The cases of a run: step cases, stream cases, precompute cases, the
  stages case, the max_batch ladder."""
  cases = []
  text = _variants(args)
  first = next((m for m in microbatches(args.microbatch) if m != "auto"),
               8192)
  for b in harness.ints(args.step_batches):
    for mode in args.modes.split(","):
      for v in text:
        cases.append(dict(kind="step", batch=b, mode=mode, measure_loss=True,
                          reps=args.reps, **_capped(v, b)))
  variants = gpu_variants(args.gpu_variants)
  for b in harness.ints(args.stream_batches):
    for decoder in args.decoders.split(","):
      for variant, v in ((x, v) for x in (variants if decoder == "gpu"
                                          else [{}]) for v in text):
        cases.append(dict(dict(
            kind="stream", batch=b, mode="stream", **_capped(v, b),
            measure_loss=False, reps=1,
            steps=args.stream_steps, workers=args.workers,
            **({"gpu_host_threads": args.gpu_host_threads}
               if decoder == "gpu" and args.gpu_host_threads else {}),
            decode_size=args.decode_size, decoder=decoder,
            jpeg_size=args.decode_size or (64 if args.quick else 256),
            embed_reps=1 if args.quick else 2), **variant))
  for n in harness.ints(getattr(args, "precompute_images", "")):
    for decoder in args.decoders.split(","):
      for variant in variants if decoder == "gpu" else [{}]:
        cases.append(dict(dict(
            kind="precompute", batch=n, mode="precompute",
            microbatch=min(first, n), measure_loss=False, reps=1,
            workers=args.workers, decode_size=args.decode_size,
            decoder=decoder,
            jpeg_size=args.decode_size or (64 if args.quick else 256),
            embed_reps=1 if args.quick else 2), **variant))
  if getattr(args, "stages", False):
    # One micro-batch of the stream cases' images through each stage.
    cases.append(dict(kind="stages", batch=first, mode="stages",
                      microbatch=first, decode_size=args.decode_size,
                      measure_loss=False, reps=args.reps))
  for b in harness.ints(args.ladder):
    # One step, compiled ahead: fitting is the result, and a 4M step takes
    # minutes on an H200.
    for v in text[:1]:
      cases.append(dict(kind="max_batch", batch=b, mode="precomputed",
                        measure_loss=False, reps=1, warmup=0,
                        **_capped(v, b)))
  return [dict(c, model=model,
               image_model="quick" if args.quick else args.image_model)
          for c in cases]


def _fmt(v, f="{:.3f}"):
  return "-" if v is None else f.format(v)


def _progress(r):
  print(f"[bench_train]   -> {r['status'][:40]} in {r.get('total_s', 0):.0f}s"
        + (f" step {r['step_s']:.3f}s" if r.get("step_s") else "")
        + (f", loss share {100 * r['loss_share']:.1f}%"
           if r.get("loss_share") is not None else "")
        + (f" ({r['status']})" if r["status"] != "ok" else ""), flush=True)
  if r.get("pipeline_img_s"):
    print(f"[bench_train]   stream ({r.get('decoder', 'host')} decoder"
          + (f" {r['gpu_decoder']}" if r.get("gpu_decoder") else "") + "): "
          f"embedded {r['embed_img_s']:.0f} img/s in the step "
          f"({100 * r['embed_share']:.0f}% of the device alone, "
          f"{r['device_embed_img_s']:.0f}), step {r['step_s']:.2f}s against "
          f"a device floor of {r['device_floor_s']:.2f}s; "
          f"host wait {r['host_wait_s']:.1f}s, device_put "
          f"{r['host_put_s']:.1f}s, device wait {r['device_wait_s']:.1f}s"
          + (" (input-bound)" if r["input_bound"] else "")
          + f", peak GPU {r['peak_gib']:.1f} GiB, host "
          f"{r['host_peak_gib']:.1f} GiB", flush=True)
  if r.get("precompute_img_s"):
    print(f"[bench_train]   precompute ({r.get('decoder', 'host')} decoder"
          + (f" {r['gpu_decoder']}" if r.get("gpu_decoder") else "") + "): "
          f"{r['precompute_img_s']:.0f} img/s after the first shard "
          f"({100 * r['embed_share']:.0f}% of the device alone, "
          f"{r['device_embed_img_s']:.0f}); {r['precompute_s']:.1f} s in all"
          + (f"; decode stages (wall/cpu s) {r['decode_stages']}"
             if r.get("decode_stages") else ""), flush=True)
  if r.get("embed_device_img_s"):
    print(f"[bench_train]   stages ({r['microbatch']} images a call, "
          f"{r['host_image_size']} px): " + ", ".join(
              f"{k} {r[f'{k}_img_s']:,.0f} img/s ({r[f'{k}_ms']:.1f} ms)"
              for k in STAGES if r.get(f"{k}_img_s"))
          + f"; transfer {r['transfer_gb_s']:.1f} GB/s"
          + (f", from pinned memory {r['transfer_pinned_gb_s']:.1f} GB/s"
             if r.get("transfer_pinned_gb_s") else ""), flush=True)
  if r.get("decode_thread"):
    print("[bench_train]   decode thread (wall/cpu s): " + ", ".join(
        f"{k} {v['wall_s']:.2f}/{v['cpu_s']:.2f}"
        for k, v in r["decode_thread"].items()), flush=True)


def main(argv=None):
  ap = harness.parser(__doc__, out=None, resume=True)
  ap.add_argument("--step_batches", default="65536",
                  help="comma-separated global batches for the step cases")
  ap.add_argument("--ladder", default="262144,1048576,4194304",
                  help="comma-separated global batches for the largest-batch "
                  "search")
  ap.add_argument("--microbatch", default="8192",
                  help="GradCache micro-batch: comma-separated sizes, one "
                  "step or stream case each; \"auto\": the trainer's "
                  "sizing from XLA's plan (train/memory.py)")
  ap.add_argument("--remat", default="none",
                  help="comma-separated text-block remat policies of the "
                  "step and stream cases (config.model.text.remat: none, "
                  "block, dots), one case each")
  ap.add_argument("--loss_dtype", default="",
                  help="config.loss.dtype of the step and stream cases ('': "
                  "the embeddings' promoted dtype: float32 for streamed "
                  "image embeddings)")
  ap.add_argument("--stages", action="store_true",
                  help="a stages case: one --microbatch of uint8 images at "
                  "--decode_size through the device-alone embedding's "
                  "stages, each timed alone")
  ap.add_argument("--stream_batches", default="",
                  help="comma-separated global batches through the trainer's "
                  "real input path (JPEG bytes decoded on the host's cores, "
                  "uint8 micro-batches, the locked tower per micro-batch)")
  ap.add_argument("--stream_steps", type=int, default=1,
                  help="steps per stream case (the last is reported)")
  ap.add_argument("--gpu_host_threads", type=int, default=0,
                  help="stream cases with decoder gpu: read, check and "
                  "tokenize in this many threads of the training process "
                  "instead of the --workers processes (0 = the workers)")
  ap.add_argument("--workers", type=int, default=0,
                  help="stream cases: decode worker processes (0 = the "
                  "cores less 4)")
  ap.add_argument("--decode_size", type=int, default=256,
                  help="stream cases: config.data.decode_size (the host "
                  "decodes the 256 px JPEGs only, the device resizes; 0 = "
                  "the host resizes to 224)")
  ap.add_argument("--decoders", default="host",
                  help="stream cases: config.data.decoder of each, "
                  "comma-separated (host,gpu)")
  ap.add_argument("--gpu_variants", default="",
                  help="stream cases with decoder gpu: one case per variant, "
                  "';'-separated, each space-separated key=value words of "
                  f"{', '.join(_VARIANT_KEYS)} (config.data.gpu_decoder_*, "
                  "option= repeatable; workers= overrides --workers); '' "
                  "= the defaults")
  ap.add_argument("--precompute_images", default="",
                  help="comma-separated JPEG counts for precompute cases "
                  "(train.precompute over them, --microbatch images a call, "
                  "--workers reader threads, one case per --decoders and "
                  "--gpu_variants)")
  ap.add_argument("--image_model", default="b16", choices=sorted(MODELS),
                  help="the image tower: ViT-B/16, ViT-B/32 or ViT-L/14")
  ap.add_argument("--modes", default="precomputed,image_tower",
                  help="step-case modes: precomputed, image_tower")
  ap.add_argument("--reps", type=int, default=3,
                  help="timed steps of a step case")
  ap.add_argument("--timeout_s", type=int, default=900,
                  help="deadline of one case")
  ap.add_argument("--budget_s", type=int, default=0,
                  help="deadline of the whole run (0 = none): each case gets "
                  "at most what is left of it, and none starts with less "
                  f"than {MIN_CASE_S} s left")
  args = harness.parse_quick(ap, dict(
      step_batches="256", ladder="512,1024", microbatch=64, reps=2,
      decode_size=48), argv)
  if args.case:
    harness.print_result(case_result(json.loads(args.case)))
    return

  model = QUICK if args.quick else MODELS[args.image_model]
  budget = harness.Budget(args.budget_s or None)
  rows = harness.Rows(args.out, "bench_train",
                      key=lambda r: tuple(r.get(k) for k in KEY),
                      resume=args.resume, keep=kept,
                      fields=COLS)

  def summary():
    """The run's JSON after every case, so a cut-off run keeps it."""
    fits = [r["batch"] for r in rows.rows
            if r["kind"] == "max_batch" and r["status"] == "ok"]
    out = dict(date=harness.now(), model=model, microbatch=args.microbatch,
               largest_batch_ok=max(fits) if fits else None,
               results=rows.rows)
    with open(os.path.join(args.out, "bench_train.json"), "w") as f:
      json.dump(out, f, indent=1)
    return out

  for spec in plan(args, model):
    r = rows.earlier(spec)
    if r is None:
      r = rows.add(run_case(spec, budget, args.timeout_s))
      _progress(r)
    out = summary()
    if (spec["kind"] == "max_batch" and r["status"] != "ok"
        and not r["status"].startswith("skipped")):
      break  # Larger batches will not fit either.

  out = summary()
  print()
  print(f"{'kind':<10}{'mode':<13}{'B':>9}{'micro':>7}{'remat':>7}"
        f"{'status':>8}{'step s':>9}{'loss s':>9}{'loss %':>8}{'peak GiB':>10}"
        f"{'host GiB':>10}")
  for r in rows.rows:
    share = r.get("loss_share")
    # "a4096": "auto" chose 4096.
    micro = (f"a{r.get('microbatch_used', '?')}"
             if r["microbatch"] == "auto" else r["microbatch"])
    print(f"{r['kind']:<10}{r['mode']:<13}{r['batch']:>9}{micro:>7}"
          f"{r.get('remat', 'none'):>7}"
          f"{r['status'][:8]:>8}{_fmt(r.get('step_s')):>9}"
          f"{_fmt(r.get('loss_s')):>9}"
          f"{_fmt(None if share is None else 100 * share, '{:.1f}'):>8}"
          f"{_fmt(r.get('peak_gib'), '{:.1f}'):>10}"
          f"{_fmt(r.get('host_peak_gib'), '{:.1f}'):>10}")
  dev = next((r["device_kind"] for r in rows.rows if r.get("device_kind")),
             "?")
  print(f"\nlargest global batch that trains here ({dev}, precomputed image "
        f"embeddings, GradCache micro-batch {args.microbatch}): "
        f"{out['largest_batch_ok']}")
  print(f"results: {rows.csv}")


if __name__ == "__main__":
  main()
