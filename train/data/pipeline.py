"""The training input pipeline: source -> grain -> uint8 micro-batches.

    source (random access by example index; this process's shard: examples
            p, p+P, p+2P, ...; see train/data/sources/contract.py)
      -> map: read, decode, resize + central crop to image_size (uint8),
         or with data.decode_size C to C x C (an image decoded at C x C is
         left as it is) for the device to resize (host_size); done once and
         kept in memory when the shard fits in cache_max_mb
      -> shuffle(seed) + repeat: a fresh permutation of the shard each epoch
      -> with config.captions_per_image k > 1: each image at k consecutive
         stream positions (its k captions in one batch)
      -> map_with_index: pick one caption (random per stream position, so it
         varies across epochs; distinct for the k copies), tokenize; with
         config.loss.groups, the example's group id (image or content id)
         (a remote source's examples are read a chunk at a time instead,
         remote_parallelism requests in flight per process: the shuffle,
         repeat and each_k below then run on example indices, and the
         chunk's read and finalized examples are bitwise the same)
      -> prefetch: grain's reader threads (num_threads), in num_workers
         worker processes when set (decoding is CPU-bound Python-level
         work: threads stop scaling at a few cores, processes do not)
      -> micro-batches of good examples: uint8 images, int32 tokens

Bad examples (an image that does not decode, an empty caption, an unreadable
file; those a source found while opening are counted at start) are skipped
where they fall in the stream, logged with their shard and key, and counted
once each (not again in a later epoch); more than config.data.max_bad_fraction
of the examples seen, checked from min(1000, corpus size) examples on, stops
the run.

Each element is a pure function of (seed, shard, stream position), whatever
the thread count, so the iterator's state is the next stream position (plus
the bad-data counts): resuming slices the stream there and yields bitwise
the batches an uninterrupted run would have. Images stay uint8 all the way
to the device, where the tower resizes them from decode_size (if set),
normalises them and casts them (``Tower.embed``, train/towers/tower.py).
"""

import concurrent.futures
import queue
import sys
import threading
import time

from absl import flags
import grain
import numpy as np

from train.data import batching
from train.data import sources
from train.data import tokenizer as tokenizer_lib
from train.data.decode import choice
from train.data.decode.host import decode_host
from train.data.decode.host import jpeg_problem
from train.data.decode.host import resize_crop
from train.data.ledger import BadDataLedger
from train.data.ledger import CountsBadData
from train.data.ledger import start_of_check
from train.data.sources import remote
from train.data.sources.contract import Bad
from train.data.sources.contract import BadExample
from train.data.sources.contract import read_many


def host_size(data) -> int:
  """The side of the uint8 squares the host delivers for training:
  data.decode_size, or image_size when it is 0 (host resize)."""
  return data.decode_size or data.image_size


class Compact:
  """A source example -> {"image": uint8 [S, S, 3] (or "image_emb"),
  "captions", "label", "image_id" (and "content_id" where the source has
  one)}, or a ``Bad`` naming it.

  S is the size the host delivers (``host_size``). Keeps only what training
  needs, at that resolution, so a cached shard costs S*S*3 bytes per example
  whatever the original image size. ``image_id`` is the source's identity of
  the example's image (examples of one image share it; by default the
  example's index), the group id of ``config.loss.groups = "image"``.

  With ``decode=False`` (a batch decoder downstream, train/data/batching.py)
  encoded images are only checked to be whole JPEGs and kept as
  "encoded" bytes, with the example's "key".
  """

  def __init__(self, source, image_size: int, decode: bool = True):
    self.source, self.image_size, self.decode = source, image_size, decode

  def __call__(self, index: int):
    try:
      ex = self.source[int(index)]
    except BadExample as e:
      return Bad(e.where, e.reason)
    return self.finish(index, ex)

  def many(self, indices: list, parallelism: int) -> list:
    """``self(i)`` for each index, the examples read together (a remote
    source's ``read_many``: up to ``parallelism`` requests at a time)."""
    return [Bad(ex.where, ex.reason) if isinstance(ex, BadExample)
            else self.finish(i, ex)
            for i, ex in zip(indices, read_many(self.source, indices,
                                                parallelism))]

  def finish(self, index: int, ex: dict):
    """The compact form of example ``index`` read as ``ex``."""
    try:
      out = {"captions": ex["captions"], "label": ex["label"],
             "image_id": int(ex.get("image_id", index))}
      if "content_id" in ex:
        out["content_id"] = int(ex["content_id"])
      if "image_emb" in ex:
        out["image_emb"] = ex["image_emb"]
      else:
        image = ex["image"]
        if (isinstance(image, (bytes, bytearray, memoryview))
            and not self.decode):
          problem = jpeg_problem(image)
          if problem:
            raise BadExample(ex["key"], f"undecodable image ({problem})")
          out["encoded"], out["key"] = bytes(image), ex["key"]
          return out
        if isinstance(image, (bytes, bytearray, memoryview)):
          image = decode_host(image, ex["key"], self.image_size)
        out["image"] = resize_crop(image, self.image_size)
      return out
    except BadExample as e:
      return Bad(e.where, e.reason)


# config.loss.groups -> the compact example's id that becomes "group".
GROUP_IDS = {"image": "image_id", "content": "content_id"}


class Finalize:
  """A compact example at stream position p -> {"image" (uint8) or
  "image_emb", "text", "label"} (and "group", int32, when ``groups`` is
  "image" or "content"); a Bad passes through.

  Picks one caption (random, seeded by (seed, stream, p): it varies across
  epochs but is the same on every run) and tokenizes it. With
  ``captions_per_image`` k > 1 the stream holds each image at k consecutive
  positions (``each_k``): position p takes caption (p mod k) of a permutation
  of the image's captions seeded by (seed, stream, p // k), so the k copies
  get distinct captions while the image has that many.
  """

  def __init__(self, tokenizer, *, seed=0, stream=0, first_caption=False,
               groups: str = "none", captions_per_image: int = 1):
    self.tokenizer = tokenizer
    self.seed, self.stream, self.first_caption = seed, stream, first_caption
    self.group_key = GROUP_IDS.get(groups)
    self.k = captions_per_image

  def pick_caption(self, captions: list, position: int):
    if not captions:
      return b""
    if self.first_caption or len(captions) == 1:
      return captions[0]
    if self.k > 1:
      rng = np.random.default_rng([self.seed, self.stream, position // self.k])
      return captions[int(rng.permutation(len(captions))[
          (position % self.k) % len(captions)])]
    rng = np.random.default_rng([self.seed, self.stream, position])
    return captions[int(rng.integers(len(captions)))]

  def __call__(self, position: int, compact):
    if isinstance(compact, Bad):
      return (position, compact)
    caption = self.pick_caption(compact["captions"], position)
    out = {"text": self.tokenizer.encode([caption])[0],
           "label": np.int32(compact["label"])}
    if self.group_key is not None:
      out["group"] = np.int32(compact[self.group_key])
    for k in ("image", "image_emb", "encoded", "key"):
      if k in compact:
        out[k] = compact[k]
    return (position, out)


class _CopyOf:
  """Position p of an ``each_k`` stream -> element p // k of its parent."""

  def __init__(self, parent, k: int):
    self.parent, self.k = parent, k

  def __call__(self, position: int):
    return self.parent[position // self.k]


def each_k(ds, k: int):
  """A grain MapDataset holding each element of ``ds`` at k consecutive
  positions: the images of a ``captions_per_image`` stream, shuffled as
  whole images, so the k captions of one image land in one batch (a k that
  divides the micro-batch keeps them in one micro-batch too)."""
  n = len(ds)
  return grain.MapDataset.range(n if n >= sys.maxsize else n * k).map(
      _CopyOf(ds, k))


class _Sequence:
  """A sequence as a random-access source for grain: the compact examples
  of a small dataset held in memory (synthetic_shapes: decoded once instead
  of once per epoch; decoding is most of the per-example cost), or the
  example indices of one process's shard."""

  def __init__(self, items):
    self._items = items

  def __len__(self):
    return len(self._items)

  def __getitem__(self, index):
    return self._items[index]


# Consecutive stream positions travel together (stacked where they are read,
# in a reader thread or a worker process): one hand-over per chunk, not per
# example, is what lets worker processes scale past a few cores.
CHUNK = 64
# Encoded images (a batch decoder's elements, ~28 KB at 256 px against
# 196 KB decoded) in larger chunks: each chunk's shared-memory segments cost
# the training process ~2 ms to open, close and unlink, which at 64 of them
# was most of its time per image (2 workers on 2 VM cores, bench_data
# --bytes_only: 26.6 us per image at 64, 16.1 at 256, 14.0 at 512, 13.4 at
# 1024). Pixels stay at CHUNK: the host memory held ahead grows with the
# chunk (worker_buffers).
CHUNK_ENCODED = 512


def worker_buffers(read_options, num_workers: int):
  """(read options inside a worker, per-worker buffer) for num_workers
  worker processes, from the pipeline's read options, whose
  prefetch_buffer_size is the chunks to hold ahead in all (prefetch_batches
  micro-batches).

  A worker holds about inner + 1 chunks of its own (its reader threads' buffer
  and the one it is handing over), and each worker's share of the rest twice:
  grain's queue from the worker and the main process's thread that empties it
  each buffer per_worker chunks. Together about prefetch_buffer_size +
  4 * num_workers chunks, whatever the number of workers: the host memory the
  input holds ahead is bounded by the micro-batch size, not the batch size.
  (A worker reading ahead by the whole prefetch_buffer_size, as the
  threads-only pipeline does, would hold num_workers times that.)
  """
  threads = read_options.num_threads
  inner = grain.ReadOptions(num_threads=threads,
                            prefetch_buffer_size=max(2, threads))
  per_worker = max(1, -(-read_options.prefetch_buffer_size
                        // (2 * num_workers)))
  return inner, per_worker


# The keys of a micro-batch that hold most of its bytes.
_LARGE = ("image", "image_emb")


class _Buffers:
  """Reused arrays for the micro-batches' images.

  A fresh 1.6 GB array per micro-batch (8192 images of 256 px) costs the
  main process more in page faults than the copy into it: on the input's
  critical path, where it competes with the decoding workers for cores. An
  array is handed out again only once nothing outside this pool refers to it
  (the caller dropped the micro-batch, and any device transfer or zero-copy
  device array that held it is gone), so a micro-batch kept by the caller is
  never overwritten. At most ``size`` arrays are kept; beyond that (a caller
  holding many micro-batches) fresh ones are made.
  """

  def __init__(self, size: int = 4):
    self._size, self._arrays = size, []

  def empty(self, shape: tuple, dtype) -> np.ndarray:
    for i in range(len(self._arrays)):
      a = self._arrays[i]
      # 3 = this list, ``a`` and getrefcount's argument: nobody else.
      if a.shape == shape and a.dtype == dtype and sys.getrefcount(a) == 3:
        return a
      del a
    a = np.empty(shape, dtype)
    self._arrays = [b for b in self._arrays
                    if b.shape == shape and b.dtype == dtype]
    if len(self._arrays) < self._size:
      self._arrays.append(a)
    return a


def _stack(values: list) -> np.ndarray:
  if isinstance(values[0], (bytes, str)):
    # Encoded images and keys as objects: np.stack would pad them all to
    # the longest (and strip trailing NUL bytes).
    out = np.empty(len(values), object)
    out[:] = values
    return out
  return np.stack(values)


def _pack(items: list, flat: bool = False, store=None) -> dict:
  """(position, element or Bad) x n -> one chunk: the good elements stacked,
  which local positions were good, and the bad ones named.

  With ``flat`` (in a worker process) the encoded images travel as one
  uint8 array and their ends (``_unflatten`` takes them apart): grain hands
  numpy arrays over in shared memory but pickles objects through a pipe
  (the training process's time per 256 px JPEG from 2 workers: 34 us
  pickled, 25 flat; benchmarks/bench_data.py --bytes_only).
  """
  good = np.array([not isinstance(e, Bad) for _, e in items])
  elements = [e for _, e in items if not isinstance(e, Bad)]
  arrays = None
  if elements:
    flat = flat and "encoded" in elements[0]
    arrays = {k: _stack([e[k] for e in elements]) for k in elements[0]
              if not (flat and k == "encoded")}
    if flat:
      encoded = [e["encoded"] for e in elements]
      arrays["encoded_ends"] = np.cumsum([len(b) for b in encoded],
                                         dtype=np.int64)
      arrays["encoded_flat"] = np.frombuffer(b"".join(encoded), np.uint8)
  # Retries of the source's remote reads in this process (a worker's travel
  # with its chunk to the training process's ledger: data/retries).
  return {"pos0": items[0][0], "good": good, "arrays": arrays,
          "retries": store.take_retries() if store is not None else 0,
          "bad": [(i, e.where, e.reason) for i, (_, e) in enumerate(items)
                  if isinstance(e, Bad)]}


def _tag(position: int, index: int) -> tuple:
  """A remote source's stream element before it is read: (position, the
  example's index)."""
  return (position, int(index))


class _ReadChunk:
  """(position, index) x n -> (position, element or Bad) x n: the examples
  of a chunk read together (``Compact.many``; an index met twice, as the k
  copies of ``each_k``, read once), then finalized one by one. The elements
  are those of ``finalize(p, compact(i))``: the stream of the per-example
  path, bitwise."""

  def __init__(self, compact, finalize, parallelism: int):
    self.compact, self.finalize = compact, finalize
    self.parallelism = parallelism

  def __call__(self, items: list) -> list:
    unique = list(dict.fromkeys(i for _, i in items))
    got = dict(zip(unique, self.compact.many(unique, self.parallelism)))
    return [self.finalize(p, got[i]) for p, i in items]


class _Pack:
  """grain's batch_fn: a chunk of (position, element or Bad) -> ``_pack``;
  with ``read_chunk`` (a remote source, ``_ReadChunk``) the chunk's
  examples are read first, so that their retries travel with it. ``store``
  is the source's (its copy in a worker process: pickled with the source,
  one object)."""

  def __init__(self, store, flat: bool, read_chunk=None):
    self.store, self.flat, self.read_chunk = store, flat, read_chunk

  def __call__(self, items: list) -> dict:
    if self.read_chunk is not None:
      items = self.read_chunk(items)
    return _pack(items, flat=self.flat, store=self.store)


def _unflatten(chunk: dict) -> dict:
  """A chunk packed ``flat`` with its encoded images as bytes again."""
  arrays = chunk["arrays"]
  if arrays and "encoded_flat" in arrays:
    # A memoryview: slices of grain's shared-memory array subclass run
    # Python code each.
    flat = memoryview(arrays.pop("encoded_flat").view(np.ndarray))
    ends = arrays.pop("encoded_ends").tolist()
    arrays["encoded"] = _stack([bytes(flat[a:b])
                                for a, b in zip([0] + ends[:-1], ends)])
  return chunk


class _ReadAhead:
  """Chunks taken out of a grain iterator ``ahead`` at a time, on a thread.

  What a batch decoder's thread would otherwise do before each decode:
  wait for the workers' next chunk, open its shared memory and make its
  encoded images bytes again (``_unflatten``). The chunks are the
  iterator's, in its order, so the stream and the state (the position
  consumed by ``take``) are those without it; what is ahead is dropped by
  ``close``.
  """

  def __init__(self, iterator, ahead: int):
    self._queue = queue.Queue(maxsize=max(1, ahead))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(iterator,),
                                    daemon=True, name="decode-read-ahead")
    self._thread.start()

  def _run(self, iterator):
    while not self._stop.is_set():
      try:
        item = (_unflatten(next(iterator)), None)
      except BaseException as e:  # pylint: disable=broad-except
        item = (None, e)  # raised where the chunk would have been
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[1] is not None:
        return

  def next(self) -> dict:
    chunk, error = self._queue.get()
    if error is not None:
      raise error
    return chunk

  def close(self, timeout_s: float = 60.0):
    """Stops the thread: at once when it waits for room, after the chunk it
    waits for otherwise (given up after ``timeout_s``: a daemon thread)."""
    self._stop.set()
    deadline = time.monotonic() + timeout_s
    while self._thread.is_alive() and time.monotonic() < deadline:
      try:  # a put waiting for room sees the stop within 0.1 s
        self._queue.get_nowait()
      except queue.Empty:
        pass
      self._thread.join(timeout=0.05)


class TrainIterator(CountsBadData):
  """Infinite, deterministic, resumable iterator of per-process micro-batches.

  Yields {"image": uint8 [m, S, S, 3] (S = ``host_size``; or "image_emb":
  float32 [m, D] from precomputed embeddings), "text": int32 [m, L],
  "label": int32 [m] (-1 without labels), with groups also "group": int32
  [m]} as numpy arrays, m = microbatch_size; a step takes
  batch_size // microbatch_size of them in a row (``next_batch``).

  ``bad`` counts the distinct examples skipped so far (those found while
  opening the source included; one bad when read is skipped in every epoch
  but counted once), ``seen`` the distinct examples looked at.
  """

  def __init__(self, dataset, read_options, fingerprint: dict, *,
               microbatch_size: int, ledger: BadDataLedger,
               num_workers: int = 0, chunk: int = CHUNK,
               read_ahead: int = 0, read_chunk=None, store=None,
               same_dataset=None):
    # grain MapDataset of (position, element); with ``read_chunk`` (a
    # remote source, ``_ReadChunk``) of (position, example index), each
    # chunk's examples read together by it.
    self._dataset = dataset
    self._read_chunk = read_chunk
    self._store = store  # The source's remote.Store (None: a local source).
    self._read_options = read_options
    self._num_workers = num_workers
    self._chunk_size = chunk
    self._fingerprint = fingerprint
    # The source's test of a saved "dataset" written otherwise (embeddings
    # named by their directory before: train/data/sources/embeddings.py).
    self._same_dataset = same_dataset
    self.microbatch_size = microbatch_size
    self.ledger = ledger
    self._iter = None
    # With read_ahead > 0 a thread takes that many chunks ahead out of grain
    # (the workers' shared memory) into a queue (``_ReadAhead``).
    self._read_ahead, self._ahead = read_ahead, None
    self._next_position = 0
    self._chunk = None  # The chunk being consumed, and the cursor in it.
    self._cursor = 0
    self._buffers = _Buffers()

  def _ensure_iter(self):
    if self._iter is None:
      if self._store is not None:
        self._store.resume()  # After a close (a restored state, say).
      # Elements are indexed by position, so resuming is slicing: no reliance
      # on the format of grain's own iterator state.
      batch_fn = _Pack(self._store, flat=bool(self._num_workers),
                       read_chunk=self._read_chunk)
      ds = self._dataset[self._next_position:].batch(self._chunk_size,
                                                     batch_fn=batch_fn)
      if not self._num_workers:
        ds = ds.to_iter_dataset(self._read_options)
      else:
        # Worker processes, each on a slice of the positions, interleaved
        # back in order: the stream is the same for any number of workers
        # (the pipeline has no filter; a bad example is an element too).
        if not flags.FLAGS.is_parsed():
          # grain reads absl flags in its workers (defaults when not parsed,
          # e.g. outside train.main).
          flags.FLAGS.mark_as_parsed()
        inner, per_worker = worker_buffers(self._read_options,
                                           self._num_workers)
        ds = ds.to_iter_dataset(inner).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=self._num_workers,
                                         per_worker_buffer_size=per_worker))
      self._iter = iter(ds)
      if self._read_ahead:
        self._ahead = _ReadAhead(self._iter, self._read_ahead)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    """The next micro-batch: the next ``microbatch_size`` good examples of
    the stream; the bad ones passed on the way are counted (exactly those
    before the last example taken, so a resumed stream counts the same)."""
    out = self.take(self.microbatch_size)
    self.ledger.add_good(self.microbatch_size)
    return out

  def take(self, n: int) -> dict:
    """The next ``n`` good examples, stacked, the bad ones before the last
    counted; the good ones are not counted (``__next__`` does; a batch
    decoder first drops the ones that do not decode)."""
    self._ensure_iter()
    need, parts = n, []
    while need:
      if self._chunk is None or self._cursor >= len(self._chunk["good"]):
        self._chunk = (self._ahead.next() if self._ahead is not None
                       else _unflatten(next(self._iter)))
        self._cursor = 0
        # The chunk's retries, and the training process's own since the
        # last chunk (with workers: its reads while opening the source).
        self.ledger.add_retries(self._chunk["retries"] + (
            self._store.take_retries() if self._store is not None else 0))
      chunk, k = self._chunk, self._cursor
      good = chunk["good"]
      ahead = np.flatnonzero(good[k:]) + k  # local positions of goods
      take = ahead[:need]
      end = take[-1] + 1 if len(take) == need else len(good)
      for i, where, reason in chunk["bad"]:
        if k <= i < end:
          self.ledger.add_bad(where, reason)
      if len(take):
        rank0 = int(np.count_nonzero(good[:take[0]]))
        parts.append({key: v[rank0:rank0 + len(take)]
                      for key, v in chunk["arrays"].items()})
      need -= len(take)
      self._cursor = int(end)
      self._next_position = chunk["pos0"] + self._cursor
      self.ledger.check()
    out = {}
    for key, first in parts[0].items():
      shape = (n, *first.shape[1:])
      # The images are most of the bytes: they go into a reused buffer
      # (see _Buffers); the rest is small.
      buf = (self._buffers.empty(shape, first.dtype) if key in _LARGE
             else np.empty(shape, first.dtype))
      out[key] = np.concatenate([p[key] for p in parts], out=buf)
    return out

  def next_batch(self, num_microbatches: int) -> dict:
    """``num_microbatches`` micro-batches concatenated (a whole step)."""
    parts = [next(self) for _ in range(num_microbatches)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> dict:
    """JSON-serializable state: the next stream position, the bad-data
    counts and a fingerprint of the stream."""
    return {"next_position": self._next_position,
            "bad_data": self.ledger.state(), **self._fingerprint}

  def set_state(self, state: dict) -> None:
    """Continues from `state`; ValueError if it came from another stream."""
    mismatch = {k: (state.get(k), v) for k, v in self._fingerprint.items()
                if state.get(k) != v and not (
                    k == "dataset" and self._same_dataset is not None
                    and isinstance(state.get(k), str)
                    and self._same_dataset(state[k]))}
    if mismatch:
      detail = ", ".join(f"{k}: saved {a!r} != now {b!r}"
                         for k, (a, b) in sorted(mismatch.items()))
      raise ValueError("data iterator state does not match this input "
                       f"pipeline ({detail})")
    position = int(state["next_position"])
    if position < 0:
      raise ValueError(f"data iterator state next_position={position} < 0")
    self._next_position = position
    self.ledger.set_state(state["bad_data"])
    # Drop a running iterator (and its prefetched elements); the next
    # __next__ starts a fresh one at the restored position.
    self.close()

  def close(self):
    if self._store is not None:
      # Its reads stop (remote.Cancelled), those in flight too: the
      # read-ahead thread stops at once, not after the outage budget.
      self._store.cancel()
    if self._ahead is not None:
      self._ahead.close()  # before the grain iterator it reads
      self._ahead = None
    if self._iter is not None and hasattr(self._iter, "close"):
      self._iter.close()  # Stops worker processes.
    self._iter = None
    self._chunk, self._cursor = None, 0


def make_train_iterator(config, *, batch_size: int, process_index: int = 0,
                        process_count: int = 1, seed: int = 0,
                        tokenizer=None, microbatch_size: int = 0,
                        source=None, groups: str = "none",
                        captions_per_image: int = 1,
                        batch_decoder=None,
                        batch_sharding=None) -> TrainIterator:
  """The training iterator of config.data for one process.

  Args:
    config: the full config (`data` and `tokenizer` sections).
    batch_size: per-process batch size (of one step).
    process_index, process_count: this process's shard: examples
      process_index, process_index + process_count, ... of the source, so
      processes read disjoint data that together cover it.
    seed: shuffling and caption-sampling seed.
    tokenizer: defaults to make_tokenizer(config).
    microbatch_size: per-process micro-batch the iterator yields (it must
      divide batch_size); 0 = whole batches.
    source: an opened source (default: ``sources.open_source(config.data,
      config.data.split)``), e.g. precomputed embeddings.
    groups: ``config.loss.groups``: "none", or "image" / "content": each
      micro-batch also carries "group" (int32 [m]), the example's image id
      or content id (precomputed embeddings only), for the loss's
      ``groups=``.
    captions_per_image: ``config.captions_per_image``: each image at k
      consecutive stream positions with distinct captions (``each_k``).
    batch_decoder: decodes each micro-batch's encoded images in one call
      (train/data/decode/choice.py); default: config.data.decoder's ("host":
      none, every example decoded where it is read; "auto": by the image
      tower of config.model). With one, the iterator is a
      ``batching.Prefetch`` of a ``batching.DecodedIterator``.
    batch_sharding: with a batch decoder, the sharding of each
      micro-batch's images, each local device decoding its rows (default:
      the trainer's, ``batching.data_sharding``).
  """
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  microbatch_size = microbatch_size or batch_size
  if batch_size % microbatch_size:
    raise ValueError(f"microbatch_size={microbatch_size} must divide "
                     f"batch_size={batch_size}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in "
                     f"[0, process_count={process_count})")
  data = config.data
  tokenizer = tokenizer or tokenizer_lib.make_tokenizer(config)
  if source is None:
    source = sources.open_source(data, data.split)
  if len(source) < process_count:
    raise ValueError(f"{source.spec} has {len(source)} examples, fewer "
                     f"than process_count={process_count}")
  check_groups(source, groups)
  k = captions_per_image
  if not (isinstance(k, int) and k >= 1):
    raise ValueError(f"config.captions_per_image={k!r} must be an int >= 1")
  if batch_decoder is None:
    batch_decoder = choice.make_batch_decoder(data, source,
                                              config.get("model"))
  compact = Compact(source, host_size(data), decode=batch_decoder is None)
  shard = range(process_index, len(source), process_count)
  precomputed = sources.kind_of(source.spec) == "embeddings"
  example_bytes = (4 * source.dim if precomputed
                   else host_size(data) ** 2 * 3)
  # A remote source's examples are read a chunk at a time, concurrently
  # (``_ReadChunk``); a local one's one by one where grain asks for them.
  parallelism = (data.get("remote_parallelism", remote.DEFAULT_PARALLELISM)
                 if getattr(source, "is_remote", False) else 0)
  read_chunk = None
  finalize = Finalize(tokenizer, seed=seed, stream=process_index,
                      groups=groups, captions_per_image=k)
  if len(shard) * example_bytes <= data.cache_max_mb * 2**20:
    ds = grain.MapDataset.source(_Sequence(
        _read_all(compact, shard, data.num_threads, parallelism)))
  elif parallelism:
    # The stream of example indices: shuffled and repeated as the examples
    # themselves would be (map commutes with shuffle and repeat).
    ds = grain.MapDataset.source(_Sequence(shard))
    read_chunk = _ReadChunk(compact, finalize, parallelism)
  else:
    ds = grain.MapDataset.source(_Sequence(shard)).map(compact)
  ds = ds.shuffle(seed=seed).repeat(None)
  if k > 1:
    ds = each_k(ds, k)
  ds = ds.map_with_index(_tag if read_chunk is not None else finalize)
  chunk = CHUNK if batch_decoder is None else CHUNK_ENCODED
  read_options = grain.ReadOptions(
      num_threads=data.num_threads,
      prefetch_buffer_size=max(
          2, max(1, data.prefetch_batches) * microbatch_size // chunk))
  # A process's share of the bad examples found while opening.
  bad_open = source.bad_at_open[process_index::process_count]
  # Counted once each, over this process's share: its examples and the
  # bad ones found while opening (train/data/ledger.py).
  corpus = len(shard) + len(bad_open)
  ledger = BadDataLedger(data.max_bad_fraction,
                         min_seen=start_of_check(corpus),
                         corpus_size=corpus, copies=k)
  for where, reason in bad_open:
    ledger.add_bad(where, reason)
  ledger.check()
  # Embeddings are named by their content (a moved workdir resumes).
  fingerprint = {"dataset": getattr(source, "stream_spec", source.spec),
                 "num_examples": len(source),
                 "process_index": process_index,
                 "process_count": process_count, "seed": seed,
                 "image_size": data.image_size,
                 "decode_size": data.decode_size,
                 "max_len": tokenizer.max_len}
  if k > 1:  # Another stream (a k of 1 leaves older states valid).
    fingerprint["captions_per_image"] = k
  it = TrainIterator(ds, read_options, fingerprint,
                     microbatch_size=microbatch_size, ledger=ledger,
                     num_workers=data.num_workers, chunk=chunk,
                     read_ahead=(data.get("gpu_decoder_read_ahead", 0)
                                 if batch_decoder is not None else 0),
                     read_chunk=read_chunk,
                     store=getattr(source, "store", None),
                     same_dataset=getattr(source, "same_stream", None))
  if batch_decoder is None:
    return it
  return batching.Prefetch(
      batching.DecodedIterator(it, batch_decoder, host_size(data),
                               sharding=batch_sharding),
      depth=max(1, data.prefetch_batches))


def check_groups(source, groups: str) -> None:
  """One-line ValueError when ``source`` cannot give the ids of ``groups``."""
  if groups not in ("none", *GROUP_IDS):
    raise ValueError(f"config.loss.groups must be 'none', 'image' or "
                     f"'content', got {groups!r}")
  if groups == "content" and not getattr(source, "has_content_ids", False):
    raise ValueError(
        f"config.loss.groups='content' needs precomputed embeddings with "
        f"content ids (written by `python -m train.precompute`, or "
        f"config.precompute_image_embeddings=True); {source.spec} has none")
  if groups == "image" and getattr(source, "has_image_ids", True) is False:
    raise ValueError(
        f"config.loss.groups='image': the embeddings {source.spec} were "
        "written without image ids; recompute them with `python -m "
        "train.precompute` into a new directory")


def _read_all(compact, shard: range, num_threads: int,
              parallelism: int = 0) -> list:
  """compact(i) for every i of the shard, in order, on reader threads (a
  remote source's, with ``parallelism``, a chunk's reads at a time)."""
  if parallelism:
    step = max(CHUNK_ENCODED, parallelism)
    return [c for a in range(0, len(shard), step)
            for c in compact.many(shard[a:a + step], parallelism)]
  with concurrent.futures.ThreadPoolExecutor(max(1, num_threads)) as pool:
    return list(pool.map(compact, shard, chunksize=64))
