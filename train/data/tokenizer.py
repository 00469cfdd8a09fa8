"""Offline tokenizers: byte-level (default) or a local SentencePiece model.

Both map a list of strings to an int32 array [n, max_len] padded with
`pad_id` (= 0), with an end-of-sequence token after the text, so a text tower
can pool at the EOS position or over non-pad tokens. Nothing is downloaded:
the byte tokenizer needs no vocabulary file, and a SentencePiece model is a
local file given by `config.tokenizer.spm_path`.
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
  try:
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


TOKENIZER_KINDS = ("bytes", "sentencepiece")


def check_tokenizer_config(tok_config) -> None:
  """Raises a one-line ValueError for a bad `config.tokenizer`."""
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
    if not os.path.isfile(path):
      raise ValueError(f"config.tokenizer.spm_path={path!r}: no such file")
    _import_sentencepiece()


def make_tokenizer(config) -> Tokenizer:
  """Builds the tokenizer of `config.tokenizer` (the whole config is passed).

  Args:
    config: a ConfigDict with a `tokenizer` field (kind, max_len, spm_path).
      A bare tokenizer ConfigDict is accepted too.
  """
  tok = config.tokenizer if "tokenizer" in config else config
  check_tokenizer_config(tok)
  if tok.kind == "sentencepiece":
    return SentencePieceTokenizer(tok.spm_path, tok.max_len)
  return ByteTokenizer(tok.max_len)
