"""Which cross-device strategy ``strategy="auto"`` runs for the CLIP loss.

Measured on 2 H200s (NVLink), jax 0.11.2, bf16, D = 768, fwd+bwd, mosaic
tiles (https://github.com/infcl-jax/infcl-jax/blob/main/BENCHMARKS.md#ring):
the gather was faster than the ring at every local batch measured, by 0.5-2% at b_local = 65,536 (global 131,072), 10% at 16,384
and 5-15% at 8,192. Its extra cost is memory: the gathered keys and their
float32 gradient, O(N * b * D) per device against the ring's O(b * D), and
its all-gather / reduce-scatter do not overlap the tiles while the ring's
transfers do, which matters more as N * b grows.

So "auto" runs the gather while the global key batch is at most
``GATHER_MAX_GLOBAL_KEYS`` (131,072: the largest measured, where the
gathered keys and their gradient are ~0.6 GB at D = 768) and the ring
above it, where memory per device must stay O(b * D) and where the ring
hides its transfers. Larger N is not measured; the bound is on the global
batch, so on 8 GPUs "auto" gathers up to b_local = 16,384.
"""
from __future__ import annotations

STRATEGIES = ("auto", "ring", "gather")
GATHER_MAX_GLOBAL_KEYS = 131072


def pick(strategy, n_devices, b_keys):
  """"ring" or "gather" for ``n_devices`` shards of ``b_keys`` keys each."""
  if strategy != "auto":
    return strategy
  if n_devices <= 1:
    return "ring"  # One device: the single-tile path either way.
  return "gather" if n_devices * b_keys <= GATHER_MAX_GLOBAL_KEYS else "ring"
