"""LiT training, top to bottom: config -> model -> data -> loop -> summary.

``train_and_evaluate(config, workdir)`` is everything ``train.main`` runs:

1. Check the config (``validate``: unknown keys, sizes, the checkpoint,
   the tokenizer, the data, the devices) before any work; only then is
   the workdir created.
2. ``_build``: the towers and the loss head (the locked image tower
   loaded), the optimizer (locked tower masked out) and the train state,
   the micro-batch sized against the device's memory, the held-out sets,
   the training data.
3. ``_resume`` from the newest checkpoint in ``workdir`` if there is one
   (train state and data iterator state), else start fresh.
4. ``_loop``: micro-batches -> image embeddings (the locked tower per
   micro-batch, or precomputed) -> train step -> metrics
   (progress bar, TensorBoard, metrics.jsonl) -> eval every N steps ->
   checkpoint every M steps; the final checkpoint.
5. ``_summary``: the final eval, and a summary with zero-shot vs chance
   (uniform: 1 / number of classes).

A workdir already at ``config.total_steps`` trains nothing (its summary is
printed; ``reevaluate=True`` evaluates it again). Ctrl-C finishes the
checkpoint in flight and says where to resume (``_stop_after_interrupt``).
A preemption signal (``config.preemption_signals``) saves the step reached
and raises ``preemption.Preempted`` (train/preemption.py); before the first
step it stops the run at the next safe point (``_EarlyStops``). A storage
outage past config.data.remote_outage_s does the same. The workdir
records the run (config.json, command.txt, train.log: train/workdir.py) and
a rerun's config is checked against it first.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging as std_logging
import os
import threading
import time
from typing import Any, Callable

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from train import checkpoint as checkpoint_lib
from train import config_base
from train import data as data_lib
from train import diagnostics
from train import file_keys
from train import memory as memory_lib
from train import metrics as metrics_lib
from train import mesh as mesh_lib
from train import model as model_lib
from train import optim
from train import preemption
from train import precompute as precompute_lib
from train import step as step_lib
from train import streamed_tower
from train import workdir as workdir_lib
from train.data.sources import remote
from train.eval import evaluator as evaluator_lib

# The model's builders, where callers of this module have always found them.
make_head = model_lib.make_head
make_models = model_lib.make_models
make_locked_tower = model_lib.make_locked_tower
init_params = model_lib.init_params

# A step longer than this says how far it got, this often (tests lower it).
PROGRESS_INTERVAL_S = 10.0


# ----------------------------------------------------------------- the run


def train_and_evaluate(config, workdir: str, *,
                       on_metrics: Callable[[int, dict], None] | None = None,
                       reevaluate: bool = False,
                       command: str | None = None,
                       clock: Callable[[], float] = time.monotonic) -> dict:
  """Trains (or resumes) the LiT model of ``config`` in ``workdir``.

  Args:
    config: the run's config (``configs/*.py``).
    workdir: checkpoints, metrics.jsonl, TensorBoard logs and summary.json.
    on_metrics: optional ``on_metrics(step, row)``, called on the main process
      after each row of metrics.jsonl is written (train metrics every
      ``log_every_steps``, ``eval/...`` metrics at each evaluation), e.g. to
      draw a live loss curve. ``load_params(workdir)`` reads the trained
      parameters afterwards.
    reevaluate: when ``workdir`` already holds a run finished at
      ``config.total_steps``, evaluate its final checkpoint again and update
      the eval metrics of summary.json. Without it a finished run is left as
      it is (its summary is printed and returned).
    command: the command line, recorded in ``workdir``/command.txt
      (``train.main`` passes its own).
    clock: monotonic seconds for config.checkpoint.every_minutes (tests
      inject one).

  Returns:
    The final metrics: last train metrics, eval metrics, steps, wall time.

  Raises:
    KeyboardInterrupt: after an interrupt (Ctrl-C), once the checkpoint in
      flight is finished (a second interrupt abandons it) and the line
      "interrupted at step N; last checkpoint step M; rerun to resume" is
      printed.
    preemption.Preempted: after a signal of config.preemption_signals (to
      any process), once the checkpoint of the step reached is saved and
      "[lit] preempted at step N; checkpoint saved; rerun to resume" is
      printed (``train.main`` exits with status 75).
  """
  t_start = time.time()
  given = config  # As given: recorded in config.json and checked against it.
  config = validate(config)
  workdir_lib.check_workdir(workdir)  # Created only for a valid config.
  is_main = jax.process_index() == 0
  # train.log from here on (what was printed before included): a refusal
  # below is in it too.
  if workdir_lib.RunLog.active is not None:
    workdir_lib.RunLog.active.attach(workdir,
                                     process_index=jax.process_index())
  ckpt = checkpoint_lib.Checkpointer(
      checkpoint_dir(config, workdir),
      every_steps=config.checkpoint.every_steps, keep=config.checkpoint.keep)
  latest = ckpt.latest_step()
  finished = latest is not None and latest >= config.total_steps
  # The run's record: its config against the one that made the workdir,
  # then (once its checkpoint has restored into this config's state: a run
  # that cannot resume leaves the record as it was) config.json and the
  # command line. A finished run's rerun trains nothing: its config.json
  # stays (only --reevaluate, which evaluates again, records its config).
  try:
    workdir_lib.check_resume(workdir, given, log=print if is_main else None,
                             finished=finished and not reevaluate)
  except ValueError:
    ckpt.close()
    raise

  def record():
    if is_main:
      workdir_lib.record_run(workdir, given, command,
                             config_too=not finished or reevaluate)

  if finished:
    # Nothing to train, nothing to save: signals take their default action
    # (train.main caught them from its start).
    preemption.release()
    record()
    try:
      return _finished_run(config, workdir, ckpt, latest, reevaluate, is_main)
    finally:
      ckpt.close()

  # The last step done, and what to close however the run ends.
  progress = {"step": latest or 0, "pbar": None, "writer": None}
  # Preemption signals are recorded from here on (train.main catches them
  # from its start, and those count too), and acted on at the safe points
  # before the first step and after each step (_train).
  catching = _catch_signals(config.preemption_signals)
  try:
    stops = _EarlyStops(bool(config.preemption_signals)
                        and preemption.catching(), is_main, latest or 0)
    stops.check("starting")
    return _train(config, workdir, ckpt, on_metrics, is_main, t_start,
                  progress, record, stops, clock=clock)
  except KeyboardInterrupt as e:
    _stop_after_interrupt(ckpt, progress, is_main)
    e.reported = True  # train.main: the message above is printed.
    raise
  finally:
    if catching:
      preemption.release()
    for k in ("step_progress", "pbar", "writer"):
      if progress.get(k) is not None:
        progress[k].close()
    ckpt.close()  # After an error: lets the save in flight finish.


def validate(config):
  """Every check of ``config`` that needs no training work, in the order a
  user thinks of the run: the keys and values, the keys that name files
  (``train.file_keys``: a URL where none is taken is refused; the files of
  URLs are fetched), the image tower checkpoint
  (``train.model.check_checkpoints``: the loader's own message), the
  tokenizer and the data (``train.data.check_data_config``), then the
  devices. One-line ValueError or FileNotFoundError for the first problem.

  Returns:
    ``config`` with the URLs of its file keys replaced by their local
    copies (``config`` itself when it names none): the config to run.
  """
  file_keys.check(config)
  config_base.check_config(config)
  config = file_keys.localized(config)
  model_lib.check_checkpoints(config)
  data_lib.check_data_config(config)
  check_devices(config)
  return config


def check_devices(config) -> None:
  """One-line errors for batch sizes that do not fit the devices."""
  n_dev, n_proc = jax.device_count(), jax.process_count()
  if config.batch_size % n_dev:
    raise ValueError(f"config.batch_size={config.batch_size} is not divisible "
                     f"by the device count {n_dev}")
  if config.batch_size % n_proc:
    raise ValueError(f"config.batch_size={config.batch_size} is not divisible "
                     f"by the process count {n_proc}")
  mb = config.microbatch_size
  if mb != "auto" and 0 < mb < config.batch_size and mb % n_dev:
    raise ValueError(f"config.microbatch_size={mb} is not divisible by the "
                     f"device count {n_dev}")


def checkpoint_dir(config, workdir: str) -> str:
  """config.checkpoint.directory, or <workdir>/checkpoints."""
  return config.checkpoint.directory or os.path.join(workdir, "checkpoints")


def _train(config, workdir, ckpt, on_metrics, is_main, t_start,
           progress, record, stops, clock=time.monotonic) -> dict:
  """The training run of ``train_and_evaluate``: build, resume, loop,
  summary. Keeps ``progress["step"]`` (the last step done, for the interrupt
  message) and hands its progress bar and metric writer to the caller via
  ``progress`` (closed however the run ends). ``record()`` writes the
  workdir's record once the state is built (and restored). ``stops``
  (``_EarlyStops``): the safe points before the first step."""
  run = _build(config, workdir, is_main, stops)
  start_step = _resume(run, ckpt, progress, stops)
  record()
  if is_main:
    print(_run_line(run), flush=True)
  train_metrics = _loop(run, ckpt, start_step, progress, on_metrics, clock)
  return _summary(run, start_step, train_metrics, progress["writer"],
                  t_start)


# ----------------------------------------------------------------- build


@dataclasses.dataclass
class _Run:
  """What ``_build`` makes before the first step, for the loop and the
  summary. ``state`` is the train state, replaced by each step."""
  config: Any
  workdir: str
  is_main: bool
  mesh: Any
  state: dict
  # The locked image tower as the data path sees it, with a host copy of
  # its params (the train step donates the state's), and its embedding
  # call of a streamed step.
  tower: Any
  embed: Callable
  make_step: Callable  # micro-batch -> the jitted train step
  steps: dict  # the steps compiled while sizing, by micro-batch
  microbatch: int  # global; 0 or the batch: not chunked
  evaluator: Any
  source: Any
  train_iter: Any
  precomputed: bool
  grouped: bool

  @property
  def chunked(self) -> bool:
    return 0 < self.microbatch < self.config.batch_size

  @property
  def streamed(self) -> bool:
    """The locked tower embeds each micro-batch as it arrives
    (train/streamed_tower.py): the step sees the (B, D) embeddings, as with
    precomputed ones."""
    return (not self.precomputed and self.chunked
            and self.config.model.image.locked)

  @property
  def device(self):
    return jax.local_devices()[0]

  def evaluate(self) -> dict:
    with memory_lib.phase("eval", self.device, memory_lib.EVAL_HINT):
      return self.evaluator(self.state["params"])


def _build(config, workdir, is_main, stops) -> _Run:
  """The model and its train state, the micro-batch sized against the
  device's memory, the held-out sets, then the training data: what can
  fail fails before the more costly next part (``stops`` is checked after
  the sets and after the data)."""
  mesh = mesh_lib.make_mesh()
  tokenizer = data_lib.make_tokenizer(config)
  image_tower, text_tower, head = make_models(config, tokenizer)
  params = init_params(config, image_tower, text_tower, head, tokenizer)
  optimizer, schedule = optim.from_config(
      config.optim, total_steps=config.total_steps, params=params,
      image_locked=config.model.image.locked)
  state = step_lib.init_state(mesh, params, optimizer)
  del params
  # Images cross the host and the transfer as uint8 and are resized (from
  # config.data.decode_size), normalised and cast on the device
  # (Tower.embed).
  tower = dataclasses.replace(image_tower,
                              params=jax.device_get(state["params"]["img"]))
  precomputed = (config.precompute_image_embeddings or
                 data_lib.sources.kind_of(config.data.name) == "embeddings")
  grouped = config.loss.groups != "none"
  make_step = _step_builder(config, mesh, tower, text_tower, head, optimizer,
                            schedule, precomputed, grouped)
  # Compiled once: the sizing's compile is the streamer's.
  embed = streamed_tower.make_embed(mesh, tower)
  mb, steps = _microbatch(config, mesh, state, tower, embed, make_step,
                          tokenizer, precomputed, grouped, is_main)

  # The held-out sets first: their checks (e.g. a label outside the class
  # names) fail before the embeddings of the training split are computed.
  evaluator = make_evaluator(config, mesh, image_tower, text_tower, tokenizer)
  if is_main:
    print("\n".join(evaluator.describe()), flush=True)
  stops.check("building the model and the held-out sets")

  # Data: each process reads its own shard, as micro-batches.
  with memory_lib.phase("precompute", jax.local_devices()[0],
                        memory_lib.EVAL_HINT):
    source = _training_source(config, workdir, tower, is_main, stops)
  n_proc = jax.process_count()
  chunked = 0 < mb < config.batch_size
  train_iter = data_lib.make_train_iterator(
      config, batch_size=config.batch_size // n_proc,
      microbatch_size=(mb if chunked else config.batch_size) // n_proc,
      process_index=jax.process_index(), process_count=n_proc,
      seed=config.seed, tokenizer=tokenizer, source=source,
      groups=config.loss.groups,
      captions_per_image=config.captions_per_image)
  if is_main:
    print(f"[lit] data: {source.describe()}", flush=True)
  warning = optim.batch_repeat_warning(config.batch_size, len(source),
                                       config.data.split)
  if warning and is_main:
    print(warning, flush=True)
  stops.check("opening the training data")
  return _Run(config=config, workdir=workdir, is_main=is_main, mesh=mesh,
              state=state, tower=tower, embed=embed, make_step=make_step,
              steps=steps, microbatch=mb, evaluator=evaluator,
              source=source, train_iter=train_iter, precomputed=precomputed,
              grouped=grouped)


def _microbatch(config, mesh, state, tower, embed, make_step, tokenizer,
                precomputed, grouped, is_main) -> tuple:
  """(the global micro-batch, {micro-batch: its compiled step}): sized
  against the device's memory from XLA's plan of the compiled step, before
  any data is decoded (train/memory.py), the same on every process."""
  sizing, steps = _size_step(config, mesh, state, tower, embed, make_step,
                             tokenizer, precomputed, grouped)
  if is_main and sizing.line:
    print(sizing.line, flush=True)
  mb = sizing.microbatch
  if config.microbatch_size == "auto" and jax.process_count() > 1:
    # Every process must take the same size: the smallest chosen (it fits
    # wherever a larger one does).
    agreed = int(np.min(multihost_utils.process_allgather(np.int64(mb))))
    if agreed != mb and is_main:
      print(f"[lit] micro-batch auto: {agreed}, the smallest any process "
            "chose", flush=True)
    mb = agreed
  return mb, steps


def _step_builder(config, mesh, tower, text_tower, head, optimizer, schedule,
                  precomputed: bool, grouped: bool):
  """``make_step(microbatch) -> jitted train step`` of the run: GradCache
  over micro-batches of that size (0 or the batch: the un-chunked step);
  streamed (the step sees image embeddings) when the locked tower is
  embedded per micro-batch."""
  def make_step(mb):
    chunked = 0 < mb < config.batch_size
    streamed = not precomputed and chunked and config.model.image.locked
    grad_fn = step_lib.make_grad_fn(
        mesh=mesh, image_tower=tower, text_tower=text_tower, head=head,
        microbatch_size=mb, global_batch=config.batch_size,
        precomputed=precomputed or streamed,
        image_locked=config.model.image.locked, groups=grouped,
        loss_dtype=config.loss.get("dtype") or None)
    # The loss diagnostics re-embed a few pairs of the batch as the step
    # sees them: uint8 images through the tower, or the embeddings.
    embed_sample = diagnostics.make_sample_embedder(
        embed_img=None if (precomputed or streamed) else tower.embed,
        embed_txt=lambda p, t: text_tower.apply({"params": p}, t))
    return step_lib.make_train_step(grad_fn=grad_fn, head=head,
                                    optimizer=optimizer, schedule=schedule,
                                    embed_sample=embed_sample)
  return make_step


def _size_step(config, mesh, state, tower, embed, make_step, tokenizer,
               precomputed: bool, grouped: bool):
  """(``memory.Sizing`` of config.microbatch_size, {micro-batch: its
  compiled train step}): the step compiled for abstract inputs of the
  run's shapes, XLA's plan of it, plus for a streamed step the embedding
  call and the images it holds in flight (train/memory.py)."""
  b, n_dev = config.batch_size, mesh.size
  device = jax.local_devices()[0]
  limit, source = memory_lib.device_limit(config.device_memory_gb, device)
  if config.microbatch_size != "auto" and limit is None:
    mb = config.microbatch_size
    return memory_lib.Sizing(mb if 0 < mb < b else b, None, None, ""), {}
  rows = mesh_lib.rows(mesh)
  shaped = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                     sharding=rows)
  abstract_state = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  side = data_lib.host_size(config.data)
  image_bytes = side * side * 3  # One uint8 image.
  # A batch decoder (config.data.decoder "gpu") holds its decoded
  # micro-batches on the device too: those in its queue and the one it
  # decodes.
  decoded_ahead = (0 if config.data.decoder == "host"
                   else max(1, config.data.prefetch_batches) + 1)
  depth = max(1, config.data.prefetch_batches)
  steps = {}
  # A set micro-batch is compiled as the step will be (its call reuses it);
  # "auto"'s sizes are compiled faster on a GPU (memory.plan_bytes).
  search = config.microbatch_size == "auto"

  def plan_fn(mb):
    chunked = 0 < mb < b
    streamed = not precomputed and chunked and config.model.image.locked
    batch = {"text": shaped((b, tokenizer.max_len), np.int32)}
    if precomputed or streamed:
      batch["image_emb"] = shaped((b, tower.embed_dim), np.float32)
    else:
      batch["image"] = shaped((b, side, side, 3), np.uint8)
    if grouped:
      batch["group"] = shaped((b,), np.int32)
    steps[mb] = make_step(mb)
    with memory_lib.phase("compile", device, memory_lib.STEP_HINT):
      step_bytes = memory_lib.plan_bytes(
          steps[mb].lower(abstract_state, batch), device.platform, search)
    stream_bytes = 0
    if streamed:
      params = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(
              x.shape, x.dtype, sharding=mesh_lib.replicated(mesh)),
          tower.params)
      with memory_lib.phase("compile", device, memory_lib.STEP_HINT):
        stream_bytes = memory_lib.plan_bytes(embed.lower(
            params, shaped((mb, side, side, 3), np.uint8)), device.platform,
            search)
      stream_bytes += (depth + decoded_ahead) * (mb // n_dev) * image_bytes
    elif not precomputed:
      stream_bytes = decoded_ahead * (b // n_dev) * image_bytes
    return memory_lib.Plan(mb if chunked else b, step_bytes, stream_bytes)

  sizing = memory_lib.size_microbatch(
      requested=config.microbatch_size, batch=b, multiple=n_dev,
      plan_fn=plan_fn, limit=limit, source=source)
  return sizing, steps


def _round_up(x, m):
  return -(-x // m) * m


def make_evaluator(config, mesh, image_tower, text_tower, tokenizer):
  """The held-out ``evaluator.Evaluator`` of ``config`` (sets read lazily)."""
  sets = data_lib.eval_sets_of(config)
  return evaluator_lib.Evaluator(
      mesh=mesh, image_tower=image_tower, text_tower=text_tower,
      tokenizer=tokenizer, zeroshot=sets.zeroshot, retrieval=sets.retrieval,
      batch_size=_round_up(config.eval.batch_size, mesh.size),
      zeroshot_skipped=sets.zeroshot_skipped)


def _training_source(config, workdir, tower, is_main, stops=None):
  """The source of config.data; with precompute_image_embeddings, the
  embeddings of it in ``workdir/image_embeddings`` (computed there first,
  once: a resumed run reuses them, a preempted pass is continued).
  ``stops`` (``_EarlyStops``) is asked after each chunk of shards indexed
  and each round of shards precomputed."""
  stops = stops or _EarlyStops(False, is_main)
  # Training needs no labels (zero-shot reads those of the held-out source).
  data = data_lib.without_labels(config.data)
  if (config.precompute_image_embeddings
      and data_lib.sources.kind_of(data.name) != "embeddings"):
    out = os.path.join(workdir, "image_embeddings")
    precompute_lib.precompute(
        config, out, tower,
        source=data_lib.open_source(data, data.split,
                                    between_chunks=stops.indexing),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        log=print if is_main else (lambda *_: None),
        between_rounds=stops.precompute)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("precompute image embeddings")
    with data.unlocked():
      data.name = f"embeddings:{out}"
  source = data_lib.open_source(data, data.split,
                                between_chunks=stops.indexing)
  if data_lib.sources.kind_of(source.spec) == "embeddings":
    source.check_fingerprint(tower.fingerprint, "config.model.image")
  return source


# ----------------------------------------------------------------- resume


def _resume(run: _Run, ckpt, progress: dict, stops) -> int:
  """The step the run starts from: the newest checkpoint's, its train state
  and data iterator state restored, or 0."""
  if ckpt.latest_step() is None:
    return 0
  run.state, data_state = ckpt.restore(run.state)
  run.train_iter.set_state(data_state)
  start_step = int(run.state["step"])
  progress["step"] = start_step
  print(f"[lit] resumed from the checkpoint of step {start_step} in "
        f"{run.workdir}", flush=True)
  stops.check(f"restoring the checkpoint of step {start_step}")
  return start_step


def _run_line(run: _Run) -> str:
  """One line for the log: the devices, the batch, the loss and the image
  tower of the run. With more than one device the loss runs the ring."""
  config, mesh = run.config, run.mesh
  across = "" if mesh.size == 1 else ", ring across devices"
  return (f"[lit] {mesh.size} device(s) ({jax.devices()[0].platform}), "
          f"{jax.process_count()} process(es); global batch "
          f"{config.batch_size}"
          + (f", GradCache micro-batch {run.microbatch}" if run.chunked
             else "")
          + (f" (text blocks remat {config.model.text.remat})"
             if run.chunked and config.model.text.remat != "none" else "")
          + f"; {config.loss.name} loss, backend {config.loss.backend}{across}"
          + (f", groups {config.loss.groups} ({config.loss.group_mode})"
             if run.grouped else "")
          + (f"; {config.captions_per_image} captions per image"
             if config.captions_per_image > 1 else "")
          + f"; image tower {config.model.image.kind}"
          + (" locked" if config.model.image.locked else " trained")
          + (", precomputed embeddings" if run.precomputed else "")
          + (", embedded on the fly per micro-batch" if run.streamed else "")
          + (f"; images resized on the device from {config.data.decode_size}"
             " px" if config.data.decode_size and not run.precomputed
             else ""))


# ----------------------------------------------------------------- the loop


def _loop(run: _Run, ckpt, start_step: int, progress: dict, on_metrics,
          clock) -> dict:
  """Steps ``start_step`` + 1 .. config.total_steps, each: its inputs, the
  train step, its metrics, an evaluation and a checkpoint when due, a stop
  when a signal or an outage asks for one; then the final checkpoint. The
  last train metrics logged."""
  config, is_main = run.config, run.is_main
  train_step = run.steps.get(run.microbatch) or run.make_step(run.microbatch)
  writer = metrics_lib.MetricWriter(run.workdir, start_step, enabled=is_main,
                        on_write=on_metrics)
  pbar = metrics_lib.progress_bar(config, config.total_steps, start_step,
                                  is_main)
  say = pbar.write if pbar is not None else functools.partial(print,
                                                              flush=True)
  # A step that takes long says how far it got, every PROGRESS_INTERVAL_S
  # (from a thread: the host may wait on the device or the input).
  step_progress = streamed_tower.StepProgress(say if is_main else None,
                                              interval_s=PROGRESS_INTERVAL_S)
  progress.update(pbar=pbar, writer=writer, step_progress=step_progress)
  inputs_of = _StepInputs(run, ckpt, progress, step_progress)
  # Preemption signals and the clock of time-based checkpoints, agreed by
  # all processes (train/preemption.py).
  triggers = preemption.SaveTriggers(
      every_minutes=config.checkpoint.every_minutes, clock=clock,
      enabled=bool(config.preemption_signals))
  train_metrics = {}
  t_loop, steps_run = time.time(), 0
  for step in range(start_step + 1, config.total_steps + 1):
    inputs = inputs_of(step)
    with _in_step(run):
      run.state, metrics = train_step(run.state, inputs)
      step_progress.step_dispatched(metrics["loss"])
    del inputs
    progress["step"] = step
    steps_run += 1
    if pbar is not None:
      pbar.update(1)
    if step % config.log_every_steps == 0 or step == config.total_steps:
      train_metrics = _train_metrics(run, metrics, steps_run, t_loop)
      writer.write(step, train_metrics)
      if pbar is not None:
        pbar.set_postfix(loss=f"{train_metrics['loss']:.4f}",
                         temp=f"{train_metrics['temperature']:.4f}")
    if (config.eval.every_steps and step % config.eval.every_steps == 0
        and step < config.total_steps):
      eval_metrics = _evaluate_or_stop(run, ckpt, step, progress)
      writer.write(step, {f"eval/{k}": v for k, v in eval_metrics.items()})
      if is_main:
        say(metrics_lib.eval_line(step, eval_metrics))
    # The step is done (with its logging and evaluation, so that the log
    # of a resumed run reads like one uninterrupted run): save it if a
    # signal (on any process) or the clock asks for it.
    preempted, timed = triggers.poll(step)
    if (preempted or timed or ckpt.should_save(step)
        or step == config.total_steps):
      ckpt.save(step, run.state, run.train_iter.get_state())
      triggers.saved()
    if preempted:
      _stop_for_preemption(ckpt, step, triggers.agreed_signal(), progress,
                           is_main)
    triggers.launch()
  step_progress.close()
  if pbar is not None:
    pbar.close()
    progress["pbar"] = None
  ckpt.save(config.total_steps, run.state, run.train_iter.get_state())
  ckpt.close()  # Waits for the last save.
  # A signal after the last step's check: the final checkpoint is complete;
  # the evaluation is left to the rerun (it evaluates a finished run whose
  # summary is missing).
  name = triggers.final_agreement()
  if name is not None:
    _stop_for_preemption(ckpt, config.total_steps, name, progress, is_main)
  preemption.release()  # During the final evaluation a signal ends the run.
  return train_metrics


def _in_step(run: _Run):
  return memory_lib.phase("step", run.device, memory_lib.STEP_HINT)


class _StepInputs:
  """``(step)`` -> the step's global batch: embedded micro-batch by
  micro-batch when streamed, else the micro-batches put on the devices as
  one batch (in the same device-major order, see train/streamed_tower.py).

  Before each step its inputs: a signal while the main thread waits for
  them (a slow or unreachable store), or a storage outage past
  config.data.remote_outage_s, stops the run with the step reached saved
  (the data state taken before the wait). With several processes only
  where every process can agree on it first (a blocking all-gather per
  step): a remote training source, the one that can wait that long.
  """

  def __init__(self, run: _Run, ckpt, progress: dict, step_progress):
    self.run, self.ckpt, self.progress = run, ckpt, progress
    self.step_progress = step_progress
    self.num_micro = (run.config.batch_size // run.microbatch if run.chunked
                      else 1)
    self.streamer = None
    if run.streamed:
      self.streamer = streamed_tower.StreamedImageTower(
          run.mesh, run.tower,
          jax.device_put(run.tower.params, mesh_lib.replicated(run.mesh)),
          depth=max(1, run.config.data.prefetch_batches), embed=run.embed,
          progress=step_progress)
    self.n_local = len(jax.local_devices())
    n_proc = jax.process_count()
    remote_source = getattr(run.source, "is_remote", False)
    self.agree_per_step = n_proc > 1 and remote_source
    self.stop_before_step = n_proc == 1 or self.agree_per_step
    self.interrupt = self.stop_before_step and preemption.catching()

  def _fetch(self):
    run = self.run
    if self.streamer is not None:
      return self.streamer.step_inputs(run.train_iter, self.num_micro)
    parts = [next(run.train_iter) for _ in range(self.num_micro)]
    key = "image_emb" if run.precomputed else "image"
    return step_lib.shard_batch(run.mesh, {
        k: streamed_tower.device_major([p[k] for p in parts], self.n_local)
        for k in (key, "text") + (("group",) if run.grouped else ())})

  def __call__(self, step: int):
    run = self.run
    before = run.train_iter.get_state() if self.stop_before_step else None
    inputs, signal_name, outage = None, None, None
    # The progress line watches the step's micro-batches from here: a
    # streamed step embeds them while its inputs are fetched.
    self.step_progress.step_begins(step)
    try:
      with _in_step(run), preemption.interrupting_waits(self.interrupt):
        inputs = self._fetch()
    except preemption.WaitInterrupted as e:
      signal_name = e.args[0]
    except remote.Outage as e:
      if not self.stop_before_step:
        raise
      outage = e
    if self.stop_before_step:
      flags = [signal_name is not None, outage is not None]
      if self.agree_per_step:
        flags = preemption.agree(flags)
      if any(flags):
        _stop_before_step(self.ckpt, step - 1, run.state, before,
                          self.progress, run.is_main, signal_name or (
                              "a signal to another process" if flags[0]
                              else "storage outage"), outage, bool(flags[1]))
    return inputs


def _train_metrics(run: _Run, metrics, steps_run: int, t_loop: float) -> dict:
  """The step's metrics as floats, with this process's data counts and the
  rate since the loop started (at ``t_loop``)."""
  with _in_step(run):
    out = {k: float(v) for k, v in jax.device_get(metrics).items()}
  ledger = run.train_iter.ledger
  # This process's skipped examples (its ledger also stops the run past
  # config.data.max_bad_fraction).
  out["data/bad_examples"] = run.train_iter.bad
  out["data/bad_fraction"] = ledger.fraction
  # Transient failures of remote reads retried
  # (train/data/sources/remote.py).
  out["data/retries"] = ledger.retries
  out["steps_per_sec"] = steps_run / (time.time() - t_loop)
  return out


def _evaluate_or_stop(run: _Run, ckpt, step: int, progress: dict) -> dict:
  """The held-out metrics after ``step``; a storage outage (one process)
  saves the step and stops the run."""
  try:
    return run.evaluate()
  except remote.Outage as e:
    if jax.process_count() > 1:
      raise  # Not agreed across processes (train.main: exit 75).
    ckpt.save(step, run.state, run.train_iter.get_state())
    _stop_before_step(ckpt, step, run.state, None, progress, run.is_main,
                      "storage outage", e, True)
    raise  # Not reached: _stop_before_step raises Preempted.


# ----------------------------------------------------------------- summary


def _summary(run: _Run, start_step: int, train_metrics: dict, writer,
             t_start: float) -> dict:
  """The final evaluation and the run's summary (printed, summary.json):
  the last train metrics, the bad examples and retries of every process,
  the held-out metrics."""
  config = run.config
  # The skipped examples and retries of every process.
  ledgers = checkpoint_lib.gather_json(
      {"by_reason": dict(run.train_iter.ledger.by_reason),
       "retries": run.train_iter.ledger.retries})
  by_reason = collections.Counter()
  for ledger in ledgers:
    by_reason.update(ledger["by_reason"])

  eval_metrics = run.evaluate()
  writer.write(config.total_steps, {f"eval/{k}": v
                                    for k, v in eval_metrics.items()})
  summary = {"steps": config.total_steps, "resumed_from": start_step,
             "wall_s": time.time() - t_start, **train_metrics,
             "data/skipped_by_reason": dict(sorted(by_reason.items())),
             "data/retries_all_processes": sum(l["retries"] for l in ledgers),
             **{f"eval/{k}": v for k, v in eval_metrics.items()}}
  if run.is_main:
    metrics_lib.print_summary(summary)
    with open(os.path.join(run.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
  return summary


# ----------------------------------------------------------------- stops


class _EarlyStops:
  """The safe points before the first step (train/preemption.py): a
  preemption signal (to any process) or a storage outage stops the run at
  the next one, all processes at the same one, with what can be resumed
  kept; ``train.main`` exits 75.

  Args:
    enabled: signals are caught (config.preemption_signals).
    is_main: process 0 (says why the run stopped).
    start_step: the step the run starts from.
  """

  def __init__(self, enabled: bool, is_main: bool, start_step: int = 0):
    self.enabled, self.is_main, self.start_step = (enabled, is_main,
                                                   start_step)

  def check(self, phase: str, outage=None, kept: str = "") -> None:
    """Stops the run (``preemption.Preempted``) if a signal came, on any
    process, or if ``outage`` (a ``remote.Outage`` of this process) or
    another process's stopped it; every process calls it at the same
    point."""
    name = preemption.first_signal() if self.enabled else None
    signalled, outaged = preemption.agree([name is not None,
                                           outage is not None])
    if not (signalled or outaged):
      return
    where = (f"before step {self.start_step + 1} ({phase}"
             + (f"; {kept}" if kept else "") + "); rerun to resume")
    if outage is not None:  # Said by the process that met it.
      print(f"[lit] storage outage {where}: {outage}", flush=True)
    elif self.is_main:
      print(f"[lit] storage outage on another process {where}" if outaged
            else f"[lit] preempted {where}", flush=True)
    raise preemption.Preempted(None, name or (
        "storage outage" if outaged else "a signal to another process"))

  def indexing(self, done: int, total: int, outage=None) -> None:
    self.check(f"indexing the training shards, {done} of {total} done",
               outage)

  def precompute(self, done: int, total: int, outage=None) -> None:
    self.check("precomputing the image embeddings", outage,
               kept=f"{done} of this process's {total} shard(s) written, "
               "kept for the rerun")


def _catch_signals(names) -> bool:
  """Records ``names`` instead of their default action while the run
  trains (only the main thread may install signal handlers: elsewhere,
  e.g. a run started from a thread, the signals keep their action)."""
  if not names or threading.current_thread() is not threading.main_thread():
    return False
  preemption.catch(names)
  return True


def _stop_for_preemption(ckpt, step: int, signal_name: str, progress: dict,
                         is_main: bool):
  """Waits for the checkpoint of ``step`` (already started) to be
  finalized, says so, and raises Preempted."""
  if progress["pbar"] is not None:
    progress["pbar"].close()
    progress["pbar"] = None
  ckpt.close()  # Waits for the save: further signals are only recorded.
  if is_main:
    print(f"[lit] preempted at step {step}; checkpoint saved; rerun to "
          "resume", flush=True)
  raise preemption.Preempted(step, signal_name)


def _stop_before_step(ckpt, reached: int, state, data_state, progress: dict,
                      is_main: bool, why: str, outage, outaged: bool):
  """Stops the run before step ``reached`` + 1, whose inputs did not come
  (a signal during the wait, or a storage outage on this or another
  process): saves ``state`` (the train state of step ``reached``) with
  ``data_state`` (the data iterator's state before the wait; None: saved
  already), says why, and raises Preempted."""
  if progress["pbar"] is not None:
    progress["pbar"].close()
    progress["pbar"] = None
  if data_state is not None and reached > 0:
    ckpt.save(reached, state, data_state)
  ckpt.close()  # Waits for the save: further signals are only recorded.
  saved = "checkpoint saved" if reached > 0 else "nothing to save"
  if outage is not None:  # Said by the process that met it.
    print(f"[lit] storage outage at step {reached}: {outage}; {saved}; "
          "rerun to resume", flush=True)
  elif is_main:
    print(f"[lit] storage outage on another process at step {reached}; "
          f"{saved}; rerun to resume" if outaged else
          f"[lit] preempted at step {reached}; {saved}; rerun to resume",
          flush=True)
  raise preemption.Preempted(reached, why)


class _DropInterrupts(std_logging.Filter):
  """Drops log records of an exception that is a KeyboardInterrupt."""

  def filter(self, record):
    return not (record.exc_info and record.exc_info[0] is not None
                and issubclass(record.exc_info[0], KeyboardInterrupt))


def _stop_after_interrupt(ckpt, progress: dict, is_main: bool) -> None:
  """Finishes (or, on a second Ctrl-C, abandons) the checkpoint in flight."""
  if progress["pbar"] is not None:
    progress["pbar"].close()
    progress["pbar"] = None
  in_flight = ckpt.latest_step()
  note = ""
  # A second Ctrl-C interrupts orbax's wait, which logs it with a traceback.
  absl_logger = logging.get_absl_logger()
  quiet = _DropInterrupts()
  absl_logger.addFilter(quiet)
  if is_main:
    print(flush=True)  # After the terminal's "^C".
  try:
    if is_main and in_flight is not None and (
        in_flight not in ckpt.finalized_steps()):
      print(f"[lit] interrupted: finishing the checkpoint of step "
            f"{in_flight} (Ctrl-C again to abandon it)", flush=True)
    # Orbax writes the checkpoint in flight to a temporary directory and
    # renames it into place (atomically) when complete.
    ckpt.close()
  except KeyboardInterrupt:
    pass  # Abandoned (orbax logs the interrupted wait: not shown).
  finally:
    absl_logger.removeFilter(quiet)
  last = max(ckpt.finalized_steps(), default=None)
  if in_flight is not None and in_flight != last:
    note = (f" (the checkpoint of step {in_flight} in flight was abandoned: "
            "an incomplete checkpoint is never restored, and its temporary "
            "directory is deleted on the next run)")
  if is_main:
    print(f"[lit] interrupted at step {progress['step']}; last checkpoint "
          f"step {'none' if last is None else last}; rerun to resume{note}",
          flush=True)


# ----------------------------------------------------------------- finished


def _finished_run(config, workdir, ckpt, latest, reevaluate, is_main) -> dict:
  """A rerun of a finished run: nothing to train; evaluate only if asked (or
  if the run was stopped before its final evaluation wrote summary.json)."""
  path = os.path.join(workdir, "summary.json")
  summary = _read_json(path)
  n = config.total_steps
  if is_main:
    where = ("already at" if latest == n
             else f"at step {latest}, beyond")
    print(f"[lit] {workdir} is {where} config.total_steps={n}: nothing to "
          f"train. To train further, rerun with --config.total_steps=N "
          f"(N > {latest})"
          + ("" if reevaluate else "; to evaluate again, add --reevaluate")
          + ".", flush=True)
  if summary is None or reevaluate:
    mesh = mesh_lib.make_mesh()
    tokenizer = data_lib.make_tokenizer(config)
    image_tower, text_tower, _ = make_models(config, tokenizer)
    params = jax.device_put(ckpt.restore_params(latest),
                            mesh_lib.replicated(mesh))
    evaluator = make_evaluator(config, mesh, image_tower, text_tower,
                               tokenizer)
    if is_main:
      print("\n".join(evaluator.describe()), flush=True)
    with memory_lib.phase("eval", jax.local_devices()[0],
                          memory_lib.EVAL_HINT):
      eval_metrics = evaluator(params)
    if summary is None:  # Stopped after the final checkpoint.
      summary = {"steps": latest, "resumed_from": latest,
                 **_last_train_row(workdir)}
    summary.update({f"eval/{k}": v for k, v in eval_metrics.items()})
    if is_main:
      with open(path, "w") as f:
        json.dump(summary, f, indent=1)
  if is_main:
    print(f"[lit] summary of the finished run ({path}):", flush=True)
    metrics_lib.print_summary(summary, done_line=False)
  return summary


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _last_train_row(workdir: str) -> dict:
  """The last train-metrics row of metrics.jsonl (without "step"), or {}."""
  row = {}
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        r = json.loads(line) if line.strip() else {}
        if "loss" in r:
          row = {k: v for k, v in r.items() if k != "step"}
  except (OSError, ValueError):
    pass
  return row


def load_params(workdir: str, step: int | None = None) -> dict:
  """The parameters ``{"img", "txt", "head"}`` saved in ``workdir``.

  Reads the newest checkpoint (or ``step``'s) without rebuilding the train
  state, as host-side arrays, e.g. to evaluate or inspect a finished run
  with the towers of ``make_models``. Checkpoints kept elsewhere
  (config.checkpoint.directory) are found through the workdir's config.json.
  """
  recorded = _read_json(os.path.join(workdir, workdir_lib.CONFIG_FILE)) or {}
  directory = (recorded.get("checkpoint", {}).get("directory")
               or os.path.join(workdir, "checkpoints"))
  if not checkpoint_lib.is_remote(directory) and not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints in {workdir} (train it first)")
  ckpt = checkpoint_lib.Checkpointer(directory, every_steps=0, keep=1)
  try:
    return ckpt.restore_params(step)
  finally:
    ckpt.close()
