"""``groups=`` in the Mosaic GPU backend against the float64 references.

The seam's operations of ``backend="mosaic"`` with group ids (contract:
``backends.base``, references: ``tests/group_reference.py``), on the
Mosaic-kernel stages (bf16 / f16), in jax's Mosaic GPU interpreter on the
CPU: odd shapes over several CTA tiles, programs and panels (the smallest
tiles the kernels take), group structures that reach every special case
(singletons, pairs, one big group spanning a whole row block, a row with no
related key, rows and columns whose every pair is related), both families,
both sigmoid modes, with and without the diagonal, one-way and two-way LSE.
Groups with all-distinct ids must give the no-groups result.

``TestForwardShortcuts`` checks the forward's one-exponential pass on its
own: rows and columns with no unrelated pair in a tile must neither lose
their statistics to a far larger tile shift nor flag the tile for the exact
retry. ``TestLowering`` lowers the grouped kernels for CUDA (layouts the
interpreter ignores). ``TestGroupsMosaicGpu`` (``@pytest.mark.gpu``) runs
the same checks compiled, at B = 4096 and 3001 x 2777, D = 768.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import BlockSizes
from infcl_jax.backends import registry
from infcl_jax.kernels.mosaic import g_panel as mg_panel
from infcl_jax.kernels.mosaic import lse_fwd as mlse_fwd
from infcl_jax.kernels.mosaic import sigmoid as msigmoid
from tests import group_reference as gref
from tests.helpers import as64, assert_rel_close, kernel_calls, rand_emb, tol

ON_GPU = jax.default_backend() == "gpu"
# LSE relative tolerance: compiled, exp2 / log2 are the approximate ones.
LSE_RTOL = 1e-5 if ON_GPU else 2e-6
SLOW = pytest.mark.slow
# The smallest tiles the kernels take: small problems span several tiles,
# programs and (two) panels.
SMALL = BlockSizes(block_q=64, block_k=128, block_d=64, num_programs=3,
                   bwd_block_q=64, bwd_block_k=128, panel_rows=128)
STRUCTURES = ("mixed", "one_key_group", "distinct", "all_related")

pytestmark = pytest.mark.usefixtures("reset_mosaic_interpreter")


def make_groups(kind, n, m, seed):
  """(gx (n,), gy (m,)) int32 group ids of one structure.

  * "mixed": pairs and singletons (random ids), one big group covering
    whole row blocks (the first 160 rows: two 64-row or one 128-row block)
    and some columns, and a last row with no related key;
  * "one_key_group": every key in one group, which about half of the rows
    (and the first 128) share: those rows have only related keys (LSE
    -inf), and in the first row blocks every column is related to every
    row;
  * "distinct": no pair related (must equal no groups);
  * "sparse": distinct ids but for a few related pairs (one row with three
    related keys): some tiles hold a related pair and compare ids, the
    others take the ungrouped path;
  * "pairs": ids used about twice, shuffled (two captions per image);
  * "all_related": every pair related (every LSE -inf, G = 0).
  """
  rng = np.random.default_rng(seed)
  if kind == "mixed":
    gx = rng.integers(0, max(n // 2, 1), n)
    gy = rng.integers(0, max(m // 2, 1), m)
    big = 10 ** 6
    gx[:min(n, 160)] = big
    gy[rng.choice(m, size=min(m, 40), replace=False)] = big
    gx[-1] = -5     # No key has it.
  elif kind == "one_key_group":
    gy = np.full(m, 7)
    gx = np.where(rng.random(n) < 0.5, 7, 1000 + np.arange(n))
    gx[:min(n, 128)] = 7
  elif kind == "distinct":
    gx, gy = np.arange(n), n + np.arange(m)
  elif kind == "sparse":
    gx, gy = np.arange(n), n + np.arange(m)
    rows = rng.choice(n, size=4, replace=False)
    cols = rng.choice(m, size=6, replace=False)
    gy[cols[:4]] = gx[rows]
    gy[cols[4:]] = gx[rows[0]]
  elif kind == "pairs":
    gx = rng.permutation(max(n, m))[:n] // 2
    gy = rng.permutation(max(n, m))[:m] // 2
  elif kind == "all_related":
    gx, gy = np.full(n, 3), np.full(m, 3)
  else:
    raise ValueError(kind)
  return gx.astype(np.int32), gy.astype(np.int32)


def _mosaic_kernels(fn, *args):
  return {k for k, _ in kernel_calls(jax.make_jaxpr(fn)(*args))
          if k.startswith("infcl_mosaic")}


def assert_lse(out, ref, what):
  """Finite entries close to the reference; where the reference is -inf
  (no unrelated pair) -inf or <= -1e30; never NaN."""
  out = np.asarray(out, np.float64)
  assert out.shape == ref.shape, (what, out.shape, ref.shape)
  assert not np.isnan(out).any(), f"{what}: NaN"
  empty = np.isneginf(ref)
  assert np.all(out[empty] <= -1e30), f"{what}: finite LSE of an empty row"
  assert np.all(np.isfinite(out[~empty])), f"{what}: non-finite LSE"
  if (~empty).any():
    assert_rel_close(out[~empty], ref[~empty], rtol=LSE_RTOL, what=what)


def check_softmax(be, n, m, d, dtype, kind, rows, cols, bs, seed=0,
                  t=12.5, b=-0.75):
  """lse and lse_grad with groups against ``tile_lse`` /
  ``tile_lse_grads``; "distinct" also against the no-groups result."""
  rng = np.random.default_rng(seed)
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
  gx, gy = make_groups(kind, n, m, seed + 1)
  if kind == "sparse":
    # Related keys duplicate their rows (the duplicate-image case): their
    # logits dominate, so a tile that missed its pairs shows in every
    # output.
    i, j = np.nonzero(gx[:, None] == gy[None, :])
    y = y.at[j].set(x[i])
  groups = (jnp.asarray(gx), jnp.asarray(gy))
  lse = jax.jit(lambda x, y, g: be.lse(x, y, t, b, rows=rows, cols=cols,
                                       block_sizes=bs, groups=g))
  assert _mosaic_kernels(lse, x, y, groups) == {"infcl_mosaic_lse_fwd"}
  r, c = lse(x, y, groups)
  rr, cr = gref.tile_lse(as64(x), as64(y), t, b, gx, gy)
  assert (r is None) != rows and (c is None) != cols
  if rows:
    assert r.dtype == jnp.float32
    assert_lse(r, rr, "row lse")
  if cols:
    assert c.dtype == jnp.float32
    assert_lse(c, cr, "col lse")
  a_r, a_c = (0.3 / n if rows else 0.0), (-1.7 / m if cols else 0.0)
  r_in = jnp.asarray(rr, jnp.float32) if rows else None
  c_in = jnp.asarray(cr, jnp.float32) if cols else None
  grad = jax.jit(lambda x, y, r, c, g: be.lse_grad(
      x, y, t, b, r, c, a_r, a_c, block_sizes=bs, groups=g))
  assert _mosaic_kernels(grad, x, y, r_in, c_in, groups) == {
      "infcl_mosaic_lse_bwd_panel"}
  out = grad(x, y, r_in, c_in, groups)
  with np.errstate(invalid="ignore"):  # inf - inf on related pairs, zeroed
    ref = gref.tile_lse_grads(as64(x), as64(y), t, b, rr if rows else None,
                              cr if cols else None, a_r, a_c, gx, gy)
  for o, e, what in zip(out, ref, ("dx", "dy", "dscale", "dbias")):
    assert o.dtype == jnp.float32
    assert_rel_close(o, e, rtol=tol(dtype), atol=1e-7, what=what)
  if kind == "distinct":
    plain_r, plain_c = be.lse(x, y, t, b, rows=rows, cols=cols,
                              block_sizes=bs)
    for a, p in ((r, plain_r), (c, plain_c)):
      if a is not None:
        np.testing.assert_allclose(np.asarray(a), np.asarray(p), rtol=1e-6)
    plain = be.lse_grad(x, y, t, b, r_in, c_in, a_r, a_c, block_sizes=bs)
    for a, p in zip(out, plain):
      np.testing.assert_allclose(np.asarray(a), np.asarray(p), rtol=1e-5,
                                 atol=1e-7)


def check_sigmoid(be, n, m, d, dtype, kind, mode, has_diagonal, bs, seed=0,
                  t=7.0, b=-4.0, coef=0.5):
  """sigmoid_sum and sigmoid_grad with groups against ``sigmoid_tile``;
  "distinct" also against the no-groups result."""
  rng = np.random.default_rng(seed)
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
  gx, gy = make_groups(kind, n, m, seed + 1)
  groups = (jnp.asarray(gx), jnp.asarray(gy))
  kw = dict(has_diagonal=has_diagonal, block_sizes=bs, group_mode=mode)
  total_fn = jax.jit(lambda x, y, g: be.sigmoid_sum(x, y, t, b, groups=g,
                                                    **kw))
  grad_fn = jax.jit(lambda x, y, g: be.sigmoid_grad(x, y, t, b, coef,
                                                    groups=g, **kw))
  assert _mosaic_kernels(total_fn, x, y, groups) == {
      "infcl_mosaic_sigmoid_sum"}
  assert "infcl_mosaic_sigmoid_g" in _mosaic_kernels(grad_fn, x, y, groups)
  total = total_fn(x, y, groups)
  grads = grad_fn(x, y, groups)
  ref = gref.sigmoid_tile(as64(x), as64(y), t, b, gx, gy, has_diagonal, mode)
  assert total.dtype == jnp.float32 and total.shape == ()
  assert_rel_close(total, ref[0], rtol=2e-5, what="sum")
  scale = coef * (np.abs(ref[1]).max() + np.abs(ref[2]).max())
  for g, r, name in zip(grads, ref[1:], ("dx", "dy", "dscale", "dbias")):
    assert g.dtype == jnp.float32, name
    r = coef * np.asarray(r)
    atol = 1e-6 * scale if name in ("dx", "dy") else 1e-5 * coef
    # The scalar grads are float32 sums of n * m terms of both signs.
    rt = tol(dtype) if name in ("dx", "dy") else max(tol(dtype), 1e-4)
    assert_rel_close(g, r, rtol=rt, atol=atol, what=name)
  if kind == "distinct":
    pkw = dict(has_diagonal=has_diagonal, block_sizes=bs)
    plain = be.sigmoid_sum(x, y, t, b, **pkw)
    np.testing.assert_allclose(float(total), float(plain), rtol=1e-6)
    plain_g = be.sigmoid_grad(x, y, t, b, coef, **pkw)
    for a, p in zip(grads, plain_g):
      np.testing.assert_allclose(np.asarray(a), np.asarray(p), rtol=1e-5,
                                 atol=1e-7)


def backend(family):
  # Interpreted off the GPU, compiled on it.
  return registry.get("mosaic", family,
                      platform="gpu" if ON_GPU else "cpu")


# ------------------------------------------------------------ interpreter


class TestSoftmaxGroups:
  """Both LSEs and their gradient; 3 x 2 CTA tiles, 3 programs, 2 panels."""

  @pytest.mark.parametrize("kind", ["mixed", "one_key_group", "sparse",
                                    pytest.param("all_related", marks=SLOW)])
  def test_both_directions_bf16(self, kind):
    check_softmax(backend("softmax"), 150, 170, 77, jnp.bfloat16, kind,
                  True, True, SMALL)

  def test_distinct_groups_equal_no_groups(self):
    check_softmax(backend("softmax"), 100, 140, 50, jnp.bfloat16,
                  "distinct", True, True, SMALL, seed=6)

  @SLOW
  @pytest.mark.parametrize("kind", ["mixed"])
  def test_both_directions_f16(self, kind):
    check_softmax(backend("softmax"), 150, 170, 77, jnp.float16, kind, True, True,
                  SMALL, seed=3)

  @pytest.mark.parametrize("rows,kind", [
      (False, "mixed"), pytest.param(True, "mixed", marks=SLOW),
      pytest.param(True, "one_key_group", marks=SLOW)])
  def test_one_direction(self, rows, kind):
    # Rows only with B_k > B_q, columns only with B_q > B_k.
    n, m = (70, 200) if rows else (200, 70)
    check_softmax(backend("softmax"), n, m, 40, jnp.bfloat16, kind, rows, not rows,
                  SMALL, seed=5)

  @SLOW
  def test_single_exp_off(self):
    # The two-exponential path (``single_exp=False``) with groups.
    import dataclasses  # pylint: disable=import-outside-toplevel
    check_softmax(backend("softmax"), 150, 170, 77, jnp.bfloat16, "one_key_group",
                  True, True, dataclasses.replace(SMALL, single_exp=False),
                  seed=7)

  def test_bwd_impl_xla(self):
    # The XLA panels (``bwd_impl="xla"``) take the groups too.
    import dataclasses  # pylint: disable=import-outside-toplevel
    be = backend("softmax")
    rng = np.random.default_rng(8)
    x, y = (rand_emb(rng, 90, 40, jnp.bfloat16),
            rand_emb(rng, 110, 40, jnp.bfloat16))
    gx, gy = make_groups("mixed", 90, 110, 9)
    rr, cr = gref.tile_lse(as64(x), as64(y), 5.0, 0.0, gx, gy)
    out = be.lse_grad(x, y, 5.0, 0.0, jnp.asarray(rr, jnp.float32),
                      jnp.asarray(cr, jnp.float32), 0.5, 0.5,
                      block_sizes=dataclasses.replace(SMALL, bwd_impl="xla"),
                      groups=(jnp.asarray(gx), jnp.asarray(gy)))
    ref = gref.tile_lse_grads(as64(x), as64(y), 5.0, 0.0, rr, cr, 0.5, 0.5,
                              gx, gy)
    for o, e, what in zip(out, ref, ("dx", "dy", "dscale", "dbias")):
      assert_rel_close(o, e, rtol=tol(jnp.bfloat16), atol=1e-7, what=what)


class TestSigmoidGroups:
  """Sum and gradient, both modes; with the diagonal n == m (paired)."""

  @pytest.mark.parametrize("mode,has_diagonal", [
      ("mask", True), ("positives", False),
      pytest.param("mask", False, marks=SLOW),
      pytest.param("positives", True, marks=SLOW)])
  def test_mixed_bf16(self, mode, has_diagonal):
    n, m = (150, 150) if has_diagonal else (150, 170)
    check_sigmoid(backend("sigmoid"), n, m, 77, jnp.bfloat16, "mixed", mode,
                  has_diagonal, SMALL)

  @pytest.mark.parametrize("mode", ["mask", pytest.param("positives",
                                                         marks=SLOW)])
  def test_f16(self, mode):
    # float16 panels: the max |G| pre-pass sees the groups too.
    check_sigmoid(backend("sigmoid"), 150, 150, 77, jnp.float16, "mixed", mode, True,
                  SMALL, seed=2)

  @pytest.mark.parametrize("kind,mode,has_diagonal", [
      ("distinct", "mask", True),
      pytest.param("one_key_group", "mask", False, marks=SLOW),
      pytest.param("one_key_group", "positives", True, marks=SLOW),
      pytest.param("all_related", "mask", True, marks=SLOW),
      pytest.param("all_related", "positives", False, marks=SLOW)])
  def test_structures(self, kind, mode, has_diagonal):
    n, m = (130, 130) if has_diagonal else (130, 190)
    check_sigmoid(backend("sigmoid"), n, m, 50, jnp.bfloat16, kind, mode,
                  has_diagonal, SMALL, seed=4)


def _shortcut_inputs():
  """Inputs whose one-exponential pass meets both no-unrelated-pair cases
  next to a far larger tile shift (base-2 gap ~ 200, past float32's
  exponent range), with nothing else for it to flag:

  * row block 0: rows 1..63 share group 7, which every column from 128 on
    has; there only row 0 (group 1000) counts, with logits ~144. Rows
    1..63 have ordinary logits in columns 0..127, which a rescale to the
    tile's shift would flush to 0;
  * row block 1: rows 64..127 share group 8, which columns 0..63 have,
    except column 5 whose logits with them are ~144. Those columns had
    ordinary logits in row block 0 (the same program's workspace), which
    the merge with an empty tile sum must keep.
  """
  rng = np.random.default_rng(21)
  n, m, d = 128, 256, 64
  x = rng.standard_normal((n, d)) / 8
  y = rng.standard_normal((m, d)) / 8
  e0, e1 = np.eye(d)[0], np.eye(d)[1]
  x[0] = 12 * e1
  x[64:128] = 12 * e0 + 0.01 * rng.standard_normal((64, d))
  y[128:256] = 12 * e1 + 0.01 * rng.standard_normal((128, d))
  y[5] = 12 * e0
  gx = np.concatenate([[1000], np.full(63, 7), np.full(64, 8)])
  gy = np.concatenate([np.full(64, 8), 3000 + np.arange(64), np.full(128, 7)])
  gy[5] = 2000
  return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16),
          gx.astype(np.int32), gy.astype(np.int32))


def pad_rows(a, rows):
  return jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))


def pad_ids(g, size):
  """Ids padded with a value no valid id has (the kernels ignore it)."""
  return np.concatenate([g, np.full(size - len(g), -77, np.int32)])


def _operands(gx, gy, n):
  """The forward's group operands at 64 x 64 tiles."""
  return mlse_fwd._group_operands(jnp.asarray(gx), jnp.asarray(gy), n=n,  # pylint: disable=protected-access
                                  block_q=64, block_k=64)


def _one_pass(x, y, groups, *, interpret=True, n=None, m=None, scale=1.0,
              bias=0.0):
  """The forward's unchecked one-exponential pass alone (no retry), one
  program, 64 x 64 tiles."""
  return mlse_fwd._lse_fwd_once(  # pylint: disable=protected-access
      x, y, scale, bias, n=n or x.shape[0], m=m or y.shape[0], rows=True,
      cols=True, block_q=64, block_k=64, block_d=64, num_stages=3,
      num_programs=1, interpret=interpret, single_exp=True, check="rerun",
      groups=groups)


class TestForwardShortcuts:
  """The forward kernel's unchecked one-exponential pass with groups."""

  def test_empty_rows_and_columns_keep_their_statistics(self):
    x, y, gx, gy = _shortcut_inputs()
    n = x.shape[0]
    rr, cr = gref.tile_lse(as64(x), as64(y), 1.0, 0.0, gx, gy)
    assert np.all(np.isfinite(rr)) and np.all(np.isfinite(cr))
    r, c = _one_pass(x, y, _operands(gx, gy, n))
    # Nothing flagged (no exact retry), and exact.
    assert_lse(r, rr, "row lse (one pass)")
    assert_lse(c, cr, "col lse (one pass)")

  @pytest.mark.parametrize("kind", ["pairs", "sparse", "distinct"])
  def test_one_pass_is_exact(self, kind):
    """Pairs and singletons, ids in any order (every tile masked): the one
    pass is exact, no retry."""
    rng = np.random.default_rng(5)
    n, m = 200, 333
    x, y = rand_emb(rng, n, 64, jnp.bfloat16), rand_emb(rng, m, 64,
                                                        jnp.bfloat16)
    gx, gy = make_groups(kind, n, m, 6)
    if kind == "sparse":
      i, j = np.nonzero(gx[:, None] == gy[None, :])
      y = y.at[j].set(x[i])
    xp, yp = pad_rows(x, 256), pad_rows(y, 384)
    rr, cr = gref.tile_lse(as64(x), as64(y), 4.0, 0.5, gx, gy)
    r, c = _one_pass(xp, yp, _operands(pad_ids(gx, 256), pad_ids(gy, 384), n),
                     n=n, m=m, scale=4.0, bias=0.5)
    assert_lse(r, rr, "row lse (one pass)")
    assert_lse(c, cr, "col lse (one pass)")

  @SLOW
  @pytest.mark.parametrize("check", ["rerun", "tile"])
  def test_shortcut_inputs_both_checks(self, check):
    x, y, gx, gy = _shortcut_inputs()
    rr, cr = gref.tile_lse(as64(x), as64(y), 1.0, 0.0, gx, gy)
    r, c = mlse_fwd.lse_fwd(x, y, 1.0, 0.0, n=x.shape[0], m=y.shape[0],
                            rows=True, cols=True, block_q=64, block_k=64,
                            num_programs=1, interpret=True, check=check,
                            groups=(jnp.asarray(gx), jnp.asarray(gy)))
    assert_lse(r, rr, "row lse")
    assert_lse(c, cr, "col lse")

  def test_wrong_group_shapes_fail_in_one_line(self):
    x = jnp.zeros((64, 64), jnp.bfloat16)
    y = jnp.zeros((128, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="groups must be"):
      mlse_fwd.lse_fwd(x, y, 1.0, 0.0, n=64, m=128, rows=True, cols=True,
                       block_q=64, block_k=64, interpret=True,
                       groups=(jnp.zeros((63,), jnp.int32),
                               jnp.zeros((128,), jnp.int32)))
    with pytest.raises(ValueError, match="group_mode"):
      msigmoid.sigmoid_tiles(
          x, y, jnp.arange(64, dtype=jnp.int32), jnp.ones((4,)), mode="sum",
          m=128, mask=False, has_diagonal=False, block_q=64, block_k=64,
          interpret=True, groups=(jnp.zeros((64,), jnp.int32),
                                  jnp.zeros((128,), jnp.int32)),
          group_mode="drop")


class TestLowering:
  """The grouped kernels lower to Mosaic GPU for CUDA on any host (the
  interpreter ignores layouts; e.g. a bool ``~`` does not lower)."""

  XP = jnp.zeros((384, 128), jnp.bfloat16)
  YP = jnp.zeros((512, 128), jnp.bfloat16)
  GX = jnp.zeros((384,), jnp.int32)
  GY = jnp.zeros((512,), jnp.int32)

  def _lowers(self, fn):
    text = jax.jit(fn).trace(self.XP, self.YP, self.GX, self.GY).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text

  @pytest.mark.parametrize("rows,cols,check", [
      (True, True, "rerun"), (True, True, "tile"), (True, False, "rerun"),
      (False, True, "rerun")])
  def test_fwd_lowers(self, rows, cols, check):
    self._lowers(lambda a, b, g, h: mlse_fwd.lse_fwd(
        a, b, 2.0, 0.5, n=300, m=270, rows=rows, cols=cols, num_programs=2,
        check=check, groups=(g, h)))

  @pytest.mark.parametrize("mask", [True, False])
  def test_panel_lowers(self, mask):
    params = jnp.ones((4,), jnp.float32)
    r2 = jnp.zeros((384,), jnp.float32)
    c2 = jnp.zeros((512,), jnp.float32)
    self._lowers(lambda a, b, g, h: mg_panel.g_panel(
        a, b, r2, c2, params, rows=True, cols=True, mask=mask,
        groups=(g, h)))

  @pytest.mark.parametrize("mode,group_mode,has_diagonal", [
      (mode, group_mode, True) for mode in msigmoid.MODES
      for group_mode in ("mask", "positives")] + [
          ("g", "mask", False), ("g", "positives", False)])
  def test_sigmoid_lowers(self, mode, group_mode, has_diagonal):
    params = jnp.ones((4,), jnp.float32)
    rid = jnp.arange(384, dtype=jnp.int32)
    self._lowers(lambda a, b, g, h: msigmoid.sigmoid_tiles(
        a, b, rid, params, mode=mode, m=270, mask=True,
        has_diagonal=has_diagonal, groups=(g, h), group_mode=group_mode))


# -------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestGroupsMosaicGpu:
  """Compiled for Hopper, the backend's default (production) tiles."""

  @pytest.mark.parametrize("kind", ["mixed", "one_key_group", "distinct"])
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_softmax_4096(self, kind, dtype):
    check_softmax(backend("softmax"), 4096, 4096, 768, dtype, kind, True, True, None)

  @pytest.mark.parametrize("rows,cols", [(True, True), (True, False),
                                         (False, True)])
  def test_softmax_odd(self, rows, cols):
    check_softmax(backend("softmax"), 3001, 2777, 768, jnp.bfloat16, "mixed", rows,
                  cols, None)

  def test_softmax_odd_one_key_group(self):
    check_softmax(backend("softmax"), 3001, 2777, 768, jnp.bfloat16, "one_key_group",
                  True, True, None)

  def test_forward_shortcuts(self):
    x, y, gx, gy = _shortcut_inputs()
    n = x.shape[0]
    rr, cr = gref.tile_lse(as64(x), as64(y), 1.0, 0.0, gx, gy)
    r, c = _one_pass(x, y, _operands(gx, gy, n), interpret=False)
    assert_lse(r, rr, "row lse (one pass)")
    assert_lse(c, cr, "col lse (one pass)")

  @pytest.mark.parametrize("mode", ["mask", "positives"])
  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
  def test_sigmoid_4096(self, mode, dtype):
    check_sigmoid(backend("sigmoid"), 4096, 4096, 768, dtype, "mixed", mode, True,
                  None)

  @pytest.mark.parametrize("mode", ["mask", "positives"])
  def test_sigmoid_odd(self, mode):
    check_sigmoid(backend("sigmoid"), 3001, 2777, 768, jnp.bfloat16, "mixed", mode,
                  False, None)

  def test_sigmoid_odd_one_key_group(self):
    check_sigmoid(backend("sigmoid"), 3001, 2777, 768, jnp.float16, "one_key_group",
                  "mask", False, None)
