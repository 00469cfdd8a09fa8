"""Data and tokenizer config defaults, and the early config check.

`default_data_config()` and `default_tokenizer_config()` are embedded by the
trainer configs as `config.data` and `config.tokenizer`. `check_data_config`
validates them (dataset present and prepared, feature keys, files) and raises
a single-line ValueError, so a bad config fails before any training starts.
"""

import ml_collections

from train.data.sources import remote
from train.data import sources
from train.data import tokenizer as tokenizer_lib
from train.data.decode import choice as decoder_choice
from train.eval import names as names_lib


def default_data_config() -> ml_collections.ConfigDict:
  """Defaults: the embedded synthetic_shapes dataset at 32x32. The keys, each
  with what it means, by concern: the training source, its images, the
  held-out sets, the input pipeline."""
  c = ml_collections.ConfigDict()
  _source_keys(c)
  _image_keys(c)
  _held_out_keys(c)
  _input_keys(c)
  return c


def _source_keys(c) -> None:
  """The training source, where it is stored, and its bad examples."""
  # The training source:
  #   "synthetic_shapes" (generated locally) or a TFDS dataset name,
  #     optionally with config and version: "coco_captions/2017:1.1.0";
  #   "webdataset:/data/shard-{000000..000127}.tar" (img2dataset's shards);
  #   "csv:/data/pairs.csv", "tsv:/data/pairs.tsv", "jsonl:/data/pairs.jsonl"
  #     (image path + caption per row, paths relative to the file);
  #   "embeddings:/dir" (precomputed by `python -m train.precompute`).
  c.name = "synthetic_shapes"
  # TFDS data directory. "" means: for synthetic_shapes $INFCL_DATA_DIR or
  # ~/.cache/infcl_jax/tfds (generated there on first use); for a TFDS name
  # $TFDS_DATA_DIR or ~/tensorflow_datasets (must already be prepared).
  c.data_dir = ""
  c.split = "train"
  # A TFDS split; for a file source, the held-out set as a source of its
  # own ("webdataset:/data/val-{0..3}.tar", "csv:/data/val.csv").
  c.eval_split = "test"
  # Feature keys; "/" walks nested features ("captions/text" is a sequence
  # of captions: training samples one per example and epoch).
  c.image_key = "image"
  c.text_key = "captions/text"
  # Integer class label feature; "" if the dataset has none (label = -1).
  c.label_key = "label"
  # webdataset: image member extensions in order of preference, the
  # caption member's extension, and the field of the .json member that
  # holds an integer label ("" = none). Labels are read from the held-out
  # shards (eval_split) for zero-shot, label i named by line i of the class
  # names; training ignores them.
  c.wds_image_exts = "jpg;jpeg;png;webp"
  c.wds_caption_ext = "txt"
  c.wds_label_field = ""
  # csv/tsv/jsonl: column names (a JSONL caption may be a list of captions);
  # the label column, like wds_label_field, serves zero-shot on eval_split.
  c.table_image_column = "image"
  c.table_caption_column = "caption"
  c.table_label_column = ""
  # Shards, tables and images on object storage (train/data/sources/remote.py;
  # the cloud extra): names and image paths may be fsspec URLs, s3://,
  # gs://, http(s)://. Credentials come from each store's environment
  # (AWS_*, GOOGLE_APPLICATION_CREDENTIALS); storage_options is JSON mapping
  # a protocol to fsspec options, e.g. '{"s3": {"endpoint_url":
  # "http://127.0.0.1:9000"}}' (botocore also reads AWS_ENDPOINT_URL). A
  # transient failure (5xx, timeout, refused or reset connection, truncated
  # body) is retried with backoff, said in one line per burst and counted
  # (data/retries), for up to remote_outage_s seconds (15 minutes) from the
  # request's first failure; past it the run saves the step reached and
  # exits 75 (requeue). A remote shard's tar index is kept in
  # shard_index_cache (a directory or a URL a rerun and other hosts share;
  # "" = ~/.cache/infcl_jax/shard_index, "none" = not kept).
  c.storage_options = ""
  c.remote_outage_s = 900.0
  # Remote examples read at once per process (1..256): a chunk's examples
  # are requested together, this many in flight, on a pool the reader
  # threads share (a chunk of n takes ~ceil(n / this) round trips).
  c.remote_parallelism = 32
  c.shard_index_cache = ""
  # Bad examples (undecodable image, empty caption, member without its pair,
  # truncated shard) are skipped and counted, once each; more than this
  # fraction of the examples seen stops the run, checked once min(1000,
  # corpus size) examples have been seen (per process: its share).
  c.max_bad_fraction = 0.01


def _image_keys(c) -> None:
  """The images' sizes, and the generated synthetic_shapes."""
  c.image_size = 32
  # 0: the host resizes (shorter side, bicubic) and centre-crops every image
  # to image_size. C >= image_size: the host delivers C x C (an image that
  # decodes at C x C, e.g. img2dataset's `--image_size 256 --resize_mode
  # center_crop`, gets no host work beyond the decode; others are resized and
  # cropped to C) and the device resizes C -> image_size per micro-batch
  # (train/towers/resize.py). Training only: evaluation resizes on the host.
  c.decode_size = 0
  # synthetic_shapes only: examples generated for train and test, and seed.
  c.num_train_examples = 4096
  c.synthetic_seed = 0


def _held_out_keys(c) -> None:
  """The held-out sets: retrieval on eval_split, zero-shot classification."""
  # Eval examples: the size of synthetic_shapes' test split; for a TFDS
  # dataset, the first N of eval_split (0 = all) used for retrieval.
  c.num_eval_examples = 512
  # Zero-shot classification set: "" uses eval_split of this dataset with
  # label_key (synthetic_shapes: held-out shape/color combinations), or for
  # a webdataset / table eval_split its integer labels (wds_label_field,
  # table_label_column) with zeroshot_classnames(_file); else a TFDS
  # classification dataset name (e.g. "cifar10") read from data_dir.
  # Without labels or class names the run says in one line why zero-shot
  # is skipped.
  c.zeroshot_name = ""
  c.zeroshot_split = "test"
  c.zeroshot_image_key = "image"
  c.zeroshot_label_key = "label"
  # Class names (train/eval/names.py): a list in label order, or a file (one
  # name per line, line i naming label i; or "label<TAB>name" lines keyed by
  # the dataset's label names, or by the integer labels of a file source);
  # both empty = the dataset's labels, WordNet IDs (imagenet2012) mapped to
  # CLIP's class names (a file source has none: it needs one of these).
  c.zeroshot_classnames = ()
  c.zeroshot_classnames_file = ""
  # Prompt templates with "{}" for the class name, a list or a file (one per
  # line); both empty = the dataset's default (synthetic_shapes: its
  # held-out templates; WordNet-ID labels: CLIP's 80 ImageNet prompts; else
  # CLIP's "a photo of a {}.").
  c.zeroshot_templates = ()
  c.zeroshot_templates_file = ""


def _input_keys(c) -> None:
  """The input pipeline: its threads and processes, where JPEGs are
  decoded, and the in-memory cache of small datasets."""
  # Input pipeline: reader (decode) threads, and micro-batches prefetched
  # ahead on the host.
  c.num_threads = 2
  # Worker processes decoding in parallel (grain's mp_prefetch), each with
  # num_threads readers; 0 = none (threads in this process only). Set it to
  # the cores to spare for a JPEG corpus (threads alone stop scaling at ~4),
  # less about 4: the main process needs cores of its own to take the
  # workers' chunks out of shared memory into micro-batches and to feed the
  # device (16 cores of an H200 host: 12 workers 10.3k img/s, 16 workers
  # 6.5k, benchmarks/bench_data.py).
  c.num_workers = 0
  # Micro-batches held ahead on the host, in all (workers included).
  c.prefetch_batches = 2
  # Where JPEGs are decoded (train/data/decode/choice.py): "host" (the reader
  # threads / workers; simplejpeg when installed, else Pillow), "gpu"
  # (nvImageCodec on the device, per micro-batch: the gpu-decode extra;
  # webdataset and table sources), "auto" (gpu where it can run and the
  # host cannot keep pace with the image tower, by measured rates).
  c.decoder = "host"
  # decoder="gpu": nvImageCodec's settings (train/data/decode/gpu.py
  # GpuBatchDecoder). The backend: "auto" (nvImageCodec's choice), "hw",
  # "hybrid", "cuda", or a mix with load hints ("hw:0.7,hybrid"); more of
  # its decoder options, space-separated ("nvjpeg_cuda_decoder:
  # hybrid_huffman_threshold=0" moves the Huffman stage of small JPEGs from
  # CPU threads to the GPU); its CPU threads (0 = one per core), which share
  # the host's cores with num_workers.
  c.gpu_decoder_backend = "auto"
  c.gpu_decoder_options = ""
  c.gpu_decoder_cpu_threads = 0
  # nvImageCodec decoders per GPU, each on its own thread, each decoding a
  # contiguous part of the device's shard of a micro-batch.
  c.gpu_decoder_threads = 1
  # Chunks (of 512 encoded images) a reader thread takes ahead out of the
  # workers for the GPU decoder's thread (0 = that thread takes them).
  c.gpu_decoder_read_ahead = 0
  # A process's shard is decoded and resized once and kept in memory when
  # it takes at most this many MiB at image_size (image_size^2 * 3 bytes per
  # example: synthetic_shapes' 4096 32x32 images take 12 MiB); 0 = never.
  c.cache_max_mb = 1024


def default_tokenizer_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.kind = "bytes"  # "bytes" | "sentencepiece" | "clip_bpe"
  c.max_len = 64     # Tokens per caption, EOS included (longer: truncated).
  # kind="sentencepiece": a local SentencePiece .model file; "" = the
  # pretrained image checkpoint's spiece.model (model.image.init).
  c.spm_path = ""
  # kind="clip_bpe": a local tokenizer.json, or a directory with
  # tokenizer.json or vocab.json + merges.txt; "" = the checkpoint's own
  # files: model.text.init if set, else model.image.init (a pretrained tower).
  c.bpe_path = ""
  return c


def _check_keys(section, defaults, where):
  unknown = sorted(set(section.keys()) - set(defaults.keys()))
  if unknown:
    names = ", ".join(f"{where}.{k}" for k in unknown)
    raise ValueError(f"unknown config key(s) {names}; "
                     f"known: {', '.join(sorted(defaults.keys()))}")


def check_data_config(config) -> None:
  """Validates config.data and config.tokenizer; one-line ValueError if bad.

  Checks key names, sizes, the tokenizer (kind, SentencePiece file), and that
  the dataset exists and is readable without downloading: for a TFDS name,
  that it is prepared under data_dir in array_record format with the
  configured splits and feature keys. synthetic_shapes is not generated here.
  """
  if "data" not in config:
    raise ValueError("config has no `data` section (embed "
                     "train.data.default_data_config())")
  data = config.data
  _check_keys(data, default_data_config(), "config.data")
  if "tokenizer" in config:
    _check_keys(config.tokenizer, default_tokenizer_config(), "config.tokenizer")
    tokenizer_lib.check_tokenizer_config(
        tokenizer_lib.resolve_tokenizer_config(config))
  for key in ("image_size", "num_eval_examples", "num_threads",
              "prefetch_batches", "num_train_examples", "cache_max_mb",
              "num_workers", "decode_size"):
    value = data.get(key)
    low = 0 if key in ("num_eval_examples", "prefetch_batches",
                       "cache_max_mb", "num_workers", "decode_size") else 1
    if not isinstance(value, int) or value < low:
      raise ValueError(f"config.data.{key}={value!r} must be an int >= {low}")
  outage = data.get("remote_outage_s", remote.DEFAULT_OUTAGE_S)
  if (not isinstance(outage, (int, float)) or isinstance(outage, bool)
      or not 0 <= outage < float("inf")):
    raise ValueError(f"config.data.remote_outage_s={outage!r} must be a "
                     "number of seconds >= 0 (default 900: 15 minutes)")
  par = data.get("remote_parallelism", remote.DEFAULT_PARALLELISM)
  if not (isinstance(par, int) and 1 <= par <= remote.MAX_PARALLELISM):
    raise ValueError(f"config.data.remote_parallelism={par!r} must be an "
                     f"int in [1, {remote.MAX_PARALLELISM}]")
  if 0 < data.decode_size < data.image_size:
    raise ValueError(f"config.data.decode_size={data.decode_size} is smaller "
                     f"than image_size={data.image_size}: the device only "
                     "shrinks (0 = resize on the host)")
  names_lib.check_templates(data.zeroshot_templates,
                            "config.data.zeroshot_templates")
  for key in ("zeroshot_classnames_file", "zeroshot_templates_file"):
    if data[key]:
      names_lib.resolve_path(data[key], f"config.data.{key}")
  if data.zeroshot_classnames and data.zeroshot_classnames_file:
    raise ValueError("config.data.zeroshot_classnames and "
                     "zeroshot_classnames_file are both set: give one")
  if data.zeroshot_templates and data.zeroshot_templates_file:
    raise ValueError("config.data.zeroshot_templates and "
                     "zeroshot_templates_file are both set: give one")
  if not (isinstance(data.max_bad_fraction, (int, float))
          and 0 <= data.max_bad_fraction <= 1):
    raise ValueError(f"config.data.max_bad_fraction={data.max_bad_fraction!r}"
                     " must be a number in [0, 1]")
  remote.parse_storage_options(data.storage_options)
  sources.check_sources(data)
  decoder_choice.check_decoder(data)
