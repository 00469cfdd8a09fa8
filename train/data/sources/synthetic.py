"""synthetic_shapes: a procedurally rendered image-caption dataset.

Each image is a colored shape (8 shapes x 8 colors, 3 sizes, 3x3 positions)
drawn with Pillow on one of 3 backgrounds with a brightness gradient and pixel
noise; each caption describes it compositionally ("a small red circle on the
left") through several templates and synonyms. Everything is a pure function
of (seed, split, index), so the dataset is the same on every machine.

Held out for evaluation, never seen in training:
  * 16 of the 64 (shape, color) combinations: shape i never appears in
    training with colors i and i + 4 (mod 8); the `test` split contains only
    these combinations.
  * the zero-shot prompt templates (`ZEROSHOT_TEMPLATES`), which name only the
    shape ("a photo of a star."): no training caption uses them.
So zero-shot shape classification on `test` measures transfer to new
attribute combinations and new phrasings (chance: 1/8).

The dataset is written as a TFDS dataset (array_record files) into a data
directory by `prepare()`, then read back by the same TFDS data-source code
path as any other TFDS dataset (see tfds.py).
"""

import contextlib
import csv
import fcntl
import functools
import io
import json
import logging
import os
import shutil
import tarfile

import numpy as np
from PIL import Image
from PIL import ImageDraw

NAME = "synthetic_shapes"
# Bump on any change of the generated content: prepared copies are cached by
# version, so stale data is never reused.
VERSION = "1.1.0"

SHAPES = ("circle", "square", "triangle", "star", "diamond", "cross",
          "hexagon", "ring")
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 220, 50),
    "purple": (150, 60, 200),
    "orange": (245, 140, 30),
    "cyan": (40, 205, 215),
    "white": (240, 240, 240),
}
COLOR_NAMES = tuple(COLORS)
BACKGROUNDS = {"black": (15, 15, 20), "gray": (115, 115, 115),
               "brown": (85, 55, 35)}
BACKGROUND_NAMES = tuple(BACKGROUNDS)
SIZES = ("small", "medium", "large")
# Diameter as a fraction of the image side.
_SIZE_FRACTION = {"small": 0.32, "medium": 0.46, "large": 0.62}
HPOS = ("left", "center", "right")
VPOS = ("top", "middle", "bottom")

_SIZE_WORDS = {"small": ("small", "tiny", "little"),
               "medium": ("medium", "medium-sized", "mid-sized"),
               "large": ("large", "big", "huge")}

# Training caption templates. Placeholders: {a} is "a"/"an" for the word that
# follows it; {size} {color} {shape} {pos} {bg} the attributes, {size} and
# {pos} drawn from synonyms ("tiny", "in the top left corner", ...).
TRAIN_TEMPLATES = (
    "{a} {size} {color} {shape} {pos}",
    "{a} {color} {shape} {pos} on a {bg} background",
    "{pos}, {a} {size} {color} {shape}",
    "{a} {shape} that is {color}",
    "the {color} {shape} is {size}",
    "{a} {size} {shape} {pos}",
    "there is {a} {color} {shape} {pos}",
    "{color} {shape}, {size}, {bg} background",
    "{a} {shape} {pos}",
)
# Canonical caption of a test image, used for retrieval (one per image).
RETRIEVAL_TEMPLATE = "{a} {size} {color} {shape} {pos} on a {bg} background"
# Held-out prompt templates for zero-shot classification ({} = shape name).
ZEROSHOT_TEMPLATES = (
    "a photo of a {}.",
    "a rendering of the {}.",
    "an image containing a {}.",
    "this is a {}.",
)

CAPTIONS_PER_TRAIN_IMAGE = 3
_SUPERSAMPLE = 4  # draw at 4x and box-filter down: anti-aliased edges
_SPLIT_CODES = {"train": 1, "test": 2}


def is_heldout(shape: int, color: int) -> bool:
  """Whether the (shape, color) combination is reserved for evaluation.

  Each shape loses 2 of its 8 colors and each color 2 of its 8 shapes, so
  neither attribute alone reveals whether an image is held out.
  """
  return color in (shape % 8, (shape + 4) % 8)


@functools.lru_cache(maxsize=None)
def _allowed_combos(split: str) -> tuple[tuple[int, int], ...]:
  want_heldout = split == "test"
  return tuple((s, c) for s in range(len(SHAPES)) for c in range(len(COLORS))
               if is_heldout(s, c) == want_heldout)


def _pick(options, rng, canonical=False):
  """One of `options`: the first if canonical, else a random one."""
  return options[0] if canonical else options[int(rng.integers(len(options)))]


def _pos_phrases(v: str, h: str) -> tuple[str, str]:
  if v == "middle" and h == "center":
    return ("in the center", "in the middle")
  if v == "middle":
    return (f"on the {h}", f"on the {h} side")
  if h == "center":
    return (f"at the {v}", f"near the {v}")
  return (f"in the {v} {h}", f"in the {v} {h} corner")


def _article(word: str) -> str:
  return "an" if word[0] in "aeiou" else "a"


def _fill(template: str, attrs: dict, rng, canonical: bool = False) -> str:
  size = _pick(_SIZE_WORDS[attrs["size"]], rng, canonical)
  pos = _pick(_pos_phrases(attrs["vpos"], attrs["hpos"]), rng, canonical)
  words = dict(size=size, color=attrs["color"], shape=attrs["shape"], pos=pos,
               bg=attrs["bg"])
  # The article agrees with whatever word follows "{a} ".
  if "{a} " in template:
    follow = template.split("{a} ", 1)[1].split(" ", 1)[0]
    words["a"] = _article(follow.format(**words))
  return template.format(**words)


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float):
  """Vertices of a regular-ish polygon shape, in canvas pixels."""
  def ring(n, radius, phase, rx=1.0):
    t = phase + angle + np.arange(n) * 2 * np.pi / n
    return np.stack([cx + rx * radius * np.cos(t), cy + radius * np.sin(t)], 1)
  if shape == "square":
    pts = ring(4, r, np.pi / 4)
  elif shape == "triangle":
    pts = ring(3, r, -np.pi / 2)
    pts[:, 1] += 0.2 * r  # center the triangle's bounding box vertically
  elif shape == "diamond":
    pts = ring(4, r, 0.0, rx=0.65)
  elif shape == "hexagon":
    pts = ring(6, r, 0.0)
  elif shape == "star":
    outer, inner = ring(5, r, -np.pi / 2), ring(5, 0.45 * r, -np.pi / 2 + np.pi / 5)
    pts = np.stack([outer, inner], 1).reshape(10, 2)
  elif shape == "cross":
    w = 0.34 * r
    base = np.array([(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w),
                     (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w)])
    c, s = np.cos(angle), np.sin(angle)
    pts = base @ np.array([[c, s], [-s, c]]) + np.array([cx, cy])
  else:
    raise ValueError(f"no polygon for shape {shape!r}")
  return [tuple(p) for p in pts]


@functools.lru_cache(maxsize=8)
def _unit_grid(size: int):
  yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
  return yy / size - 0.5, xx / size - 0.5


def render_example(seed: int, split: str, index: int, image_size: int):
  """Renders one example: (uint8 image [S, S, 3], attribute dict, rng).

  Pure function of its arguments, so examples can be generated in any order
  (or in parallel) with identical results.
  """
  rng = np.random.default_rng([seed, _SPLIT_CODES[split], index])
  combos = _allowed_combos(split)
  shape_id, color_id = combos[rng.integers(len(combos))]
  attrs = dict(shape=SHAPES[shape_id], color=COLOR_NAMES[color_id],
               size=SIZES[rng.integers(3)], hpos=HPOS[rng.integers(3)],
               vpos=VPOS[rng.integers(3)], bg=BACKGROUND_NAMES[rng.integers(3)],
               shape_id=shape_id, color_id=color_id)
  # Background at the final resolution: base color plus a random linear
  # brightness gradient.
  bg = np.array(BACKGROUNDS[attrs["bg"]], np.float32)
  yy, xx = _unit_grid(image_size)
  gdir = rng.normal(size=2)
  grad = (xx * gdir[0] + yy * gdir[1]) * rng.uniform(10, 40)
  background = bg[None, None] + grad[..., None]
  # The shape is drawn as a coverage mask at 4x and box-filtered down, which
  # anti-aliases its edges; then it is alpha-composited over the background.
  big = image_size * _SUPERSAMPLE
  mask = Image.new("L", (big, big), 0)
  draw = ImageDraw.Draw(mask)
  diameter = _SIZE_FRACTION[attrs["size"]] * rng.uniform(0.9, 1.1) * big
  r = diameter / 2
  # Nominal cell center, jittered, then clamped so the shape stays inside.
  cx = (0.2 + 0.3 * HPOS.index(attrs["hpos"]) + rng.uniform(-0.04, 0.04)) * big
  cy = (0.2 + 0.3 * VPOS.index(attrs["vpos"]) + rng.uniform(-0.04, 0.04)) * big
  cx, cy = np.clip([cx, cy], r + 1, big - r - 1)
  color = np.clip(np.array(COLORS[attrs["color"]]) + rng.integers(-18, 19, 3),
                  0, 255).astype(np.float32)
  angle = rng.uniform(-0.25, 0.25)  # radians; small, so square != diamond
  shape = attrs["shape"]
  if shape in ("circle", "ring"):
    draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
    if shape == "ring":
      ri = 0.55 * r
      draw.ellipse([cx - ri, cy - ri, cx + ri, cy + ri], fill=0)
  else:
    draw.polygon(_polygon(shape, cx, cy, r, angle), fill=255)
  alpha = np.asarray(mask.reduce(_SUPERSAMPLE), np.float32)[..., None] / 255
  small = background * (1 - alpha) + color[None, None] * alpha
  small += rng.normal(0, rng.uniform(2, 10), small.shape)
  return np.clip(np.round(small), 0, 255).astype(np.uint8), attrs, rng


def make_captions(attrs: dict, rng, split: str) -> list[str]:
  """Captions of one example: random training templates, or the canonical one.

  Train images get CAPTIONS_PER_TRAIN_IMAGE captions from distinct templates
  (the pipeline samples one per epoch); test images get the canonical
  retrieval caption first.
  """
  if split == "test":
    return [_fill(RETRIEVAL_TEMPLATE, attrs, rng, canonical=True)]
  picks = rng.choice(len(TRAIN_TEMPLATES), CAPTIONS_PER_TRAIN_IMAGE,
                     replace=False)
  return [_fill(TRAIN_TEMPLATES[int(t)], attrs, rng) for t in picks]


def generate_examples(seed: int, split: str, num: int, image_size: int):
  """Yields (key, example) pairs in the TFDS feature layout of the builder."""
  for i in range(num):
    image, attrs, rng = render_example(seed, split, i, image_size)
    yield i, {
        "image": image,
        "captions": {"text": make_captions(attrs, rng, split)},
        "label": attrs["shape_id"],
        "color": attrs["color_id"],
        "size": SIZES.index(attrs["size"]),
        "hpos": HPOS.index(attrs["hpos"]),
        "vpos": VPOS.index(attrs["vpos"]),
        "background": BACKGROUND_NAMES.index(attrs["bg"]),
    }


def config_name(image_size: int, num_train: int, num_test: int, seed: int):
  """TFDS config name: the generation parameters, so each lands separately."""
  return f"s{image_size}_n{num_train}_t{num_test}_seed{seed}"


def dataset_dir(data_dir, image_size, num_train, num_test, seed) -> str:
  """Where `prepare` writes the dataset (a TFDS dataset version directory)."""
  return os.path.join(os.fspath(data_dir), NAME,
                      config_name(image_size, num_train, num_test, seed),
                      VERSION)


def _make_builder_class():
  """Defines the TFDS builder lazily, so importing this module stays cheap."""
  # Lazy: TFDS takes ~0.4 s to import (train/data/sources/tfds.py).
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel

  class SyntheticShapes(tfds.core.GeneratorBasedBuilder):
    """TFDS builder of synthetic_shapes; parameters come from the config."""
    VERSION = tfds.core.Version(globals()["VERSION"])
    # Never touch the network: no GCS lookup of dataset info.
    _GCS_ENABLED = False

    def __init__(self, *, image_size, num_train, num_test, seed, **kwargs):
      self._params = (image_size, num_train, num_test, seed)
      config = tfds.core.BuilderConfig(
          name=config_name(image_size, num_train, num_test, seed),
          description="procedural shapes with compositional captions")
      super().__init__(config=config, **kwargs)

    def _info(self):
      image_size = self._params[0]
      label = lambda names: tfds.features.ClassLabel(names=list(names))
      return tfds.core.DatasetInfo(
          builder=self,
          description=__doc__,
          features=tfds.features.FeaturesDict({
              "image": tfds.features.Image(shape=(image_size, image_size, 3)),
              "captions": tfds.features.Sequence(
                  {"text": tfds.features.Text()}),
              "label": label(SHAPES),
              "color": label(COLOR_NAMES),
              "size": label(SIZES),
              "hpos": label(HPOS),
              "vpos": label(VPOS),
              "background": label(BACKGROUND_NAMES),
          }),
          supervised_keys=None)

    def _split_generators(self, dl_manager):
      del dl_manager  # nothing to download
      image_size, num_train, num_test, seed = self._params
      return {"train": self._generate_examples(seed, "train", num_train,
                                               image_size),
              "test": self._generate_examples(seed, "test", num_test,
                                              image_size)}

    def _generate_examples(self, seed, split, num, image_size):
      for key, ex in generate_examples(seed, split, num, image_size):
        # PNG bytes are stored as given, without TensorFlow (a numpy array
        # would go through tf.image.encode_png); fast zlib level: the noisy
        # pixels barely compress anyway.
        buf = io.BytesIO()
        Image.fromarray(ex["image"]).save(buf, format="png", compress_level=1)
        ex["image"] = buf.getvalue()
        yield key, ex

  return SyntheticShapes


_BUILDER_CLASS = None


def _remove_stale_partials(config_dir: str) -> None:
  """Deletes TFDS's temporary "incomplete.*" directories of a killed run.

  Called under the exclusive lock, so no other process is writing them.
  """
  if os.path.isdir(config_dir):
    for name in os.listdir(config_dir):
      if name.startswith("incomplete."):
        shutil.rmtree(os.path.join(config_dir, name), ignore_errors=True)


def prepare(data_dir, *, image_size: int, num_train: int, num_test: int,
            seed: int = 0) -> str:
  """Generates the dataset into `data_dir` once; returns its directory.

  Safe when several processes call it at once (a file lock serializes them;
  the later ones find the dataset ready).
  """
  global _BUILDER_CLASS
  path = dataset_dir(data_dir, image_size, num_train, num_test, seed)
  if os.path.exists(os.path.join(path, "dataset_info.json")):
    return path
  os.makedirs(data_dir, exist_ok=True)
  lock_path = os.path.join(os.fspath(data_dir), f".{NAME}.lock")
  with open(lock_path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if not os.path.exists(os.path.join(path, "dataset_info.json")):
        _remove_stale_partials(os.path.dirname(path))
        # Lazy: TFDS's, as in _make_builder_class.
        import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
        logging.info("Generating %s into %s (once; later runs reuse it)",
                     NAME, path)
        if _BUILDER_CLASS is None:
          _BUILDER_CLASS = _make_builder_class()
          # TFDS warns that a config not in BUILDER_CONFIGS is "custom": here
          # every config is generated from its parameters, by design.
          logging.getLogger("absl").addFilter(
              lambda r: "Using custom data configuration" not in r.getMessage())
        builder = _BUILDER_CLASS(image_size=image_size, num_train=num_train,
                                 num_test=num_test, seed=seed,
                                 data_dir=os.fspath(data_dir),
                                 file_format="array_record")
        # Generation takes seconds; TFDS's progress bars and its printed
        # "Downloading and preparing" lines (nothing is downloaded) are noise.
        tfds.disable_progress_bar()
        try:
          with contextlib.redirect_stdout(io.StringIO()):
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(
                    try_download_gcs=False))  # nothing to download: stay local
        finally:
          tfds.enable_progress_bar()
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return path



# ----------------------------------------------------------------- as files


def _encode(image: np.ndarray, fmt: str, quality: int) -> bytes:
  buf = io.BytesIO()
  if fmt in ("jpg", "jpeg"):
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
  else:
    Image.fromarray(image).save(buf, format=fmt.upper())
  return buf.getvalue()


def _tar_add(tar, name: str, data: bytes) -> None:
  info = tarfile.TarInfo(name)
  info.size = len(data)
  info.mtime = 0  # Reproducible shards.
  tar.addfile(info, io.BytesIO(data))


def write_webdataset(out_dir, *, split: str = "train", num: int,
                     image_size: int, seed: int = 0, shard_size: int = 64,
                     fmt: str = "jpg", quality: int = 95) -> str:
  """Writes synthetic_shapes as img2dataset-style webdataset shards.

  Each example is ``<key>.<fmt>``, ``<key>.txt`` (its first caption) and
  ``<key>.json`` ({"label": shape id, "captions": [...]}). Returns the brace
  pattern of the shards (for config.data.name after "webdataset:").
  """
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  num_shards = -(-num // shard_size)
  for s in range(num_shards):
    with tarfile.open(os.path.join(out_dir, f"{split}-{s:05d}.tar"),
                      "w", format=tarfile.USTAR_FORMAT) as tar:
      for i in range(s * shard_size, min(num, (s + 1) * shard_size)):
        image, attrs, rng = render_example(seed, split, i, image_size)
        captions = make_captions(attrs, rng, split)
        key = f"{i:09d}"
        _tar_add(tar, f"{key}.{fmt}", _encode(image, fmt, quality))
        _tar_add(tar, f"{key}.txt", captions[0].encode())
        _tar_add(tar, f"{key}.json", json.dumps(
            {"label": attrs["shape_id"], "captions": captions}).encode())
  return os.path.join(out_dir, f"{split}-{{{0:05d}..{num_shards - 1:05d}}}.tar")


def write_table(out_dir, *, split: str = "train", num: int, image_size: int,
                seed: int = 0, table: str = "csv", fmt: str = "jpg",
                quality: int = 95) -> str:
  """Writes synthetic_shapes as image files plus a csv/tsv/jsonl table of
  (image, caption, label) with paths relative to the table; returns the
  table's path."""
  out_dir = os.fspath(out_dir)
  os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
  rows = []
  for i in range(num):
    image, attrs, rng = render_example(seed, split, i, image_size)
    name = os.path.join("images", f"{split}-{i:09d}.{fmt}")
    with open(os.path.join(out_dir, name), "wb") as f:
      f.write(_encode(image, fmt, quality))
    rows.append({"image": name, "caption": make_captions(attrs, rng, split)[0],
                 "label": attrs["shape_id"]})
  path = os.path.join(out_dir, f"{split}.{table}")
  with open(path, "w", newline="", encoding="utf-8") as f:
    if table == "jsonl":
      for r in rows:
        f.write(json.dumps(r) + "\n")
    else:
      w = csv.DictWriter(f, fieldnames=["image", "caption", "label"],
                         delimiter="\t" if table == "tsv" else ",")
      w.writeheader()
      w.writerows(rows)
  return path


class JpegPool:
  """A source of ``num`` examples whose images are JPEG bytes, for benchmarks.

  ``pool`` distinct ``size`` x ``size`` photos-like images (smooth colour
  fields with texture, JPEG quality 90, about 20 KB at 256 px) are encoded
  once; example i carries pool image i % pool as encoded bytes, so the input
  pipeline decodes, resizes and crops every example as it would a web
  corpus, without gigabytes of shards on disk. Captions are short random
  word strings. Meets the source contract (train/data/sources/contract.py).
  """

  encoded_images = True  # JPEG bytes: config.data.decoder="gpu" takes them

  def __init__(self, num: int, *, size: int = 256, pool: int = 256,
               seed: int = 0):
    rng = np.random.default_rng(seed)
    self.spec = f"jpeg_pool:{num}x{size}px/{pool}/seed{seed}"
    self.bad_at_open = []
    self._num = num
    self._jpegs = []
    for _ in range(pool):
      low = rng.uniform(0, 255, (8, 8, 3)).astype(np.uint8)
      im = np.asarray(Image.fromarray(low).resize((size, size),
                                                  Image.BICUBIC), np.float32)
      im += rng.normal(0, 12, im.shape)
      buf = io.BytesIO()
      Image.fromarray(np.clip(im, 0, 255).astype(np.uint8)).save(
          buf, format="JPEG", quality=90)
      self._jpegs.append(buf.getvalue())
    words = ("a", "photo", "of", "the", "red", "small", "dog", "on", "grass",
             "city", "street", "at", "night", "two", "people", "blue")
    self._captions = [" ".join(rng.choice(words, 8)) for _ in range(pool)]

  def __len__(self):
    return self._num

  def describe(self) -> str:
    return self.spec

  def __getitem__(self, index: int) -> dict:
    j = index % len(self._jpegs)
    return {"key": f"{index:09d}", "image": self._jpegs[j],
            "captions": [self._captions[(j * 7 + index) % len(self._jpegs)]],
            "label": -1}
