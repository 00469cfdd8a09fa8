"""The contract every training source meets, and its bad examples.

A source is a random-access sequence of examples (``len`` and
``source[i]``), read by example index; ``source[i]`` returns

    {"key": str,         # stable and unique: "shard.tar:000123", "row 17"
     "image": bytes | np.ndarray,   # encoded file bytes, or uint8 [H, W, C]
     "captions": list[str | bytes], # at least one, non-empty
     "label": int,       # -1 without labels
     "image_id": int}    # optional: examples of one image share it
                         # (default: the example's index)

or, for precomputed embeddings, ``"image_emb": float32 [D]`` instead of
"image" (and ``"content_id"``: examples with equal decoded pixels share
it). A bad record (a missing or empty caption, an image file that cannot
be read) raises ``BadExample``, naming it; an image that does not decode is
found later by the pipeline, which raises the same. Bad examples found while
a source is opened (a tar member without its pair, a truncated shard) are
listed in ``source.bad_at_open``.

Every source has ``spec`` (what config.data.name said, for checkpoint
fingerprints) and ``describe()`` (one line for the log). Random access makes
the order of a stream a pure function of (seed, position), so a position is
all a resumed run needs.

A source whose examples sit on object storage (``is_remote``) also has
``read_many(indices, parallelism)``: ``source[i]`` for each index, in order,
each the example or the ``BadExample`` it raised, read up to
``parallelism`` at a time (``read_many`` below is that for any source).
"""
from __future__ import annotations

import dataclasses


class BadExample(Exception):
  """One example that is skipped: ``where`` names it, ``reason`` says why."""

  def __init__(self, where: str, reason: str):
    super().__init__(f"{where}: {reason}")
    self.where, self.reason = where, reason


@dataclasses.dataclass
class Bad:
  """A skipped example as it travels through the pipeline (not an error)."""
  where: str
  reason: str


def get_or_bad(source, index: int):
  """``source[index]``, or the BadExample it raised."""
  try:
    return source[index]
  except BadExample as e:
    return e


def read_many(source, indices, parallelism: int = 1) -> list:
  """[``get_or_bad(source, i)`` for i in indices]: through the source's
  ``read_many`` (concurrent requests) where it is remote, else one after
  another (a local source's path as it is)."""
  if getattr(source, "is_remote", False):
    return source.read_many(indices, parallelism)
  return [get_or_bad(source, int(i)) for i in indices]
