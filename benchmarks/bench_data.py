"""Benchmark of the host input pipeline: reading shards, decoding, img/s/core.

    python benchmarks/bench_data.py --out /tmp/bench_data [--num 4096]

Writes ``--num`` 256 px JPEGs (benchmarks' JpegPool images) into
img2dataset-style webdataset shards under a temporary directory, then
measures:

* reading the shards' members (no decoding), three ways: the standard
  library's ``tarfile`` sequentially, the ``webdataset`` package's
  sequential reader (if installed), and this trainer's index + ``os.pread``
  random access (train/data/webdataset.py), plus the time to index;
* decode + resize/crop 256 -> 224 (``pipeline.decode_image`` +
  ``resize_crop``) on one thread: img/s per core;
* the trainer's whole host pipeline (``make_train_iterator`` over the
  shards: read, decode, crop, tokenize, shuffle, uint8 micro-batches) with
  1, 2, 4, ... reader threads up to the core count, and with ``--workers``
  worker processes (``config.data.num_workers``).

Writes bench_data.json into --out and prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def write_shards(directory, num, per_shard=1024):
  from train.data import synthetic  # pylint: disable=import-outside-toplevel
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


def main():
  # (Worker processes are spawned: this module must not run on import.)
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--num", type=int, default=4096)
  ap.add_argument("--max_threads", type=int, default=os.cpu_count())
  ap.add_argument("--workers", default="",
                  help="comma-separated worker-process counts to measure "
                  "(config.data.num_workers, 1 thread each)")
  ap.add_argument("--skip_threads", action="store_true")
  args = ap.parse_args()
  import numpy as np  # pylint: disable=import-outside-toplevel
  import ml_collections  # pylint: disable=import-outside-toplevel
  from train.data import config as data_config  # pylint: disable=import-outside-toplevel
  from train.data import pipeline  # pylint: disable=import-outside-toplevel
  from train.data import webdataset as wds_lib  # pylint: disable=import-outside-toplevel
  res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
         "cores": os.cpu_count(), "num": args.num}
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
    # Decode + crop on one thread.
    jpgs = [src[i]["image"] for i in range(min(len(src), 1024))]
    t0 = time.perf_counter()
    for j in jpgs:
      pipeline.resize_crop(pipeline.decode_image(j, "", 224), 224)
    res["decode_crop_img_s_per_core"] = len(jpgs) / (time.perf_counter() - t0)
    # The whole pipeline.
    res["pipeline"] = []
    runs = [] if args.skip_threads else [
        (0, 2**k) for k in range(args.max_threads.bit_length())]
    runs += [(int(w), 1) for w in args.workers.split(",") if w.strip()]
    for workers, threads in runs:
      config = ml_collections.ConfigDict()
      config.data = data_config.default_data_config()
      config.tokenizer = data_config.default_tokenizer_config()
      config.tokenizer.max_len = 16
      config.data.name = "webdataset:" + pattern
      config.data.image_size = 224
      config.data.num_threads = threads
      config.data.num_workers = workers
      config.data.cache_max_mb = 0
      it = pipeline.make_train_iterator(config, batch_size=256, seed=0)
      next(it)  # Start-up.
      t0 = time.perf_counter()
      k = max(4, args.num // 256)
      for _ in range(k):
        next(it)
      rate = k * 256 / (time.perf_counter() - t0)
      cores = workers or threads
      res["pipeline"].append({"threads": threads, "workers": workers,
                              "img_s": rate, "img_s_per_core": rate / cores})
      print(f"[bench_data] pipeline {workers} workers x {threads} threads: "
            f"{rate:.0f} img/s", flush=True)
      it.close()
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_data.json"), "w") as f:
    json.dump(res, f, indent=1)
  print(f"cores {res['cores']}, {args.num} JPEGs 256 px, "
        f"{res['shard_mib']:.0f} MiB of shards (page cache)")
  print(f"read members: tarfile {res['read_tarfile_img_s']:.0f}/s, "
        f"webdataset {res['read_webdataset_img_s'] or float('nan'):.0f}/s, "
        f"index+pread random {res['read_indexed_random_img_s']:.0f}/s "
        f"(index {res['index_examples_s']:.0f} examples/s)")
  print(f"decode+crop 256->224: {res['decode_crop_img_s_per_core']:.0f} "
        "img/s on one core")
  for r in res["pipeline"]:
    print(f"pipeline {r['workers']:>3} worker processes x {r['threads']:>2} "
          f"threads: {r['img_s']:>7.0f} img/s ({r['img_s_per_core']:.0f} per "
          "core)")


if __name__ == "__main__":
  main()
