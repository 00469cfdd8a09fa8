"""Which decoder: config.data.decoder -> a batch decoder, or None (host).

    config.data.decoder = "host"   # the reader threads / worker processes
    config.data.decoder = "gpu"    # nvImageCodec (nvJPEG) on the device
    config.data.decoder = "auto"   # what the measured rates say (below)

The two decoders are train/data/decode/host.py (per example, where it is
read) and train/data/decode/gpu.py (per micro-batch, on the device); this
module picks one and checks the settings, and the pipeline
(train/data/pipeline.py, train/data/batching.py) runs it. Neither decoder
imports this module.

"auto" compares three rates per GPU, from BENCHMARKS.md "Data path" on the
16-core H200 machine: what the tower embeds (estimated from an own ViT's
FLOPs per image at the rate the H200 embeds ViT-B/16 in the streamed step;
None for other towers), what the host path decodes (per worker process,
the workers capped at the cores less 4, shared by the process's GPUs) and
what the GPU decoder delivers in the step. The host path is kept when it
keeps pace with the tower (it costs the GPU nothing, while nvImageCodec
takes device time from the tower); otherwise the faster of the two. It
says what it picked, and why, in one line.
"""
from __future__ import annotations

import os

import jax

from train.data import sources
from train.data.decode import gpu as gpu_lib

DECODERS = ("host", "gpu", "auto")
SOURCE_KINDS = ("webdataset", "table")  # the sources that carry bytes

# The measured rates "auto" decides by (BENCHMARKS.md "Data path"; H200
# machine, 16 cores, 256 px JPEGs, decode_size 256):
# - one host worker process, decode only: 10,312 img/s from 12 workers
#   (2026-12-01); without worker processes, 1,687 img/s from 8 threads;
HOST_IMG_S_PER_WORKER = 860
HOST_THREADS_IMG_S = 1687
# - the cores the training process keeps for itself (16 workers on 16 cores
#   were slower than 12);
CORES_KEPT = 4
# - the GPU decoder in the streamed step, per GPU: 5,430-6,486 img/s
#   embedded with ViT-B/16 at 65,536 (2026-12-04, one nvImageCodec decoder
#   per GPU);
GPU_IMG_S = 6000
# - what the H200 embeds, in FLOP/s of an own ViT (2 * MACs per image):
#   ViT-B/16 at 224, 35.0 GFLOP per image, 8,151-8,508 img/s in the
#   streamed step (its transfer and 256 -> 224 resize included).
VIT_FLOP_S = 2.9e14
# The host path keeps pace above this share of the tower's rate.
KEEPS_PACE = 0.95


def gpu_unavailable() -> str:
  """"" when the GPU decoder can run here, else why not (one line)."""
  try:
    # Lazy: the gpu-decode extra, tried only to say whether it is there.
    from nvidia import nvimgcodec  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    return ("the gpu-decode extra is not installed (pip install "
            "'infcl-jax[gpu-decode]': nvidia-nvimgcodec-cu13 and "
            f"nvidia-nvjpeg; {type(e).__name__}: {e})")
  except Exception as e:  # pylint: disable=broad-except
    return f"nvidia.nvimgcodec does not load ({type(e).__name__}: {e})"
  platforms = sorted({d.platform for d in jax.local_devices()})
  if platforms != ["gpu"]:
    return (f"it needs a CUDA GPU, and jax's local devices are "
            f"{'/'.join(platforms)}")
  return ""


def check_decoder(data) -> None:
  """One-line ValueError for a config.data.decoder that cannot run (the
  early config check: "gpu" needs its extra and a GPU; the source's kind
  is checked when it is open, ``make_batch_decoder``)."""
  decoder = data.get("decoder", "host")
  if decoder not in DECODERS:
    raise ValueError(f"config.data.decoder={decoder!r} must be one of "
                     f"{', '.join(DECODERS)}")
  # nvImageCodec's settings are checked whatever the decoder ("auto" may
  # pick the GPU on another machine); this needs no GPU and no extra.
  gpu_lib.check_settings(data.get("gpu_decoder_backend", "auto"),
                         data.get("gpu_decoder_options", ""),
                         data.get("gpu_decoder_cpu_threads", 0),
                         data.get("gpu_decoder_threads", 1))
  ahead = data.get("gpu_decoder_read_ahead", 0)
  if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 0:
    raise ValueError(f"config.data.gpu_decoder_read_ahead={ahead!r} must be "
                     "an int >= 0 (chunks read ahead for the GPU decoder; 0 "
                     "= none)")
  if decoder == "gpu":
    why = gpu_unavailable()
    if why:
      raise ValueError(f"config.data.decoder='gpu' cannot run: {why} (use "
                       "decoder='host' or 'auto')")


def has_encoded_images(source) -> bool:
  """Whether ``source``'s examples carry encoded image bytes: webdataset
  shards and tables do, and any source that says so (``encoded_images``);
  TFDS datasets arrive decoded."""
  return bool(getattr(source, "encoded_images", sources.kind_of(
      source.spec) in SOURCE_KINDS))


def vit_flops(image_size: int, patch: int, width: int, depth: int,
              mlp: int) -> float:
  """FLOPs (2 * multiply-adds) of one image through a ViT's blocks: the
  projections and MLP per token, and attention's two token x token
  products."""
  tokens = (image_size // patch) ** 2 + 1
  per_token = 4 * width * width + 2 * width * mlp
  return 2.0 * depth * (tokens * per_token + 2 * tokens * tokens * width)


def tower_img_s(model, image_size: int):
  """(images per second one GPU embeds, its name) for config.model's image
  tower, estimated for an own ViT (``vit_flops`` at ``VIT_FLOP_S``); (None,
  what it is) for another tower (a CNN, a checkpoint's)."""
  image = None if model is None else model.get("image")
  if image is None:
    return None, "a tower not known here"
  if image.get("kind") != "vit":
    return None, f"a {image.get('kind')!r} tower (its rate is not estimated)"
  flops = vit_flops(image_size, image.patch_size, image.width, image.depth,
                    image.mlp_dim)
  return VIT_FLOP_S / flops, (
      f"the ViT (patch {image.patch_size}, width {image.width}, depth "
      f"{image.depth}) at {image_size} px")


def host_img_s(num_workers: int, cores: int, gpus: int) -> float:
  """What the host path decodes per GPU: ``num_workers`` worker processes
  (at most the cores less CORES_KEPT), or threads alone, shared by the
  process's ``gpus``."""
  if num_workers:
    total = HOST_IMG_S_PER_WORKER * min(num_workers,
                                        max(1, cores - CORES_KEPT))
  else:
    total = HOST_THREADS_IMG_S
  return total / max(1, gpus)


def choose(need, host: float, gpu: float) -> tuple:
  """("host" or "gpu", why): the host path while it keeps pace with the
  tower's ``need`` (img/s per GPU, None when not known), else the faster
  of ``host`` and ``gpu`` (0: the GPU decoder cannot run)."""
  if need is not None and host >= KEEPS_PACE * need:
    return "host", "the host keeps pace with the tower"
  if gpu > host:
    return "gpu", ("the host cannot keep pace, and the GPU decoder is "
                   "faster" if need is not None else
                   "the GPU decoder is faster than the host")
  return "host", ("the GPU decoder is no faster" if gpu else
                  "the GPU decoder cannot run here")


def pick(data, source, model=None, *, cores=None, gpus=None,
         log=print) -> str:
  """"host" or "gpu" for config.data.decoder="auto" (the module doc),
  said in one line through ``log``."""
  if not has_encoded_images(source):
    log("[data] decoder='auto': host (the source delivers decoded images)")
    return "host"
  why_not = gpu_unavailable()
  if gpus is None:
    gpus = len(jax.local_devices())
  if cores is None:
    cores = len(os.sched_getaffinity(0))
  need, tower = tower_img_s(model, data.image_size)
  host = host_img_s(data.get("num_workers", 0), cores, gpus)
  gpu = 0.0 if why_not else float(GPU_IMG_S)
  choice, why = choose(need, host, gpu)
  per = f"{cores / max(1, gpus):.0f} cores per GPU"
  rates = (f"host ~{host:,.0f} img/s per GPU ({data.get('num_workers', 0)} "
           f"workers, {per})"
           + (f", GPU decoder ~{gpu:,.0f}" if gpu else f"; no GPU decoder: "
              f"{why_not}")
           + (f", tower ~{need:,.0f} ({tower})" if need is not None
              else f", {tower}"))
  log(f"[data] decoder='auto': {choice}: {why} ({rates}; H200 figures, "
      'BENCHMARKS.md "Data path")')
  return choice


def make_batch_decoder(data, source, model=None, *, log=print):
  """The batch decoder of config.data.decoder for ``source``, or None:
  decode on the host, per example, where it is read. ``model``:
  config.model, whose image tower "auto" weighs."""
  check_decoder(data)
  decoder = data.get("decoder", "host")
  if decoder == "host":
    return None
  if decoder == "auto":
    decoder = pick(data, source, model, log=log)
    if decoder == "host":
      return None
  if not has_encoded_images(source):
    raise ValueError(
        f"config.data.decoder='gpu' decodes encoded images (webdataset:, "
        f"csv:, tsv:, jsonl: sources); {source.spec} delivers decoded ones "
        "(use decoder='host' or 'auto')")
  return gpu_lib.GpuBatchDecoder(
      data.get("gpu_decoder_backend", "auto"),
      options=data.get("gpu_decoder_options", ""),
      cpu_threads=data.get("gpu_decoder_cpu_threads", 0),
      threads=data.get("gpu_decoder_threads", 1))
