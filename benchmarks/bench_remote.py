"""Benchmark of reading webdataset shards from local disk, a local S3 server and over HTTP.

    python benchmarks/bench_remote.py --out OUT                  # device machine
    python benchmarks/bench_remote.py --quick --out /tmp/br      # CPU smoke

Writes --num 256 px JPEGs into webdataset shards (benchmarks/bench_data.py's
writer) and serves the same files from a moto S3 server and a Range-capable
HTTP server (tests/netservers.py), each in a process of its own on
127.0.0.1. Then, for each store: the time to open the source (the tar
headers scanned, then again with the index cached), examples/s of
``source[i]`` in random order from --threads reader threads (the trainer's
``data.num_threads``), and examples/s of the trainer's pipeline
(``make_train_iterator``, nothing decoded: the host side of
``decoder="gpu"``; reader threads in this process and with --workers worker
processes; a remote source's chunks read together, --parallelism requests
in flight per process: ``config.data.remote_parallelism``), with this
process's CPU time per example (the client's cost of a remote read; the
servers' CPU is theirs). ``--cases pipeline`` leaves out the others. ``--latency_ms`` puts a proxy
answering every request (each time it is made) that late in front of the S3 server (a remote
store's round trip; the proxy is Python, so on few cores it bounds the rate
too). Rows go to bench_remote.jsonl, the summary to bench_remote.json.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import harness  # pylint: disable=wrong-import-position
from benchmarks import bench_data  # pylint: disable=wrong-import-position

_SERVE = r"""
import sys, time
sys.path.insert(0, {root!r})
kind, arg = sys.argv[1], sys.argv[2]
if kind == "s3":
  import logging
  logging.getLogger("werkzeug").setLevel(logging.WARNING)
  from moto.server import ThreadedMotoServer
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  server.start()
  port = server.get_host_and_port()[1]
elif kind == "http":
  from tests.netservers import HTTPDir
  server = HTTPDir(arg)
  port = server.port
else:  # proxy: every request answered late by arg ms
  from tests.netservers import FaultProxy
  class Late(FaultProxy):
    # Every request, again each time (FaultProxy's own plan delays a
    # request once: a range read twice, by two cases, would be fast).
    def decide(self, method, path, rng_header):
      return "slow"
  up, ms = arg.split(",")
  server = Late(("127.0.0.1", int(up)), delay_s=float(ms) / 1e3)
  port = server.port
print(port, flush=True)
while True:
  time.sleep(3600)
"""


def _start(kind, arg):
  p = subprocess.Popen([sys.executable, "-c", _SERVE.format(root=ROOT), kind,
                        str(arg)], stdout=subprocess.PIPE, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
  port = int(p.stdout.readline())
  return p, f"http://127.0.0.1:{port}"


def _upload(endpoint, directory, bucket):
  import boto3  # pylint: disable=import-outside-toplevel
  client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="bench",
                        aws_secret_access_key="bench")
  client.create_bucket(Bucket=bucket)
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      client.put_object(Bucket=bucket, Key=f"shards/{name}", Body=f.read())


def _random_reads(source, threads, measure_s):
  """Examples/s of source[i] in a random order from ``threads`` threads,
  and this process's CPU us per example."""
  import concurrent.futures  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  order = np.random.default_rng(0).permutation(len(source)).tolist()
  n, t0, cpu0 = 0, time.perf_counter(), time.process_time()
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    while n < len(order) and time.perf_counter() - t0 < measure_s:
      batch = order[n:n + 16 * threads]
      list(pool.map(source.__getitem__, batch))
      n += len(batch)
  elapsed = time.perf_counter() - t0
  return n / elapsed, 1e6 * (time.process_time() - cpu0) / n


def _pipeline(name, options, threads, workers, microbatch, measure_s,
              index_cache, parallelism):
  import ml_collections  # pylint: disable=import-outside-toplevel
  from train.data import config as data_config  # pylint: disable=import-outside-toplevel
  from train.data import pipeline  # pylint: disable=import-outside-toplevel
  config = ml_collections.ConfigDict()
  config.data = data_config.default_data_config()
  config.tokenizer = data_config.default_tokenizer_config()
  config.tokenizer.max_len = 16
  config.data.name = name
  config.data.image_size = 224
  config.data.decode_size = 256
  config.data.num_threads = threads
  config.data.num_workers = workers
  config.data.remote_parallelism = parallelism
  config.data.cache_max_mb = 0
  config.data.shard_index_cache = index_cache
  config.data.storage_options = options
  it = pipeline.make_train_iterator(config, batch_size=microbatch, seed=0,
                                    batch_decoder=bench_data._NoDecode())  # pylint: disable=protected-access
  try:
    next(it)
    n, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while n < 2 * microbatch or time.perf_counter() - t0 < measure_s:
      n += len(next(it)["image"])
    elapsed = time.perf_counter() - t0
    return n / elapsed, 1e6 * (time.process_time() - cpu0) / n
  finally:
    it.close()


def main(argv=None):
  cores = len(os.sched_getaffinity(0))
  ap = harness.parser(__doc__, out=None)
  ap.add_argument("--num", type=int, default=16384, help="JPEGs in the shards")
  ap.add_argument("--per_shard", type=int, default=1024)
  ap.add_argument("--threads", default="2,8,32",
                  help="reader threads (data.num_threads)")
  ap.add_argument("--workers", default="",
                  help="worker-process counts for the pipeline cases "
                  "(data.num_workers), with 8 threads each")
  ap.add_argument("--microbatch", type=int, default=1024)
  ap.add_argument("--measure_s", type=float, default=8.0)
  ap.add_argument("--latency_ms", type=float, default=0.0,
                  help="also read S3 through a proxy adding this latency")
  ap.add_argument("--stores", default="local,s3,http")
  ap.add_argument("--parallelism", default="32",
                  help="data.remote_parallelism values for the pipeline "
                  "cases of remote stores")
  ap.add_argument("--cases", default="open,source,pipeline")
  args = harness.parse_quick(ap, dict(num=512, per_shard=128, threads="2,8",
                                      microbatch=64, measure_s=1.0), argv)
  threads, workers = harness.ints(args.threads), harness.ints(args.workers)
  rows = harness.Rows(args.out, "bench_remote",
                      key=lambda r: (r.get("store"), r.get("case"),
                                     r.get("threads"), r.get("workers"),
                                     r.get("parallelism")))
  cases = args.cases.split(",")
  parallelisms = harness.ints(args.parallelism)
  env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
         "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
         "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
         "AWS_EC2_METADATA_DISABLED": "true"}
  os.environ.update(env)
  meta = {"date": harness.now(), "cores": cores, "num": args.num,
          "host": socket.gethostname()}
  procs = []
  from train.data.sources import remote  # pylint: disable=import-outside-toplevel
  from train.data.sources import webdataset  # pylint: disable=import-outside-toplevel
  try:
    with tempfile.TemporaryDirectory() as tmp:
      shard_dir = os.path.join(tmp, "shards")
      os.makedirs(shard_dir)
      pattern = bench_data.write_shards(shard_dir, args.num, args.per_shard)
      base = os.path.basename(pattern)
      meta["shard_mib"] = sum(os.path.getsize(os.path.join(shard_dir, f))
                              for f in os.listdir(shard_dir)) / 2**20
      stores = {}
      wanted = args.stores.split(",")
      if "local" in wanted:
        stores["local"] = pattern
      if "s3" in wanted or args.latency_ms:
        p, endpoint = _start("s3", "")
        procs.append(p)
        _upload(endpoint, shard_dir, "bench")
        if "s3" in wanted:
          stores["s3"] = (f"s3://bench/shards/{base}", endpoint)
        if args.latency_ms:
          p, proxy = _start("proxy", f"{endpoint.rsplit(':', 1)[1]},"
                            f"{args.latency_ms}")
          procs.append(p)
          stores[f"s3+{args.latency_ms:g}ms"] = (
              f"s3://bench/shards/{base}", proxy)
      if "http" in wanted:
        p, url = _start("http", shard_dir)
        procs.append(p)
        stores["http"] = f"{url}/{base}"
      for store, spec in stores.items():
        pat, endpoint = spec if isinstance(spec, tuple) else (spec, None)
        options = (json.dumps({"s3": {"endpoint_url": endpoint}})
                   if endpoint else "")
        cache = os.path.join(tmp, f"index-{store}")
        t0 = time.perf_counter()
        src = webdataset.WebDatasetSource(pat, index_cache=cache,
                                          num_threads=8,
                                          store=remote.Store(options))
        open_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        src = webdataset.WebDatasetSource(pat, index_cache=cache,
                                          num_threads=8,
                                          store=remote.Store(options))
        cached_s = time.perf_counter() - t0
        if "open" in cases:
          rows.add({"store": store, "case": "open", "open_s": open_s,
                    "open_cached_s": cached_s, "examples": len(src), **meta})
        for t in (threads if "source" in cases else []):
          rate, cpu = _random_reads(src, t, args.measure_s)
          rows.add({"store": store, "case": "source", "threads": t,
                    "examples_s": rate, "client_cpu_us": cpu, **meta})
        for w in ([0] + workers if "pipeline" in cases else []):
          for t in (threads if w == 0 else [8]):
            for par in (parallelisms if any(map(remote.is_url, src.paths))
                        else [0]):
              rate, cpu = _pipeline("webdataset:" + pat, options, t, w,
                                    args.microbatch, args.measure_s, cache,
                                    par or 1)
              rows.add({"store": store, "case": "pipeline", "threads": t,
                        "workers": w, "parallelism": par, "examples_s": rate,
                        "main_cpu_us": cpu, **meta})
  finally:
    for p in procs:
      p.kill()
      p.wait()
  with open(os.path.join(args.out, "bench_remote.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows.rows}, f, indent=1)
  print(f"\n{cores} cores, {args.num} JPEGs 256 px in "
        f"{meta['shard_mib']:.0f} MiB of shards")
  print(f"{'store':>12}{'case':>10}{'threads':>8}{'workers':>8}{'par':>5}"
        f"{'ex/s':>9}{'cpu us/ex':>10}{'open s':>8}{'cached s':>9}")
  for r in rows.rows:
    print(f"{r['store']:>12}{r['case']:>10}{r.get('threads', ''):>8}"
          f"{r.get('workers', ''):>8}{r.get('parallelism', ''):>5}"
          + (f"{r['examples_s']:>9.0f}"
             f"{r.get('client_cpu_us', r.get('main_cpu_us')):>10.0f}"
             if "examples_s" in r else f"{'':>19}")
          + (f"{r['open_s']:>8.2f}{r['open_cached_s']:>9.2f}"
             if "open_s" in r else ""))


if __name__ == "__main__":
  main()
