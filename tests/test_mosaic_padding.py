"""The Mosaic forward's padding mask, built only in the tiles that hold
padding (``kernels.mosaic.lse_fwd``), against the float64 reference.

Odd shapes: padded rows only, padded columns only, both, a consumer half
that is all padding (m = 257), one- and two-way statistics, both
exponential paths, with and without groups. The Mosaic GPU interpreter runs
the kernels on the CPU; ``TestLowering`` lowers them for CUDA (the layouts
and the branch, which the interpreter does not check).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax.kernels.mosaic import lse_fwd as mlse_fwd
from tests import group_reference as gref
from tests.test_groups_mosaic import make_groups

BQ, BK, BD = 128, 128, 64     # lse_fwd's default blocks (y pads to 2 * BK)
D = 100
SCALE, BIAS = 10.0, -2.0


def _round_up(v, k):
  return -(-v // k) * k


def _inputs(n, m, seed=0):
  kx, ky = jax.random.split(jax.random.key(seed))
  x = (jax.random.normal(kx, (n, D)) / math.sqrt(D)).astype(jnp.bfloat16)
  y = (jax.random.normal(ky, (m, D)) / math.sqrt(D)).astype(jnp.bfloat16)
  d_pad = _round_up(D, BD)
  xp = jnp.pad(x, ((0, _round_up(n, BQ) - n), (0, d_pad - D)))
  yp = jnp.pad(y, ((0, _round_up(m, 2 * BK) - m), (0, d_pad - D)))
  return x, y, xp, yp


def _groups(kind, n, m, n_pad, m_pad):
  """(gx, gy) unpadded for the reference (distinct ids without groups) and
  the kernel's padded operands (None without groups)."""
  if kind is None:
    return (np.arange(n), n + np.arange(m)), None
  gx, gy = make_groups(kind, n, m, seed=4)
  pad = (jnp.pad(jnp.asarray(gx), (0, n_pad - n), constant_values=-1),
         jnp.pad(jnp.asarray(gy), (0, m_pad - m), constant_values=-1))
  return (gx, gy), pad


def _run(xp, yp, groups, **kw):
  fn = jax.jit(lambda a, b, g: mlse_fwd.lse_fwd(
      a, b, SCALE, BIAS, num_programs=2, interpret=True, groups=g, **kw))
  return fn(xp, yp, groups)


def _assert_ref(out, ref, what):
  out = np.asarray(out, np.float64)
  assert not np.isnan(out).any(), f"{what}: NaN"
  empty = np.isneginf(ref)
  assert np.all(out[empty] <= -1e30), f"{what}: finite LSE of an empty row"
  err = np.linalg.norm(out[~empty] - ref[~empty])
  assert err <= 1e-5 * np.linalg.norm(ref[~empty]), f"{what}: rel err {err}"


# n, m, rows, cols, single_exp, groups. Padding of rows only (300 x 256),
# columns only (256 x 270), both; m = 257: consumer 1's half of the last
# column block is all padding; 300 rows on 2 programs: two rounds.
CASES = [
    (300, 270, True, True, True, None),
    (300, 256, True, True, True, None),
    (256, 270, True, True, True, None),
    (129, 257, True, True, False, "mixed"),
    (300, 270, True, True, True, "one_key_group"),
    (129, 257, False, True, True, None),
]


@pytest.mark.usefixtures("reset_mosaic_interpreter")
@pytest.mark.parametrize("n,m,rows,cols,single_exp,groups", CASES)
def test_padded_forward_matches_float64(n, m, rows, cols, single_exp, groups):
  x, y, xp, yp = _inputs(n, m)
  (gx, gy), gpad = _groups(groups, n, m, xp.shape[0], yp.shape[0])
  ref = gref.tile_lse(x, y, SCALE, BIAS, gx, gy)
  out = _run(xp, yp, gpad, n=n, m=m, rows=rows, cols=cols,
             single_exp=single_exp)
  for i, (o, on) in enumerate(zip(out, (rows, cols))):
    what = f"{'row' if i == 0 else 'col'} LSE"
    assert (o is None) != on, what
    if on:
      _assert_ref(o, ref[i], what)


def _jaxpr(xp, yp, n, m):
  return str(jax.make_jaxpr(lambda a, b: mlse_fwd.lse_fwd(
      a, b, SCALE, BIAS, n=n, m=m, rows=True, cols=True, num_programs=2,
      check="tile", single_exp=False))(xp, yp))


def test_only_padded_shapes_branch():
  """The padded kernel is the aligned one plus one branch (the edge tiles'
  mask); the aligned one builds no mask at all."""
  _, _, xp, yp = _inputs(256, 512)
  aligned = _jaxpr(xp, yp, 256, 512)
  _, _, xp, yp = _inputs(300, 270)
  padded = _jaxpr(xp, yp, 300, 270)
  assert padded.count(" cond[") == aligned.count(" cond[") + 1
  assert "iota" not in aligned and "iota" in padded


class TestLowering:
  """The padded kernels lower to a Mosaic GPU module for CUDA on any host
  (as ``test_mosaic_kernels.TestLowering``; PTX is not produced here)."""

  @pytest.mark.parametrize("rows,cols,n,m,groups", [
      (True, True, 300, 270, None), (True, True, 300, 270, "mixed"),
      (True, True, 300, 256, None), (True, False, 129, 512, None),
      (False, True, 130, 257, "mixed")])
  def test_fwd_lowers(self, rows, cols, n, m, groups):
    _, _, xp, yp = _inputs(n, m)
    _, gpad = _groups(groups, n, m, xp.shape[0], yp.shape[0])
    fn = lambda a, b, g: mlse_fwd.lse_fwd(
        a, b, 2.0, 0.5, n=n, m=m, rows=rows, cols=cols, num_programs=2,
        groups=g)
    text = jax.jit(fn).trace(xp, yp, gpad).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
