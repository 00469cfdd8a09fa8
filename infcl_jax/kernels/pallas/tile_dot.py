"""The logit tile every kernel starts from: x_blk @ y_blk.T over D in steps.

Shared by the forward and backward kernels of both loss families, so that
the K-loop (which Triton software-pipelines) is written once.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

F32 = jnp.float32


def tile_dot(x_ref, y_ref, row0, col0, *, bq, bk, bd, nd, precision):
  """(bq, bk) float32 x[row0:row0+bq] @ y[col0:col0+bk].T, in nd steps of bd."""
  def d_step(kd, acc):
    xa = x_ref[pl.ds(row0, bq), pl.ds(kd * bd, bd)]
    yb = y_ref[pl.ds(col0, bk), pl.ds(kd * bd, bd)]
    return acc + lax.dot_general(
        xa, yb, (((1,), (1,)), ((), ())), preferred_element_type=F32,
        precision=precision)

  return lax.fori_loop(0, nd, d_step, jnp.zeros((bq, bk), F32))
