"""The training input pipeline: TFDS array_record source -> grain -> batches.

    source (random access, one process's shard: examples p, p+P, p+2P, ...)
      -> map: decode, keep image/captions/label, resize + central crop to
         image_size (uint8); done once and kept in memory when the shard
         fits in cache_max_mb
      -> shuffle(seed) + repeat: a fresh permutation every epoch
      -> map_with_index: pick one caption (random per position, so it varies
         across epochs), tokenize, scale the image to [-1, 1]
      -> batch(per-process batch size)
      -> threaded prefetch

Each batch is a pure function of (seed, shard, batch index): grain computes
the permutation from the position alone and the caption pick is seeded by it.
The iterator's state is therefore just the next batch index (resuming slices
the batch dataset there), and
`set_state(get_state())` continues with bitwise the same batches as an
uninterrupted run, whatever the number of threads.
"""

import numpy as np

from train.data import sources
from train.data import tokenizer as tokenizer_lib


def resize_crop(image: np.ndarray, size: int) -> np.ndarray:
  """uint8 [H, W, C] -> uint8 [size, size, 3].

  Resizes the shorter side to `size` (bicubic, antialiased), then takes the
  central square crop; grayscale is repeated to RGB and alpha dropped.
  """
  image = np.asarray(image)
  if image.ndim == 2:
    image = image[..., None]
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  image = image[..., :3]
  h, w = image.shape[:2]
  if (h, w) != (size, size):
    from PIL import Image  # pylint: disable=import-outside-toplevel
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    image = np.asarray(Image.fromarray(image).resize(
        (nw, nh), Image.BICUBIC, reducing_gap=None if scale >= 1 else 2.0))
    top, left = (nh - size) // 2, (nw - size) // 2
    image = image[top:top + size, left:left + size]
  return np.ascontiguousarray(image, dtype=np.uint8)


def to_float(image: np.ndarray) -> np.ndarray:
  """uint8 -> float32 in [-1, 1]."""
  return image.astype(np.float32) * (2.0 / 255.0) - 1.0


def preprocess_image(image: np.ndarray, size: int) -> np.ndarray:
  """uint8 [H, W, C] -> float32 [size, size, 3] in [-1, 1] (resize_crop)."""
  return to_float(resize_crop(image, size))


def _as_text_list(value) -> list:
  if isinstance(value, (bytes, str)):
    return [value]
  return list(value)


class Compact:
  """A decoded TFDS example -> {"image": uint8 [S, S, 3], "captions", "label"}.

  Keeps only what training needs, at the final resolution, so a cached
  split costs S*S*3 bytes per example whatever the original image size.
  """

  def __init__(self, *, image_key, text_key, label_key, image_size):
    self.image_key, self.text_key, self.label_key = image_key, text_key, label_key
    self.image_size = image_size

  def __call__(self, example: dict) -> dict:
    return {
        "image": resize_crop(sources.value_at(example, self.image_key),
                             self.image_size),
        "captions": _as_text_list(sources.value_at(example, self.text_key)),
        "label": (int(sources.value_at(example, self.label_key))
                  if self.label_key else -1),
    }


class Finalize:
  """A compact example at stream position p -> {"image", "text", "label"}.

  Picks one caption (random, seeded by (seed, stream, p): it varies across
  epochs but is the same on every run), tokenizes it and scales the image.
  """

  def __init__(self, tokenizer, *, seed=0, stream=0, first_caption=False):
    self.tokenizer = tokenizer
    self.seed, self.stream, self.first_caption = seed, stream, first_caption

  def pick_caption(self, captions: list, position: int):
    if not captions:
      return b""
    if self.first_caption or len(captions) == 1:
      return captions[0]
    rng = np.random.default_rng([self.seed, self.stream, position])
    return captions[int(rng.integers(len(captions)))]

  def __call__(self, position: int, compact: dict) -> dict:
    caption = self.pick_caption(compact["captions"], position)
    return {"image": to_float(compact["image"]),
            "text": self.tokenizer.encode([caption])[0],
            "label": np.int32(compact["label"])}


class _InMemorySource:
  """Compact examples held in memory: a random-access source for grain.

  Small datasets (synthetic_shapes) are decoded once instead of once per
  epoch; decoding (protobuf parse + PNG) is most of the per-example cost.
  """

  def __init__(self, examples: list):
    self._examples = examples

  def __len__(self):
    return len(self._examples)

  def __getitem__(self, index):
    return self._examples[index]


def _read_compact(source, indices, compact, chunk: int = 256) -> list:
  out = []
  for start in range(0, len(indices), chunk):
    out.extend(compact(ex) for ex in
               source.__getitems__(list(indices[start:start + chunk])))
  return out


class TrainIterator:
  """Infinite, deterministic, resumable iterator of per-process batches.

  Yields {"image": float32 [b, H, W, 3] in [-1, 1], "text": int32 [b, L],
  "label": int32 [b] (-1 without labels)} as numpy arrays.
  """

  def __init__(self, dataset, read_options, fingerprint: dict):
    self._dataset = dataset  # grain MapDataset of batches (infinite)
    self._read_options = read_options
    self._fingerprint = fingerprint
    self._iter = None
    self._next_batch = 0

  def _ensure_iter(self):
    if self._iter is None:
      # Batches are indexed by position, so resuming is slicing: no reliance
      # on the format of grain's own iterator state.
      self._iter = iter(self._dataset[self._next_batch:].to_iter_dataset(
          self._read_options))

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    self._ensure_iter()
    batch = next(self._iter)
    self._next_batch += 1
    return batch

  def get_state(self) -> dict:
    """JSON-serializable state: the next batch index plus a fingerprint."""
    return {"next_batch": self._next_batch, **self._fingerprint}

  def set_state(self, state: dict) -> None:
    """Continues from `state`; ValueError if it came from another stream."""
    mismatch = {k: (state.get(k), v) for k, v in self._fingerprint.items()
                if state.get(k) != v}
    if mismatch:
      detail = ", ".join(f"{k}: saved {a!r} != now {b!r}"
                         for k, (a, b) in sorted(mismatch.items()))
      raise ValueError("data iterator state does not match this input "
                       f"pipeline ({detail})")
    next_batch = int(state["next_batch"])
    if next_batch < 0:
      raise ValueError(f"data iterator state next_batch={next_batch} < 0")
    self._next_batch = next_batch
    # Drop a running iterator (and its prefetched batches); the next
    # __next__ starts a fresh one at the restored position.
    self._iter = None

  def close(self):
    self._iter = None


def make_train_iterator(config, *, batch_size: int, process_index: int = 0,
                        process_count: int = 1, seed: int = 0,
                        tokenizer=None) -> TrainIterator:
  """The training iterator of config.data for one process.

  Args:
    config: the full config (`data` and `tokenizer` sections).
    batch_size: per-process batch size.
    process_index, process_count: this process's shard: examples
      process_index, process_index + process_count, ... of the split, so
      processes read disjoint data that together cover the split.
    seed: shuffling and caption-sampling seed.
    tokenizer: defaults to make_tokenizer(config).
  """
  import grain  # pylint: disable=import-outside-toplevel
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be >= 1")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} must be in "
                     f"[0, process_count={process_count})")
  data = config.data
  tokenizer = tokenizer or tokenizer_lib.make_tokenizer(config)
  builder = sources.builder_for(data)
  source = builder.as_data_source(split=data.split)
  if len(source) < process_count:
    raise ValueError(f"split {data.split!r} has {len(source)} examples, fewer "
                     f"than process_count={process_count}")
  compact = Compact(image_key=data.image_key, text_key=data.text_key,
                    label_key=data.label_key, image_size=data.image_size)
  shard = range(process_index, len(source), process_count)
  cache_bytes = len(shard) * data.image_size ** 2 * 3
  if cache_bytes <= data.cache_max_mb * 2**20:
    ds = grain.MapDataset.source(
        _InMemorySource(_read_compact(source, shard, compact)))
  else:
    ds = grain.MapDataset.source(source)[process_index::process_count]
    ds = ds.map(compact)
  ds = ds.shuffle(seed=seed).repeat(None)
  ds = ds.map_with_index(Finalize(tokenizer, seed=seed, stream=process_index))
  ds = ds.batch(batch_size, drop_remainder=True)
  read_options = grain.ReadOptions(num_threads=data.num_threads,
                                   prefetch_buffer_size=data.prefetch_batches)
  fingerprint = {"dataset": builder.info.full_name, "split": data.split,
                 "process_index": process_index,
                 "process_count": process_count, "seed": seed,
                 "batch_size": batch_size, "image_size": data.image_size,
                 "max_len": tokenizer.max_len}
  return TrainIterator(ds, read_options, fingerprint)

