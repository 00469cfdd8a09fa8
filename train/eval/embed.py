"""Data-parallel embedding for evaluation: a split streamed through the
image tower, and host arrays (token ids) in fixed-size batches.

One pass over an ``EvalSplit`` in global batches of ``batch_size`` images:
each process reads and decodes only the rows that its own devices embed
(``jax.make_array_from_callback``), the image tower runs over the whole mesh,
and the (batch, D) embeddings come back replicated, so every process ends
with the same (N, D) float32 array. Only one batch of uint8 images is alive
at a time. Labels and captions (small) are gathered across processes once,
at the end, and put in split order, so the result does not depend on the
number of processes or devices.

Embeddings are kept in float32: for N = 50,000 and D = 768 that is 154 MB,
and bfloat16 storage would halve it at the price of ties and flipped ranks
among near-equal similarities (docs/evaluation.md, "The embeddings:
float32 or bfloat16").
"""
from __future__ import annotations

import dataclasses
import functools
import pickle

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from train import mesh as mesh_lib
from train.towers import tower as tower_lib


@dataclasses.dataclass
class Embedded:
  """The result of one pass: image embeddings and per-example metadata."""
  images: np.ndarray        # float32 [N, D]
  labels: np.ndarray        # int32 [N] (-1 without labels)
  captions: list            # per image, its captions (list of str)
  num_bad: int = 0          # Examples left out: unreadable or uncaptioned.


def make_image_embed(mesh, embed):
  """Jitted ``f(params, uint8 [B, S, S, 3] sharded) -> replicated [B, D]``.

  ``embed(params, uint8)`` is the tower's (``Tower.embed``).
  """
  return jax.jit(embed, out_shardings=mesh_lib.replicated(mesh))


def make_embed_fn(mesh, tower):
  """Jitted data-parallel ``embed(params, inputs) -> (b, D)`` for evaluation
  and the precompute.

  ``tower``: a ``Tower`` (uint8 images) or a Flax module (the text tower).

  ``inputs`` is the same host array in every process of ``mesh`` (each
  device embeds its rows); the output is replicated, so every process can
  read all of it (``np.asarray``) even when the mesh spans several processes.
  ``params`` must live on ``mesh``'s devices (replicated).
  """
  sharding = mesh_lib.rows(mesh)

  @functools.partial(jax.jit, out_shardings=mesh_lib.replicated(mesh))
  def embed(params, x):
    x = jax.lax.with_sharding_constraint(x, sharding)
    return tower_lib.embed_fn_of(tower)(params, x)

  return embed


def _local_rows(sharding, shape) -> list[int]:
  """Rows of a [B, ...] batch that this process's devices hold."""
  rows = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    rows.update(range(*index[0].indices(shape[0])))
  return sorted(rows)


def _gather(local: list) -> list:
  """Concatenation over processes of a small list of python objects.

  Every process gets every process's list (in process order). One process:
  the list itself; several: through ``multihost_utils`` as bytes.
  """
  if jax.process_count() == 1:
    return list(local)
  blob = np.frombuffer(pickle.dumps(local), np.uint8)
  sizes = multihost_utils.process_allgather(np.asarray([blob.size], np.int64))
  sizes = np.asarray(sizes).reshape(-1)
  padded = np.zeros((int(sizes.max()),), np.uint8)
  padded[:blob.size] = blob
  every = np.asarray(multihost_utils.process_allgather(padded))
  every = every.reshape(len(sizes), -1)
  out = []
  for row, size in zip(every, sizes):
    out.extend(pickle.loads(row[:int(size)].tobytes()))
  return out


def embed_split(split, *, mesh, image_embed, params, batch_size: int,
                keep_captions: bool = True) -> Embedded:
  """Embeds every image of ``split`` (an ``EvalSplit``), streamed.

  Args:
    split: ``train.data.eval_sets.EvalSplit``.
    mesh: 1-D mesh over axis "data"; ``batch_size`` must divide by its size.
    image_embed: from ``make_image_embed``.
    params: the image tower's params, replicated on ``mesh``.
    batch_size: global images per batch.
    keep_captions: also return the captions of each image.
  """
  if batch_size % mesh.size:
    raise ValueError(f"eval batch size {batch_size} is not divisible by the "
                     f"{mesh.size} devices")
  n, s = split.num_examples, split.image_size
  shape = (batch_size, s, s, 3)
  sharding = mesh_lib.rows(mesh)
  mine = _local_rows(sharding, shape)
  emb = None
  meta = []  # (global index, label, captions) of the rows read here.
  for start in range(0, n, batch_size):
    valid = [r for r in mine if start + r < n]
    examples = dict(zip(valid, split.read([start + r for r in valid])))
    for r in valid:
      ex = examples[r]
      meta.append((start + r, int(ex["label"]),
                   list(ex["captions"]) if keep_captions else [],
                   ex.get("bad")))
    pad = np.zeros((s, s, 3), np.uint8)

    def rows(index, examples=examples):
      idx = range(*index[0].indices(batch_size))
      return np.stack([examples[r]["image"] if r in examples else pad
                       for r in idx])

    batch = jax.make_array_from_callback(shape, sharding, rows)
    out = np.asarray(image_embed(params, batch), np.float32)
    del batch, examples
    if emb is None:
      emb = np.empty((n, out.shape[-1]), np.float32)
    stop = min(start + batch_size, n)
    emb[start:stop] = out[:stop - start]
  if emb is None:
    emb = np.zeros((0, 0), np.float32)
  meta = sorted(_gather(meta), key=lambda m: m[0])
  if [m[0] for m in meta] != list(range(n)):
    raise RuntimeError(f"evaluation of {split.name}: the processes read "
                       f"{len(meta)} of its {n} examples")
  bad = [m for m in meta if m[3]]
  if bad:
    # Skipped, counted and named; the metrics are over the readable rest.
    logging.warning("evaluation of %s: %d bad example(s) left out (first: "
                    "%s)", split.name, len(bad), bad[0][3])
    keep = np.asarray([not m[3] for m in meta])
    emb, meta = emb[keep], [m for m in meta if not m[3]]
  return Embedded(images=emb,
                  labels=np.asarray([m[1] for m in meta], np.int32),
                  captions=[m[2] for m in meta], num_bad=len(bad))


def embed_host_array(embed_fn, params, inputs: np.ndarray, batch_size: int):
  """``embed_fn(params, batch)`` over a host array, in fixed-size batches.

  ``inputs`` is the same array on every process (token ids: small). The last
  batch is padded by repeating row 0 so that one compiled program serves
  every batch; the padding rows are dropped.
  """
  n = inputs.shape[0]
  out = None
  for start in range(0, n, batch_size):
    chunk = inputs[start:start + batch_size]
    pad = batch_size - chunk.shape[0]
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[:1], pad, axis=0)])
    e = np.asarray(embed_fn(params, chunk), np.float32)[:batch_size - pad]
    if out is None:
      out = np.empty((n, e.shape[-1]), np.float32)
    out[start:start + e.shape[0]] = e
  return out if out is not None else np.zeros((0, 0), np.float32)
