"""Elementwise math that every layer shares: one copy of each formula.

The tiles of both families, the Pallas kernels and the full-matrix reference
evaluate these in float32 (or wider); none of them is a kernel of its own.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

NEG_INF = -jnp.inf
# exp(v) = 2**(v * LOG2E): the kernels work in base 2 (exp2 is one
# instruction on the GPU), so statistics and logits are scaled by this.
LOG2E = math.log2(math.e)


def softplus(u):
  """log(1 + e^u) without overflow for u >> 0 or loss of accuracy for u << 0.

  Equals -log sigmoid(-u). For u << 0 the result is e^u to full relative
  precision (log1p, not log), which keeps a tiny sigmoid loss accurate; it is
  never formed as softplus(s) - s, which would cancel.
  """
  return jnp.maximum(u, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(u)))


def safe_max(m):
  """A running max usable as a shift: -inf (a fully masked row) becomes 0.

  Without it, exp(s - m) of a row that has seen only padding is
  exp(-inf - (-inf)) = NaN.
  """
  return jnp.where(m == NEG_INF, 0.0, m)


def merge_stats(m_a, l_a, m_b, l_b):
  """Stable merge of two (running max, sum of exp(s - max)) pairs."""
  m = jnp.maximum(m_a, m_b)
  shift = safe_max(m)
  return m, l_a * jnp.exp(m_a - shift) + l_b * jnp.exp(m_b - shift)


def stats_to_lse(m, l):
  """log-sum-exp from a (max, sum of exp(s - max)) pair."""
  return m + jnp.log(l)
