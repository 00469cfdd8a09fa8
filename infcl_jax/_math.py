"""The math every layer shares: one copy of each formula and constant.

The tiles of both families, the Pallas kernels and the full-matrix reference
evaluate these in float32 (or wider); none of them is a kernel of its own.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
NEG_INF = -jnp.inf
# exp(v) = 2**(v * LOG2E): the kernels work in base 2 (exp2 is one
# instruction on the GPU), so statistics and logits are scaled by this, and
# a base-2 LSE times LN2 is the natural one.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# The one-exponential forward (a shared shift per tile) is exact while every
# row's and column's sum in the tile stays >= MIN_SUM, i.e. its max is within
# ~64 binary orders of the tile's; below, a tile takes the exact
# two-exponential path.
MIN_SUM = 2.0**-64


def dot(a, b, contract, precision):
  """a . b over the ``contract`` dims, float32 accumulation."""
  return lax.dot_general(a, b, (contract, ((), ())),
                         preferred_element_type=F32, precision=precision)


def unit_coefs(row_coef, col_coef):
  """(a_r, a_c, norm): the softmax gradient's coefficients divided by the
  larger magnitude (1 when both are 0); ``None`` means no such term.

  The probabilities are in [0, 1] and the coefficients ~1/B; a tile of G is
  formed as a_r P^r + a_c P^c and ``norm`` is applied after the matmuls,
  so that a 16-bit G does not underflow.
  """
  row_coef = jnp.asarray(0.0 if row_coef is None else row_coef, F32)
  col_coef = jnp.asarray(0.0 if col_coef is None else col_coef, F32)
  norm = jnp.maximum(jnp.abs(row_coef), jnp.abs(col_coef))
  norm = jnp.where(norm == 0, 1.0, norm)
  return row_coef / norm, col_coef / norm, norm


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


def lse2_of_partials(cm, cl):
  """The natural LSE over axis 0 of base-2 partial statistics: rows of
  (running max ``cm``, sum of 2^(s - cm) ``cl``), as the persistent forward
  kernels leave them in their column workspace (one row per program)."""
  mx = safe_max(jnp.max(cm, axis=0))
  return (mx + jnp.log2(jnp.sum(cl * jnp.exp2(cm - mx[None, :]),
                                axis=0))) * LN2
