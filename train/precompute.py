"""Embeds a dataset once with the locked image tower, for LiT training.

    python -m train.precompute --config configs/lit_coco.py --out /data/emb
    # then: --config.data.name=embeddings:/data/emb

The config's image tower (``config.model.image``, loaded as for training)
runs over ``config.data.split`` of ``config.data.name`` in source order;
the embeddings are written as bfloat16 shards with the keys, captions and
labels of their examples and the tower's fingerprint (layout:
train/data/sources/embeddings.py). Training then reads them by example index and
decodes no image; a tower or preprocessing other than the one that made
them is refused. Each row also records its image id and a hash of its
decoded pixels (``content_hash``): training groups duplicate images by it
(``config.loss.groups = "content"``), never hashing again.

Resumable: a shard is written to a temporary file and renamed into place,
its .json last, and a rerun with the same --out skips the shards that are
complete (a different tower or source in --out is an error). Multi-process:
process p of P writes shards p, p+P, ... (run the same command in every
process of a ``jax.distributed`` job), one round of P shards at a time;
the directory is complete when all are. The trainer checks for a
preemption signal or a storage outage after each round
(``between_rounds``): the shards written so far are kept, and its rerun
continues from there. Bad examples (an image that does not decode, an empty caption, ...)
are recorded as bad rows and skipped by training.

``config.data.decoder`` decides where the JPEGs are decoded, as in training
(train/data/decode/choice.py): "host" in the reader threads (data.num_threads),
"gpu" by nvImageCodec on each local device (its contiguous rows of each
batch; the threads only read the bytes and check the JPEGs), "auto" by the
measured rates. A directory holds one decoder's embeddings (the GPU's
pixels are within a level or two of the host's, not equal).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from train import config_base
from train import data as data_lib
from train import file_keys
from train import mesh as mesh_lib
from train import model as model_lib
from train.data.sources import embeddings as emb_lib
from train.data import pipeline
from train.data.decode import choice as decoder_choice
from train.data.sources import remote
from train.data import sources
from train.data.sources.contract import Bad
from train.eval import embed as embed_lib

DEFAULT_ROWS_PER_SHARD = 65536


def _atomic_write(path: str, write) -> None:
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "wb") as f:
    write(f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def content_hash(image: np.ndarray) -> str:
  """Hex digest of an image's uint8 pixels as the tower sees them (at the
  host's size), with their shape: equal for duplicate images, so training
  can group them (``config.loss.groups = "content"``) without rehashing."""
  image = np.ascontiguousarray(image, np.uint8)
  h = hashlib.blake2b(digest_size=16)
  h.update(repr(image.shape).encode())
  h.update(image.tobytes())
  return h.hexdigest()


def _meta(source, tower, rows_per_shard: int, decode_size: int) -> dict:
  return {"format": emb_lib.FORMAT, "fingerprint": tower.fingerprint,
          "source": source.spec, "num_examples": len(source),
          "num_shards": -(-len(source) // rows_per_shard),
          "rows_per_shard": rows_per_shard, "dim": tower.embed_dim,
          "dtype": "bfloat16", "image_size": tower.image_size,
          # Where the images were resized (0: host; C: from C on the device):
          # a resumed run must not mix the two in one directory.
          "decode_size": decode_size,
          "tower": tower.source,
          # Found while opening the source: training counts them as bad too.
          "bad_at_open": [list(b) for b in source.bad_at_open]}


def _check_or_write_meta(out: str, meta: dict) -> None:
  path = os.path.join(out, "meta.json")
  if os.path.exists(path):
    old = emb_lib.read_meta(out, "--out")
    diff = sorted(k for k in meta if old.get(k) != meta[k])
    if diff:
      raise ValueError(
          f"--out {out} holds embeddings of another tower or source ("
          + ", ".join(f"{k}: {old.get(k)!r} there, {meta[k]!r} now"
                      for k in diff) + "); use a new directory")
    return
  os.makedirs(out, exist_ok=True)
  _atomic_write(path, lambda f: f.write(json.dumps(meta, indent=1).encode()))


def precompute(config, out: str, tower, *, source=None, process_index: int = 0,
               process_count: int = 1,
               rows_per_shard: int = 0,
               batch_size: int = 0, log=print, between_rounds=None) -> str:
  """Writes the embeddings of ``config.data``'s training split into ``out``.

  Args:
    config: the trainer config (data section; eval.batch_size is the default
      embedding batch).
    out: the directory (created; resumed if it holds a partial run).
    tower: the locked ``train.towers.Tower``.
    source: an opened source (default: config.data.name, split).
    process_index, process_count: this process's shards (p, p+P, ...).
    rows_per_shard: examples per shard file (0: DEFAULT_ROWS_PER_SHARD).
    batch_size: images per embedding call (rounded up to the local device
      count); 0 = config.eval.batch_size.
    between_rounds: called as ``between_rounds(done, shards, outage)``
      after each round of ``process_count`` shards (every process the same
      number of times), with this process's complete shards, its number of
      shards, and the ``remote.Outage`` that stopped its shard of the round
      (or None); it may raise to stop there. Without it an outage is raised.

  Returns:
    ``out``.
  """
  data = config.data
  rows_per_shard = rows_per_shard or DEFAULT_ROWS_PER_SHARD
  out = os.path.abspath(os.path.expanduser(out))
  if source is None:
    source = sources.open_source(data, data.split)
  if sources.kind_of(source.spec) == "embeddings":
    raise ValueError("config.data.name already names precomputed embeddings")
  meta = _meta(source, tower, rows_per_shard, data.decode_size)
  batch_decoder = decoder_choice.make_batch_decoder(
      data, source, config.get("model"), log=log)
  if batch_decoder is not None:
    meta["decoder"] = batch_decoder.name  # (absent: the host's)
  _check_or_write_meta(out, meta)
  local_mesh = mesh_lib.make_mesh(jax.local_devices())
  n_local = local_mesh.size
  bs = batch_size or config.eval.batch_size
  bs = -(-bs // n_local) * n_local
  embed = embed_lib.make_embed_fn(local_mesh, tower)
  params = jax.device_put(tower.params, mesh_lib.replicated(local_mesh))
  # The host delivers uint8 at host_size; Tower.embed resizes on the device
  # from config.data.decode_size, as in training.
  size = pipeline.host_size(data)
  compact = pipeline.Compact(source, size, decode=batch_decoder is None)
  devices = list(local_mesh.devices.flat)
  if batch_decoder is not None:
    by_device = {d: batch_decoder.for_device(d) for d in devices}
    log(f"[precompute] images decoded by {batch_decoder.describe()}, one "
        f"per local device ({n_local})")
  mine = range(process_index, meta["num_shards"], process_count)
  todo = [k for k in mine
          if not os.path.exists(emb_lib.shard_paths(out, k)[1])]
  done = len(mine) - len(todo)
  if done:
    log(f"[precompute] {out}: {done} shard(s) of this process already "
        "complete, skipped")
  t0, n_done = time.time(), 0
  rounds = -(-meta["num_shards"] // process_count)
  with concurrent.futures.ThreadPoolExecutor(max(1, data.num_threads)) as pool:
    def write_shard(k):
      nonlocal n_done
      lo = k * rows_per_shard
      hi = min(len(source), lo + rows_per_shard)
      keys, captions, labels, bad = [], [], [], {}
      image_ids, hashes = [], []
      emb = np.zeros((hi - lo, tower.embed_dim), np.float32)
      # Decoding runs on the reader threads, one batch ahead of the device.
      batches = [range(s, min(hi, s + bs)) for s in range(lo, hi, bs)]
      futures = [pool.submit(lambda r: [compact(i) for i in r], batches[0])]
      # The last batch's embeddings, read once the next batch is decoded and
      # dispatched: the device embeds one batch while the next decodes.
      pending = None
      for j, rows in enumerate(batches):
        if j + 1 < len(batches):
          futures.append(pool.submit(lambda r: [compact(i) for i in r],
                                     batches[j + 1]))
        items = futures[j].result()
        futures[j] = None
        if batch_decoder is not None:
          images, items = _decode_on_devices(
              by_device, devices, items, bs, size, local_mesh)
        else:
          images = np.zeros((bs, size, size, 3), np.uint8)
          for r, item in enumerate(items):
            if not isinstance(item, Bad):
              images[r] = item["image"]
        out_rows = embed(params, images)  # dispatched; the hashes meanwhile
        pixels = np.asarray(images)  # (the GPU's: copied back to hash them)
        if pending is not None:
          a, b = pending[0].start - lo, pending[0].stop - lo
          emb[a:b] = np.asarray(pending[1], np.float32)[:b - a]
        # On the threads (hashlib lets go of the GIL): one thread hashes
        # ~5k 256 px images a second, less than the GPU decoder delivers.
        good = [r for r, item in enumerate(items) if not isinstance(item, Bad)]
        digests = dict(zip(good, pool.map(content_hash,
                                          [pixels[r] for r in good])))
        for r, (i, item) in enumerate(zip(rows, items)):
          keys.append(source.keys[i] if hasattr(source, "keys")
                      else f"{source.spec}#{i}")
          if isinstance(item, Bad):
            bad[str(i - lo)] = item.reason
            captions.append([])
            labels.append(-1)
            image_ids.append(-1)
            hashes.append("")
          else:
            captions.append([c.decode() if isinstance(c, bytes) else c
                             for c in item["captions"]])
            labels.append(int(item["label"]))
            image_ids.append(int(item["image_id"]))
            hashes.append(digests[r])
        pending = (rows, out_rows)
      a, b = pending[0].start - lo, pending[0].stop - lo
      emb[a:b] = np.asarray(pending[1], np.float32)[:b - a]
      if not np.all(np.isfinite(emb)):
        bad_rows = np.where(~np.all(np.isfinite(emb), axis=1))[0]
        for r in bad_rows:
          bad.setdefault(str(int(r)), "non-finite embedding")
      npy, js = emb_lib.shard_paths(out, k)
      bits = emb.astype(jax.numpy.bfloat16).view(np.uint16)
      _atomic_write(npy, lambda f, b=bits: np.save(f, b))
      _atomic_write(js, lambda f: f.write(json.dumps(
          {"keys": keys, "captions": captions, "labels": labels,
           "image_ids": image_ids, "content_hashes": hashes,
           "bad": bad}).encode()))
      n_done += hi - lo
      log(f"[precompute] shard {k + 1}/{meta['num_shards']}: {hi - lo} "
          f"examples ({len(bad)} bad), {n_done / (time.time() - t0):.0f} "
          "img/s")

    for r in range(rounds):
      k = r * process_count + process_index
      if k not in todo:
        if between_rounds is not None:
          between_rounds(done, len(mine), None)
        continue
      try:
        write_shard(k)
      except remote.Outage as e:
        if between_rounds is None:
          raise
        between_rounds(done, len(mine), e)
        raise  # between_rounds stops the run on an outage.
      done += 1
      if between_rounds is not None:
        between_rounds(done, len(mine), None)
  if batch_decoder is not None:
    totals = {}
    for d in {id(d): d for d in by_device.values()}.values():
      if hasattr(d, "clock"):
        d.clock.add_to(totals)
      if hasattr(d, "close"):
        d.close()  # the GPU decoder's threads
    if totals:
      log("[precompute] decode stages (wall/cpu s, summed over devices and "
          "threads): " + ", ".join(f"{k} {v['wall_s']:.2f}/{v['cpu_s']:.2f}"
                                   for k, v in sorted(totals.items())))
  return out


def main(argv) -> None:
  del argv
  if FLAGS.jax_distributed:
    jax.distributed.initialize()
  config = FLAGS.config
  try:
    file_keys.check(config)
    config_base.check_config(config)
    config = file_keys.localized(config)  # Files of URLs: local copies.
    model_lib.check_checkpoints(config)
    data_lib.check_data_config(config)
    if not FLAGS.out:
      raise ValueError("--out DIR is required")
    tokenizer = data_lib.make_tokenizer(config)
    tower = model_lib.make_locked_tower(config, tokenizer)
    precompute(config, FLAGS.out, tower, process_index=jax.process_index(),
               process_count=jax.process_count(),
               rows_per_shard=FLAGS.rows_per_shard,
               batch_size=FLAGS.batch_size)
  except (ValueError, FileNotFoundError) as e:
    if os.environ.get("INFCL_TRACEBACK"):
      raise
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(f"[precompute] done: {FLAGS.out} (fingerprint {tower.fingerprint})",
        flush=True)


def _decode_on_devices(by_device: dict, devices: list, items: list, bs: int,
                       size: int, mesh):
  """A batch's encoded images (``Compact(decode=False)`` items, up to
  ``bs``) decoded by each local device's decoder, device k its rows [k *
  bs / n, (k + 1) * bs / n): (uint8 [bs, size, size, 3] global array in the
  mesh's batch sharding, the items with each that did not decode replaced by
  a Bad). A bad row, or one past the items, is zeros (its embedding is not
  kept)."""
  per, items = bs // len(devices), list(items)
  arrays = []
  for k, device in enumerate(devices):
    rows = [r for r in range(k * per, min((k + 1) * per, len(items)))
            if not isinstance(items[r], Bad)]
    shard = jnp.zeros((per, size, size, 3), jnp.uint8, device=device)
    if rows:
      images, ok, bad = by_device[device].decode(
          [items[r]["encoded"] for r in rows],
          [items[r]["key"] for r in rows], size)
      for i, where, reason in bad:
        items[rows[i]] = Bad(where, reason)
      at = np.asarray(rows, np.int32)[np.asarray(ok, bool)] - k * per
      if not isinstance(images, jax.Array):  # a host decoder's numpy
        images = jax.device_put(np.asarray(images), device)
      if len(at) == per:
        shard = images
      elif len(at):
        shard = shard.at[jax.device_put(at, device)].set(images)
    arrays.append(shard)
  return jax.make_array_from_single_device_arrays(
      (bs, size, size, 3), mesh_lib.rows(mesh), arrays), items


if __name__ == "__main__":
  FLAGS = flags.FLAGS
  config_flags.DEFINE_config_file("config", None, "Config file (configs/*.py"
                                  "), optionally with ':arg'; "
                                  "--config.<key>=<value> overrides.",
                                  lock_config=True)
  flags.DEFINE_string("out", None, "Embeddings directory (resumed if it "
                      "holds a partial run of the same tower and source).")
  flags.DEFINE_integer("rows_per_shard", DEFAULT_ROWS_PER_SHARD,
                       "Examples per shard file.")
  flags.DEFINE_integer("batch_size", 0, "Images per embedding call "
                       "(0 = config.eval.batch_size).")
  flags.DEFINE_bool("jax_distributed", False, "Multi-process: call "
                    "jax.distributed.initialize() first; process p writes "
                    "shards p, p+P, ...")
  app.run(main)
