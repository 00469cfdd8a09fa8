"""Offline tokenizers: byte-level (default), SentencePiece or CLIP's BPE.

All map a list of strings to an int32 array [n, max_len] padded with
`pad_id` (= 0), with an end-of-sequence token after the text, so a text tower
can pool at the EOS position or over non-pad tokens. Nothing is downloaded:
the byte tokenizer needs no vocabulary file, and a SentencePiece model is a
local file given by `config.tokenizer.spm_path`, and a CLIP BPE vocabulary
is a local `tokenizer.json` or `vocab.json` + `merges.txt`
(`config.tokenizer.bpe_path`), read by the `tokenizers` library.
"""

import os

import numpy as np

PAD_ID = 0
EOS_ID = 1
# Byte b is token b + _BYTE_OFFSET; ids below it are reserved for specials.
_BYTE_OFFSET = 2


class Tokenizer:
  """Common interface: `encode(texts) -> int32 [n, max_len]` and `decode`."""

  vocab_size: int
  max_len: int
  pad_id: int = PAD_ID
  eos_id: int = EOS_ID

  def _ids(self, text: str) -> list[int]:
    raise NotImplementedError

  def _text(self, ids: list[int]) -> str:
    raise NotImplementedError

  def encode(self, texts) -> np.ndarray:
    """Tokenizes a list of strings (or bytes) into a padded int32 array.

    Texts longer than `max_len - 1` tokens are truncated; the EOS token is
    always present, so every row has at least one non-pad token.
    """
    if isinstance(texts, (str, bytes)):
      raise TypeError("Tokenizer.encode expects a list of strings, got a single "
                      f"{type(texts).__name__}")
    out = np.full((len(texts), self.max_len), self.pad_id, np.int32)
    for i, text in enumerate(texts):
      if isinstance(text, bytes):
        text = text.decode("utf-8")
      ids = self._ids(text)[:self.max_len - 1] + [self.eos_id]
      out[i, :len(ids)] = ids
    return out

  def decode(self, tokens) -> list[str]:
    """Inverse of `encode` up to truncation: drops EOS and everything after."""
    texts = []
    for row in np.asarray(tokens):
      row = [int(t) for t in row]
      if self.eos_id in row:
        row = row[:row.index(self.eos_id)]
      texts.append(self._text([t for t in row if t != self.pad_id]))
    return texts


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes as tokens: vocabulary 258 (pad, eos, 256 bytes)."""

  def __init__(self, max_len: int):
    self.max_len = max_len
    self.vocab_size = 256 + _BYTE_OFFSET

  def _ids(self, text):
    return [b + _BYTE_OFFSET for b in text.encode("utf-8")]

  def _text(self, ids):
    # errors="replace": truncation may cut a multi-byte character in half.
    return bytes(i - _BYTE_OFFSET for i in ids
                 if i >= _BYTE_OFFSET).decode("utf-8", errors="replace")


def _import_sentencepiece():
  try:  # Lazy: optional, for kind='sentencepiece' only; said if missing.
    import sentencepiece  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(
        "config.tokenizer.kind='sentencepiece' needs the `sentencepiece` "
        "package: pip install sentencepiece (or use kind='bytes')") from None
  return sentencepiece


class SentencePieceTokenizer(Tokenizer):
  """A local SentencePiece model; its ids are shifted by 2 to keep 0/1 free.

  Shifting (rather than relying on the model's own pad/eos ids, which many
  models leave undefined) keeps pad = 0 and eos = 1 for every tokenizer.
  """

  def __init__(self, spm_path: str, max_len: int):
    spm = _import_sentencepiece()
    self._sp = spm.SentencePieceProcessor(model_file=os.fspath(spm_path))
    self.max_len = max_len
    self.vocab_size = self._sp.get_piece_size() + _BYTE_OFFSET

  def _ids(self, text):
    return [i + _BYTE_OFFSET for i in self._sp.encode(text)]

  def _text(self, ids):
    return self._sp.decode([i - _BYTE_OFFSET for i in ids
                            if i >= _BYTE_OFFSET])


def _import_tokenizers():
  try:  # Lazy: for kind='clip_bpe' only; said if missing.
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(
        "config.tokenizer.kind='clip_bpe' needs the `tokenizers` package: "
        "pip install tokenizers") from None
  return tokenizers


# CLIP's pre-tokenisation: its specials, English contractions, runs of
# letters, single digits, runs of other non-space characters.
_CLIP_SPLIT = (r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|"
               r"[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+")
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def _clip_bpe_files(path: str, what: str = "") -> tuple[str, ...]:
  """(tokenizer.json,) or (vocab.json, merges.txt) at `path`, or an error
  (``what`` names where the path came from, default bpe_path itself)."""
  if os.path.isfile(path) and path.endswith(".json"):
    return (path,)
  if os.path.isdir(path):
    tj = os.path.join(path, "tokenizer.json")
    vm = (os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"))
    if os.path.isfile(tj):
      return (tj,)
    if all(os.path.isfile(f) for f in vm):
      return vm
  raise ValueError(f"{what or f'config.tokenizer.bpe_path={path!r}'}: "
                   "expected a tokenizer.json, or a directory with "
                   "tokenizer.json or vocab.json + merges.txt")


class ClipBpeTokenizer(Tokenizer):
  """CLIP's byte-level BPE (lower-cased, "</w>" word ends), through the
  `tokenizers` library; ids are CLIP's shifted by 2 (pad 0, EOS 1).

  A row is `<|startoftext|>`, the text's tokens, EOS, then padding, as CLIP
  has it, except that EOS is our id 1 rather than `<|endoftext|>` (the text
  tower initialised from CLIP maps id 1 to `<|endoftext|>`'s embedding,
  `train.towers.convert_hf.load_clip_text`).
  """

  def __init__(self, bpe_path: str, max_len: int):
    tk = _import_tokenizers()
    files = _clip_bpe_files(os.fspath(bpe_path))
    try:
      if len(files) == 1:
        tok = tk.Tokenizer.from_file(files[0])
      else:
        vocab, merges = tk.models.BPE.read_file(*files)
        tok = tk.Tokenizer(tk.models.BPE(
            vocab, merges, end_of_word_suffix="</w>", continuing_subword_prefix="",
            unk_token=CLIP_EOS, fuse_unk=False))
        tok.normalizer = tk.normalizers.Sequence([
            tk.normalizers.NFC(),
            tk.normalizers.Replace(tk.Regex(r"\s+"), " "),
            tk.normalizers.Lowercase()])
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split(tk.Regex(_CLIP_SPLIT), behavior="removed",
                                    invert=True),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                        use_regex=False)])
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([CLIP_BOS, CLIP_EOS])
    except Exception as e:  # tokenizers raises its own Exception types.
      raise ValueError(f"config.tokenizer.bpe_path={bpe_path!r}: not a "
                       f"readable CLIP BPE vocabulary: {e}") from None
    self._tok = tok
    self._bos = tok.token_to_id(CLIP_BOS)
    if self._bos is None or tok.token_to_id(CLIP_EOS) is None:
      raise ValueError(f"config.tokenizer.bpe_path={bpe_path!r}: the "
                       f"vocabulary has no {CLIP_BOS} / {CLIP_EOS}")
    self.max_len = max_len
    self.vocab_size = tok.get_vocab_size() + _BYTE_OFFSET

  def _ids(self, text):
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [i + _BYTE_OFFSET for i in [self._bos] + ids]

  def _text(self, ids):
    ids = [i - _BYTE_OFFSET for i in ids if i >= _BYTE_OFFSET]
    if ids and ids[0] == self._bos:
      ids = ids[1:]
    text = self._tok.decode(ids, skip_special_tokens=True)
    return " ".join(text.replace("</w>", " ").split())  # Word ends -> spaces.


TOKENIZER_KINDS = ("bytes", "sentencepiece", "clip_bpe")


def checkpoint_default(config) -> tuple[str, str] | None:
  """(key, path) the tokenizer reads when its own path is unset: the files
  of the checkpoint the text tower starts from (``model.text.init``), else
  of the pretrained image tower (``model.image.init``), whose vocabulary a
  CLIP or SigLIP text tower was trained with. None: no checkpoint to use.

  Only an unset ``bpe_path`` / ``spm_path`` is filled in: a path that is
  given is used as it is, so each key can be set on its own.
  """
  tok = config.tokenizer
  model = config.get("model")
  if model is None:
    return None
  if tok.kind == "clip_bpe" and not tok.get("bpe_path"):
    if model.text.get("init"):
      return "config.model.text.init", model.text.init
    if model.image.kind == "pretrained" and model.image.init:
      return "config.model.image.init", model.image.init
  if tok.kind == "sentencepiece" and not tok.get("spm_path"):
    if model.image.kind == "pretrained" and model.image.init:
      return ("config.model.image.init", os.path.join(model.image.init,
                                                       "spiece.model"))
  return None


def resolve_tokenizer_config(config):
  """``config.tokenizer`` with an unset path filled in from the checkpoint
  (``checkpoint_default``): a copy, the config itself is left as it is.
  Takes the whole config (or a bare tokenizer section, returned as it is)."""
  if "tokenizer" not in config:
    return config
  tok = config.tokenizer
  default = checkpoint_default(config)
  if default is None:
    return tok
  tok = tok.copy_and_resolve_references()
  with tok.unlocked():
    tok["bpe_path" if tok.kind == "clip_bpe" else "spm_path"] = default[1]
    tok["_from"] = default[0]  # Named in the error when the path is bad.
  return tok


def check_tokenizer_config(tok_config) -> None:
  """Raises a one-line ValueError for a bad `config.tokenizer` (or a
  resolved one, ``resolve_tokenizer_config``: its errors name the
  checkpoint whose files it looked for)."""
  src = tok_config.get("_from", "")
  kind = tok_config.get("kind", "bytes")
  if kind not in TOKENIZER_KINDS:
    raise ValueError(f"config.tokenizer.kind={kind!r} is not one of "
                     f"{TOKENIZER_KINDS}")
  max_len = tok_config.get("max_len", 0)
  if not isinstance(max_len, int) or max_len < 2:
    raise ValueError(f"config.tokenizer.max_len={max_len!r} must be an int "
                     ">= 2 (room for one token and EOS)")
  if kind == "sentencepiece":
    path = tok_config.get("spm_path") or ""
    if not path:
      raise ValueError("config.tokenizer.kind='sentencepiece' needs "
                       "config.tokenizer.spm_path (a local .model file)")
    if not os.path.isfile(os.path.expanduser(path)):
      if src:
        raise ValueError(
            f"config.tokenizer.spm_path is unset and {src} has no "
            f"spiece.model ({path}): set config.tokenizer.spm_path to the "
            "SentencePiece .model file")
      raise ValueError(f"config.tokenizer.spm_path={path!r}: no such file")
    _import_sentencepiece()
  if kind == "clip_bpe":
    path = tok_config.get("bpe_path") or ""
    if not path:
      raise ValueError("config.tokenizer.kind='clip_bpe' needs "
                       "config.tokenizer.bpe_path (a local tokenizer.json, or "
                       "a directory with vocab.json + merges.txt)")
    what = (f"config.tokenizer.bpe_path is unset and {src}={path!r} has no "
            "CLIP tokenizer files (set config.tokenizer.bpe_path, or "
            "config.tokenizer.kind='bytes')"
            if src else "")
    _clip_bpe_files(os.path.expanduser(path), what)
    _import_tokenizers()


def make_tokenizer(config) -> Tokenizer:
  """Builds the tokenizer of `config.tokenizer` (the whole config is passed).

  Args:
    config: a ConfigDict with a `tokenizer` field (kind, max_len, spm_path,
      bpe_path; an unset path is the checkpoint's, ``checkpoint_default``).
      A bare tokenizer ConfigDict is accepted too.
  """
  tok = resolve_tokenizer_config(config)
  check_tokenizer_config(tok)
  if tok.kind == "sentencepiece":
    return SentencePieceTokenizer(os.path.expanduser(tok.spm_path),
                                  tok.max_len)
  if tok.kind == "clip_bpe":
    return ClipBpeTokenizer(os.path.expanduser(tok.bpe_path), tok.max_len)
  return ByteTokenizer(tok.max_len)
