"""``edge_mask`` of the Mosaic forward (``kernels.mosaic.lse_fwd``).

Each way of masking the padding ("cond": only in the tiles holding it;
"vec": -inf biases from 1-D vectors) must give the default's LSEs (every
tile masked) to float32 rounding, and the float64 reference, on odd shapes:
padded rows only, padded columns only, both, a consumer half that is all
padding (m = 257), one- and two-way statistics, both exponential paths and
both checks, with and without groups. The Mosaic GPU interpreter runs the
kernels on the CPU; ``TestLowering`` lowers them for CUDA (the layouts, which
the interpreter ignores).
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
VARIANTS = ("cond", "vec")


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


# n, m, rows, cols, single_exp, groups, check. Padding of rows only
# (300 x 256), columns only (256 x 270), both; m = 257: consumer 1's half of
# the last column block is all padding; 300 rows on 2 programs: two rounds.
CASES = [
    (300, 270, True, True, True, None, "rerun"),
    (300, 270, True, True, True, None, "tile"),
    (300, 270, True, True, False, None, "rerun"),
    (300, 256, True, True, True, None, "rerun"),
    (256, 270, True, True, True, None, "rerun"),
    (129, 257, True, True, True, "mixed", "rerun"),
    (129, 257, True, True, False, "mixed", "rerun"),
    (300, 270, True, True, True, "one_key_group", "rerun"),
    (300, 270, True, False, True, "mixed", "rerun"),
    (129, 257, False, True, True, None, "rerun"),
]


@pytest.mark.usefixtures("reset_mosaic_interpreter")
@pytest.mark.parametrize("n,m,rows,cols,single_exp,groups,check", CASES)
def test_edge_mask_matches_default_and_reference(n, m, rows, cols,
                                                 single_exp, groups, check):
  x, y, xp, yp = _inputs(n, m)
  (gx, gy), gpad = _groups(groups, n, m, xp.shape[0], yp.shape[0])
  kw = dict(n=n, m=m, rows=rows, cols=cols, single_exp=single_exp,
            check=check)
  ref = gref.tile_lse(x, y, SCALE, BIAS, gx, gy)
  base = _run(xp, yp, gpad, edge_mask=False, **kw)
  for em in (False,) + VARIANTS:
    out = base if em is False else _run(xp, yp, gpad, edge_mask=em, **kw)
    for i, (o, on) in enumerate(zip(out, (rows, cols))):
      what = f"edge_mask={em!r} {'row' if i == 0 else 'col'} LSE"
      assert (o is None) != on, what
      if not on:
        continue
      _assert_ref(o, ref[i], what)
      np.testing.assert_allclose(np.asarray(o), np.asarray(base[i]),
                                 rtol=1e-6, atol=0, err_msg=what)


def test_edge_mask_rejects_unknown():
  _, _, xp, yp = _inputs(130, 200)
  with pytest.raises(ValueError, match="edge_mask"):
    mlse_fwd.lse_fwd(xp, yp, 1.0, 0.0, n=130, m=200, rows=True, cols=True,
                     edge_mask=True)


def _jaxpr(xp, yp, n, m, edge_mask, groups=None):
  return str(jax.make_jaxpr(lambda a, b: mlse_fwd.lse_fwd(
      a, b, SCALE, BIAS, n=n, m=m, rows=True, cols=True, num_programs=2,
      edge_mask=edge_mask, groups=groups))(xp, yp))


def test_aligned_shapes_run_the_default_kernel():
  # Nothing to mask: every edge_mask is the default kernel; padded shapes
  # get a kernel of their own.
  _, _, xp, yp = _inputs(256, 512)
  assert {_jaxpr(xp, yp, 256, 512, em) for em in (False,) + VARIANTS} == {
      _jaxpr(xp, yp, 256, 512, False)}
  _, _, xp, yp = _inputs(300, 270)
  assert len({_jaxpr(xp, yp, 300, 270, em)
              for em in (False,) + VARIANTS}) == 3


class TestLowering:
  """The variants lower to a Mosaic GPU module for CUDA on any host (as
  ``test_mosaic_kernels.TestLowering``; PTX is not produced here)."""

  @pytest.mark.parametrize("edge_mask", VARIANTS)
  @pytest.mark.parametrize("rows,cols,n,m,groups", [
      (True, True, 300, 270, None), (True, True, 300, 270, "mixed"),
      (True, True, 300, 256, None), (True, True, 256, 270, None),
      (True, False, 129, 512, None), (False, True, 130, 257, "mixed")])
  def test_fwd_lowers(self, edge_mask, rows, cols, n, m, groups):
    _, _, xp, yp = _inputs(n, m)
    _, gpad = _groups(groups, n, m, xp.shape[0], yp.shape[0])
    fn = lambda a, b, g: mlse_fwd.lse_fwd(
        a, b, 2.0, 0.5, n=n, m=m, rows=rows, cols=cols, num_programs=2,
        edge_mask=edge_mask, groups=g)
    text = jax.jit(fn).trace(xp, yp, gpad).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
