"""Benchmark of the host input pipeline: reading shards, decoding, img/s/core.

    python benchmarks/bench_data.py --out OUT                  # device machine
    python benchmarks/bench_data.py --quick --out /tmp/bd      # CPU smoke

Writes --num 256 px JPEGs (``synthetic.JpegPool``) into webdataset shards,
then measures reading their members (``tarfile``, the ``webdataset``
package, the trainer's index + ``os.pread``), one core's decode only
(``decode_size=256``: the device resizes) and decode + resize 256 -> 224,
and the trainer's host pipeline (``make_train_iterator``) with reader
threads or worker processes, each case in a child: img/s after start-up,
peak host memory, the main process's CPU time per image (``--bytes_only``:
nothing decoded, the host side of ``decoder="gpu"``). ``--decoders``
measures the decoders alone instead: the host JPEG libraries per core, and
nvImageCodec per backend and batch (raw, and ``GpuBatchDecoder.decode``
with the pixels' distance to the host path's), and ``GpuBatchDecoder`` on
one --microbatch alone and beside bf16 matmuls on the GPU (each one's rate
drop: the tower's step beside the decoder). Rows go to bench_data.jsonl
as they finish, the summary to bench_data.json (bench_data_decoders.json).
"""
from __future__ import annotations

import importlib.metadata
import io
import json
import os
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # pylint: disable=wrong-import-position


def write_shards(directory, num, per_shard=1024):
  from train.data.sources import synthetic  # pylint: disable=import-outside-toplevel
  pool = synthetic.JpegPool(num, size=256, pool=min(num, 512))
  n_shards = -(-num // per_shard)
  for s in range(n_shards):
    with tarfile.open(os.path.join(directory, f"{s:05d}.tar"), "w") as tar:
      for i in range(s * per_shard, min(num, (s + 1) * per_shard)):
        ex = pool[i]
        for ext, data in (("jpg", ex["image"]),
                          ("txt", ex["captions"][0].encode()),
                          ("json", b'{"label": 0}')):
          info = tarfile.TarInfo(f"{ex['key']}.{ext}")
          info.size = len(data)
          tar.addfile(info, io.BytesIO(data))
  return os.path.join(directory, f"{{00000..{n_shards - 1:05d}}}.tar")


def read_tarfile(paths):
  n = 0
  for p in paths:
    with tarfile.open(p) as tar:
      for m in tar:
        if m.name.endswith(".jpg"):
          tar.extractfile(m).read()
          n += 1
  return n


def read_webdataset(pattern):
  import webdataset as wds  # pylint: disable=import-outside-toplevel
  n = 0
  for sample in wds.WebDataset(pattern, shardshuffle=False):
    assert sample["jpg"]
    n += 1
  return n


def per_core_rates(jpgs, image_size, decode_size, reps):
  """img/s on one thread: decode only at decode_size, decode + resize."""
  from train.data.decode import host as host_lib  # pylint: disable=import-outside-toplevel

  def decode_only():
    for j in jpgs:
      host_lib.resize_crop(host_lib.decode_host(j, "", decode_size),
                           decode_size)  # A no-op for C x C JPEGs.

  def decode_resize():
    for j in jpgs:
      host_lib.resize_crop(host_lib.decode_host(j, "", image_size),
                           image_size)

  out = {}
  for name, fn in (("decode_only", decode_only),
                   ("decode_resize", decode_resize)):
    t = harness.timeit(fn, reps=reps, warmup=1)
    out[f"{name}_img_s_per_core"] = len(jpgs) / t.median
  return out


def host_library_rates(jpgs, image_size, reps):
  """img/s on one thread per host JPEG library, a row each as it finishes:
  decode at full size (the 256 px JPEGs of decode_size=256) and decode +
  resize/crop to image_size (each library at its own DCT scale, then
  host.resize_crop)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from train.data.decode import host as host_lib  # pylint: disable=import-outside-toplevel
  libs = {}
  libs["pillow"] = lambda j, s: host_lib.decode_host(j, "", s, "pillow")
  try:
    import simplejpeg  # pylint: disable=import-outside-toplevel,unused-import
    libs["simplejpeg"] = lambda j, s: host_lib.decode_host(j, "", s,
                                                           "simplejpeg")
  except ImportError as e:
    libs["simplejpeg"] = e
  try:
    import cv2  # pylint: disable=import-outside-toplevel
    cv2.setNumThreads(1)
    libs["opencv"] = lambda j, s: cv2.cvtColor(cv2.imdecode(
        np.frombuffer(j, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
  except Exception as e:  # pylint: disable=broad-except
    libs["opencv"] = e
  ref = [host_lib.resize_crop(host_lib.decode_host(j, "", image_size,
                                                   "pillow"), image_size)
         for j in jpgs[:64]]
  for name, fn in libs.items():
    if isinstance(fn, Exception):
      yield {"kind": "host_library", "library": name,
             "status": f"unavailable: {type(fn).__name__}: {fn}"[:200]}
      continue
    decode_only = lambda fn=fn: [fn(j, 0) for j in jpgs]
    decode_resize = lambda fn=fn: [host_lib.resize_crop(fn(j, image_size),
                                                        image_size)
                                   for j in jpgs]
    row = {"kind": "host_library", "library": name, "status": "ok"}
    for label, f in (("decode_only", decode_only),
                     ("decode_resize", decode_resize)):
      t = harness.timeit(f, reps=reps, warmup=1)
      row[f"{label}_img_s_per_core"] = len(jpgs) / t.median
    got = [host_lib.resize_crop(fn(j, image_size), image_size)
           for j in jpgs[:64]]
    diff = np.abs(np.stack(got).astype(np.int16) - np.stack(ref))
    row["max_abs_diff_vs_pillow"] = int(diff.max())
    yield row


class _MatmulLoad:
  """bf16 matmuls back to back on the GPU on a thread, a stand-in for the
  tower's step beside the decoder: its TFLOP/s over a window."""

  def __init__(self, n=8192, chain=8):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    self.flops = 2 * n**3 * chain
    x = jnp.ones((n, n), jnp.bfloat16) * 0.01

    @jax.jit
    def run(a):
      for _ in range(chain):
        a = (a @ a) * 0.01
      return a
    self._run, self._x = run, x
    jax.block_until_ready(run(x))

  def rate(self, seconds, beside=None):
    """(TFLOP/s of the load over ``seconds``, what ``beside()`` returned):
    ``beside`` runs on this thread meanwhile."""
    import threading  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    stop, done = threading.Event(), []

    def loop():
      t0 = time.perf_counter()
      while not (done and stop.is_set()):  # one call at least
        jax.block_until_ready(self._run(self._x))
        done.append(time.perf_counter() - t0)
    th = threading.Thread(target=loop, daemon=True)
    th.start()
    out = beside() if beside else time.sleep(seconds)
    stop.set()
    th.join()
    return len(done) * self.flops / done[-1] / 1e12, out


def gpu_beside_load_rates(jpgs, image_size, batch, reps):
  """GpuBatchDecoder.decode of one trainer micro-batch (``batch``), alone
  and beside a bf16 matmul load, and the load's rate alone and beside it:
  how much each slows the other (one row)."""
  from train.data.decode import choice  # pylint: disable=import-outside-toplevel
  if choice.gpu_unavailable():
    return
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  batch_jpgs = [jpgs[i % len(jpgs)] for i in range(batch)]
  load = _MatmulLoad()
  dec = gpu_decode.GpuBatchDecoder("auto")
  f = lambda: dec.decode(batch_jpgs, [""] * batch, image_size)[0]
  row = {"kind": "gpu_beside_load", "backend": "auto", "batch": batch,
         "status": "ok"}
  try:
    row["load_alone_tflops"], _ = load.rate(3.0)
    row["decode_resize_img_s"] = batch / harness.timeit(
        f, reps=reps, warmup=2).median
    tflops, t = load.rate(0, beside=lambda: harness.timeit(
        f, reps=reps, warmup=1))
    row["beside_load_img_s"] = batch / t.median
    row["load_beside_tflops"] = tflops
  except Exception as e:  # pylint: disable=broad-except
    row["status"] = f"error: {type(e).__name__}: {e}"[:300]
  yield row


def gpu_decoder_rates(jpgs, image_size, batches, reps):
  """img/s of nvImageCodec per backend and batch (see the module doc), a
  row each as it finishes."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from train.data.decode import choice  # pylint: disable=import-outside-toplevel
  from train.data.decode import host as host_lib  # pylint: disable=import-outside-toplevel
  why = choice.gpu_unavailable()
  if why:
    yield {"kind": "gpu_decoder", "status": f"unavailable: {why}"}
    return
  from train.data.decode import gpu as gpu_decode  # pylint: disable=import-outside-toplevel
  host = np.stack([host_lib.resize_crop(host_lib.decode_host(
      j, "", image_size), image_size) for j in jpgs[:256]])
  for backend in ("auto", "hw", "cuda"):
    try:
      dec = gpu_decode.GpuBatchDecoder(backend)
    except Exception as e:  # pylint: disable=broad-except
      yield {"kind": "gpu_decoder", "backend": backend,
             "status": f"error: {type(e).__name__}: {e}"[:300]}
      continue
    images, ok, bad = dec.decode(jpgs[:256], [""] * 256, image_size)
    row0 = {"kind": "gpu_decoder", "backend": backend, "status": "ok",
            "device": str(dec.device), "decoded": int(ok.sum()),
            "fancy_upsampling": dec.fancy_upsampling,
            "bad": len(bad)}
    if ok.all():
      diff = np.abs(np.asarray(images).astype(np.int16) - host)
      row0.update(max_abs_diff_vs_host=int(diff.max()),
                  mean_abs_diff_vs_host=float(diff.mean()),
                  frac_pixels_differing=float((diff > 0).mean()))
    for b in batches:
      batch = [jpgs[i % len(jpgs)] for i in range(b)]
      row = dict(row0, batch=b)
      raw = lambda batch=batch: [
          dec._to_jax(x) for x in dec._decoder.decode(  # pylint: disable=protected-access
              batch, params=dec._params)]  # pylint: disable=protected-access
      whole = lambda batch=batch: dec.decode(batch, [""] * len(batch),
                                             image_size)[0]
      for label, f in (("raw_decode", raw), ("decode_resize", whole)):
        try:
          t = harness.timeit(f, reps=reps, warmup=2)
          row[f"{label}_img_s"] = b / t.median
        except Exception as e:  # pylint: disable=broad-except
          row[f"{label}_error"] = f"{type(e).__name__}: {e}"[:300]
      row["zero_copy"] = dec.zero_copy
      yield row


# ----------------------------------------------------------------- child


class _NoDecode:
  """A batch decoder that decodes nothing (--bytes_only): the GPU decoder's
  host side alone (reading, the JPEG check, tokens, the hand-over from the
  workers); its images are one cached zero array per device."""

  name = "none"

  def __init__(self, device=None):
    import jax  # pylint: disable=import-outside-toplevel
    self.device = device or jax.local_devices()[0]
    self._zeros = {}

  def for_device(self, device):
    return self if device == self.device else _NoDecode(device)

  def describe(self) -> str:
    return "none (bytes only)"

  def decode(self, encoded, wheres, size):
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    del wheres
    n = len(encoded)
    if n not in self._zeros:
      self._zeros[n] = jax.device_put(np.zeros((n, size, size, 3), np.uint8),
                                      self.device)
    return self._zeros[n], np.ones(n, bool), []


def pipeline_child(spec) -> dict:
  """One pipeline configuration: img/s after start-up, peak host memory."""
  import ml_collections  # pylint: disable=import-outside-toplevel
  from train.data import config as data_config  # pylint: disable=import-outside-toplevel
  from train.data import pipeline  # pylint: disable=import-outside-toplevel
  config = ml_collections.ConfigDict()
  config.data = data_config.default_data_config()
  config.tokenizer = data_config.default_tokenizer_config()
  config.tokenizer.max_len = 16
  config.data.name = "webdataset:" + spec["pattern"]
  config.data.image_size = spec["image_size"]
  config.data.decode_size = spec["decode_size"]
  config.data.num_threads = spec["threads"]
  config.data.num_workers = spec["workers"]
  config.data.cache_max_mb = 0
  mb = spec["microbatch"]
  out = dict(spec)
  with harness.HostMemory() as mem:
    t0 = time.perf_counter()
    it = pipeline.make_train_iterator(
        config, batch_size=mb, seed=0,
        batch_decoder=_NoDecode() if spec.get("bytes_only") else None)
    first = next(it)  # Start-up: workers spawned, buffers filling.
    out["startup_s"] = time.perf_counter() - t0
    out["image_shape"] = list(first["image"].shape)
    n, t0 = 0, time.perf_counter()
    cpu0, thread0 = time.process_time(), time.thread_time()
    while n < 2 * mb or time.perf_counter() - t0 < spec["measure_s"]:
      n += len(next(it)["image"])
    elapsed = time.perf_counter() - t0
    # This process's own work (workers excluded): taking the chunks out of
    # shared memory into micro-batches, on its threads in all and on the
    # calling thread (the part a train step waits for).
    out["main_cpu_us_per_image"] = 1e6 * (time.process_time() - cpu0) / n
    out["main_thread_us_per_image"] = 1e6 * (time.thread_time() - thread0) / n
    it.close()
  out["images"] = n
  out["img_s"] = n / elapsed
  cores = spec["workers"] or spec["threads"]
  out["img_s_per_core"] = out["img_s"] / cores
  out["host_peak_gib"] = mem.peak_gib
  out["status"] = "ok"
  return out


# ----------------------------------------------------------------- parent


def _key(r):
  """A row's case (rows of one run only: bench_data does not resume)."""
  return tuple(r.get(k) for k in ("kind", "library", "backend", "batch",
                                  "workers", "threads", "decode_size",
                                  "bytes_only"))


def decoders(args, rows, res):
  """--decoders: the host libraries per core, nvImageCodec on the GPU."""
  from train.data.sources import synthetic  # pylint: disable=import-outside-toplevel
  res.update(harness.device_meta())
  pool = synthetic.JpegPool(args.num, size=256, pool=min(args.num, 512))
  jpgs = [pool[i]["image"] for i in range(min(args.num, 512))]
  res["mean_jpeg_kb"] = sum(map(len, jpgs)) / len(jpgs) / 1024
  meta = dict(date=res["date"], device_kind=res["device_kind"],
              jax=res["jax"])
  res["host"] = [rows.add(dict(r, **meta)) for r in host_library_rates(
      jpgs, args.image_size, reps=2 if args.quick else 3)]
  res["gpu"] = [rows.add(dict(r, **meta)) for r in gpu_decoder_rates(
      jpgs, args.image_size, harness.ints(args.gpu_batches),
      reps=2 if args.quick else 5)]
  res["gpu_beside_load"] = [rows.add(dict(r, **meta)) for r in
                            gpu_beside_load_rates(
                                jpgs, args.image_size, args.microbatch,
                                reps=2 if args.quick else 5)]
  with open(os.path.join(args.out, "bench_data_decoders.json"), "w") as f:
    json.dump(res, f, indent=1)
  print(f"\n{len(jpgs)} JPEGs 256 px, {res['mean_jpeg_kb']:.1f} KB mean; "
        f"img/s per core (decode | + resize to {args.image_size}):")
  for r in res["host"]:
    print(f"  {r['library']:>12}: " + (
        f"{r['decode_only_img_s_per_core']:7.0f} | "
        f"{r['decode_resize_img_s_per_core']:7.0f}  (max |diff| vs Pillow "
        f"{r['max_abs_diff_vs_pillow']})" if r["status"] == "ok"
        else r["status"]))
  for r in res["gpu"] + res["gpu_beside_load"]:
    print("  gpu " + " ".join(f"{k}={v:.0f}" if isinstance(v, float) and
                              v > 10 else f"{k}={v}" for k, v in r.items()
                              if k not in ("kind", *meta)))


def reading_and_pipeline(args, rows, res, threads, workers):
  """Reading the shards, one core's decode, the pipeline cases."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from train.data.sources import webdataset as wds_lib  # pylint: disable=import-outside-toplevel
  meta = dict(date=res["date"], jax=res["jax"])
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    pattern = write_shards(tmp, args.num)
    res["write_s"] = time.perf_counter() - t0
    paths = wds_lib.expand_shards(pattern)
    res["shard_mib"] = sum(os.path.getsize(p) for p in paths) / 2**20
    read_tarfile(paths)  # Warm the page cache: every reader then reads RAM.
    t0 = time.perf_counter()
    n = read_tarfile(paths)
    res["read_tarfile_img_s"] = n / (time.perf_counter() - t0)
    try:
      t0 = time.perf_counter()
      n = read_webdataset(pattern)
      res["read_webdataset_img_s"] = n / (time.perf_counter() - t0)
    except ImportError:
      res["read_webdataset_img_s"] = None
    t0 = time.perf_counter()
    src = wds_lib.WebDatasetSource(pattern, num_threads=1)
    res["index_s"] = time.perf_counter() - t0
    res["index_examples_s"] = len(src) / res["index_s"]
    order = np.random.default_rng(0).permutation(len(src))
    t0 = time.perf_counter()
    for i in order:
      src[int(i)]
    res["read_indexed_random_img_s"] = len(src) / (time.perf_counter() - t0)
    jpgs = [src[i]["image"] for i in range(min(len(src), 1024))]
    res.update(per_core_rates(jpgs, args.image_size, args.decode_size,
                              reps=2 if args.quick else 3))
    rows.add({"kind": "reading_and_per_core", **res})

    base = dict(pattern=pattern, image_size=args.image_size,
                microbatch=args.microbatch, measure_s=args.measure_s)
    if args.bytes_only:
      base["bytes_only"] = True
    cases = [dict(base, workers=0, threads=t, decode_size=args.decode_size)
             for t in threads]
    cases += [dict(base, workers=w, threads=1, decode_size=args.decode_size)
              for w in workers]
    if workers and not args.bytes_only:
      # The host resizing, at the most workers, for comparison.
      cases.append(dict(base, workers=max(workers), threads=1, decode_size=0))
    res["pipeline"] = []
    for case in cases:
      r = harness.run_child(
          [os.path.abspath(__file__), "--case", json.dumps(case)],
          timeout_s=args.timeout_s)
      r = {**case, **r, **meta}
      r.pop("pattern", None)
      res["pipeline"].append(rows.add({"kind": "pipeline", **r}))
  with open(os.path.join(args.out, "bench_data.json"), "w") as f:
    json.dump(res, f, indent=1)
  print(f"\ncores {res['cores']}, {args.num} JPEGs 256 px, "
        f"{res['shard_mib']:.0f} MiB of shards (page cache)")
  print(f"read members: tarfile {res['read_tarfile_img_s']:.0f}/s, "
        f"webdataset {res['read_webdataset_img_s'] or float('nan'):.0f}/s, "
        f"index+pread random {res['read_indexed_random_img_s']:.0f}/s "
        f"(index {res['index_examples_s']:.0f} examples/s)")
  print(f"one core: decode only (decode_size={args.decode_size}) "
        f"{res['decode_only_img_s_per_core']:.0f} img/s, decode + resize/crop "
        f"256->{args.image_size} {res['decode_resize_img_s_per_core']:.0f} "
        "img/s")
  print(f"{'workers':>8}{'threads':>8}{'decode_size':>12}{'status':>8}"
        f"{'img/s':>9}{'per core':>9}{'host GiB':>9}{'main us/img':>12}"
        f"{'thread us':>10}")
  for r in res["pipeline"]:
    ok = r["status"] == "ok"
    print(f"{r['workers']:>8}{r['threads']:>8}{r['decode_size']:>12}"
          f"{r['status'][:8]:>8}"
          + (f"{r['img_s']:>9.0f}{r['img_s_per_core']:>9.0f}"
             f"{r['host_peak_gib']:>9.2f}{r['main_cpu_us_per_image']:>12.0f}"
             f"{r['main_thread_us_per_image']:>10.0f}" if ok else ""))


def main(argv=None):
  # (Worker processes are spawned: this module must not run on import.)
  cores = len(os.sched_getaffinity(0))
  ap = harness.parser(__doc__, out=None)
  ap.add_argument("--num", type=int, default=16384,
                  help="JPEGs in the shards (--decoders: in memory)")
  ap.add_argument("--image_size", type=int, default=224)
  ap.add_argument("--decode_size", type=int, default=256,
                  help="config.data.decode_size of the pipeline cases")
  ap.add_argument("--threads", default=",".join(
      str(2**k) for k in range(cores.bit_length())),
                  help="reader-thread counts without workers (default "
                  "1,2,4,... up to the cores; '' = none)")
  ap.add_argument("--workers", default="8,12,16",
                  help="worker-process counts, 1 thread each")
  ap.add_argument("--microbatch", type=int, default=8192,
                  help="images per micro-batch (the trainer's GradCache "
                  "micro-batch)")
  ap.add_argument("--measure_s", type=float, default=10.0,
                  help="seconds measured per pipeline case")
  ap.add_argument("--timeout_s", type=int, default=120,
                  help="deadline of one pipeline case")
  ap.add_argument("--decoders", action="store_true",
                  help="measure the decoders alone (host libraries per "
                  "core, nvImageCodec per backend and batch), no pipeline")
  ap.add_argument("--bytes_only", action="store_true",
                  help="pipeline cases without decoding: the host side of "
                  "decoder='gpu' (reading, JPEG check, tokens, hand-over)")
  ap.add_argument("--gpu_batches", default="256,1024,4096",
                  help="--decoders: GPU batch sizes")
  args = harness.parse_quick(ap, dict(
      num=512, threads="1,2", workers="2", microbatch=64, measure_s=1.0),
                             argv)
  if args.case:
    harness.print_result(pipeline_child(json.loads(args.case)))
    return
  rows = harness.Rows(args.out, "bench_data", key=_key)
  res = {"date": harness.now(), "jax": importlib.metadata.version("jax"),
         "cores": cores, "num": args.num, "image_size": args.image_size,
         "decode_size": args.decode_size, "microbatch": args.microbatch}
  if args.decoders:
    decoders(args, rows, res)
  else:
    reading_and_pipeline(args, rows, res, harness.ints(args.threads),
                         harness.ints(args.workers))


if __name__ == "__main__":
  main()
