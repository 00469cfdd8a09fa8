"""The bad-data ledger: skipped examples counted, named and bounded.

Every bad example the stream passes (a ``BadExample`` a source raised, an
image that does not decode, what a source found while opening:
train/data/sources/contract.py) is counted once here, however often the
stream passes it, and logged with its shard and key; past
``config.data.max_bad_fraction`` of the examples seen the run stops
(``TooMuchBadData``). The training iterator keeps one
(train/data/pipeline.py; the batch decoders' path, train/data/batching.py,
counts into it); its ``state`` travels in the data iterator's state, so a
resumed run counts the same.
"""
from __future__ import annotations

import collections

from absl import logging


class TooMuchBadData(ValueError):
  pass


class CountsBadData:
  """``bad`` and ``seen`` of an iterator's ``ledger`` (a BadDataLedger),
  as the trainer logs them."""

  @property
  def bad(self) -> int:
    return self.ledger.bad

  @property
  def retries(self) -> int:
    return self.ledger.retries

  @property
  def seen(self) -> int:
    return self.ledger.seen


class BadDataLedger:
  """Counts and names skipped examples, once each; stops the run past a
  threshold.

  A bad example is counted once however often the stream passes it (every
  epoch, and each of its ``captions_per_image`` copies): it is known by
  ``where`` (its shard and key). ``seen`` counts distinct examples too: the
  good ones taken (``add_good``, divided by ``copies``) plus the bad ones,
  at most ``corpus_size`` (the examples of this process's share, those found
  bad while opening included) once the stream has gone round.

  The first ``log_first`` bad examples are logged one by one with their
  shard and key, then one line each time the count doubles, so a corpus with
  many bad files cannot flood the log. ``check()`` raises TooMuchBadData once
  more than ``max_fraction`` of the examples seen were bad, checked from
  ``min_seen`` examples seen on (``start_of_check``: min(1000, corpus size),
  so a corpus smaller than 1000 is judged once all of it has been seen).
  """

  def __init__(self, max_fraction: float, min_seen: int, log_first: int = 20,
               what: str = "training data", *, corpus_size: int = 0,
               copies: int = 1):
    self.max_fraction, self.min_seen = max_fraction, max(1, min_seen)
    self.log_first, self.what = log_first, what
    self.corpus_size, self.copies = corpus_size, max(1, copies)
    self.bad, self.good_taken = 0, 0
    # Transient read failures retried (train/data/sources/remote.py), where the
    # examples were read: not bad data, a measure of the store's health.
    self.retries = 0
    self.by_reason = collections.Counter()
    self._counted = set()
    self._sorted = []  # sorted(_counted), kept for state() (every step).
    self._next_log = log_first * 2

  def add_bad(self, where: str, reason: str) -> None:
    if where in self._counted:
      return  # Met again: a later epoch, or another copy of its image.
    self._counted.add(where)
    self._sorted = None
    self.bad += 1
    # The kind of problem, without the path or details that follow it.
    self.by_reason[reason_kind(reason)] += 1
    if self.bad <= self.log_first:
      logging.warning("skipped a bad example of the %s: %s: %s", self.what,
                      where, reason)
    elif self.bad >= self._next_log:
      self._next_log *= 2
      logging.warning("%d bad examples of the %s skipped so far (last: %s: "
                      "%s); by reason: %s", self.bad, self.what, where, reason,
                      dict(self.by_reason))

  def add_retries(self, n: int) -> None:
    self.retries += int(n)

  def add_good(self, n: int = 1) -> None:
    self.good_taken += n

  @property
  def seen(self) -> int:
    n = -(-self.good_taken // self.copies) + self.bad
    return min(n, self.corpus_size) if self.corpus_size else n

  @property
  def fraction(self) -> float:
    return self.bad / max(self.seen, 1)

  def check(self) -> None:
    if self.seen >= self.min_seen and self.fraction > self.max_fraction:
      raise TooMuchBadData(
          f"{self.bad} of {self.seen} examples of the {self.what} were bad "
          f"({100 * self.fraction:.2f}% > config.data.max_bad_fraction="
          f"{self.max_fraction}; checked from min(1000, corpus size) = "
          f"{self.min_seen} examples seen on); by reason: "
          f"{dict(self.by_reason)} (see the log for their shards and keys)")

  def state(self) -> dict:
    return {"bad": self.bad, "seen": self.seen,
            "good_taken": self.good_taken,
            "corpus_size": self.corpus_size, "copies": self.copies,
            "by_reason": dict(self.by_reason),
            "counted": self._counted_sorted(), "retries": self.retries}

  def _counted_sorted(self) -> list:
    if self._sorted is None:
      self._sorted = sorted(self._counted)
    return list(self._sorted)

  def set_state(self, state: dict) -> None:
    self.bad = int(state["bad"])
    self.retries = int(state.get("retries", 0))
    # A state written before distinct counting has "seen" only.
    self.good_taken = int(state.get("good_taken",
                                    int(state["seen"]) - self.bad))
    self.corpus_size = int(state.get("corpus_size", self.corpus_size))
    self.copies = int(state.get("copies", self.copies))
    self.by_reason = collections.Counter(state.get("by_reason", {}))
    self._counted = set(state.get("counted", ()))
    self._sorted = None
    self._next_log = max(self.log_first * 2, 1 << self.bad.bit_length())


def start_of_check(corpus_size: int) -> int:
  """Examples seen before the bad-fraction check starts: 1000, or the whole
  corpus (this process's share) when it is smaller."""
  return max(1, min(1000, corpus_size))


def reason_kind(reason: str) -> str:
  """The kind of a bad example's reason, without the path or details that
  follow it ("undecodable image (OSError: ...)" -> "undecodable image")."""
  return reason.split(":")[0].split(" (")[0].split(" '")[0]
