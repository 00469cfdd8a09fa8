"""``groups=`` in the Triton-family kernel tiles against float64 references.

The seam's contract (``backends.base``): softmax tiles leave related pairs
(gx[i] == gy[j]) out of both LSEs (a row / column of only those: -inf) and
give them G = 0; sigmoid tiles drop them ("mask", the diagonal stays a
positive) or label them +1 ("positives"). Each check runs the kernels'
forward and both backward routes (the panel kernels and
``bwd_impl="xla"``) on odd shapes, over group structures that reach every
branch: singletons, pairs, one big group, a key group shared by every
column (rows whose every key is related, a row with none), a query group
shared by every row (columns of only related pairs). Groups whose ids all
differ must give the results without groups.

``TestPallasGroupsInterpret`` runs the Pallas-Triton kernels interpreted
(any platform, tiny blocks: padding, several programs, panels and tiles);
``TestPallasGroupsGpu`` (``-m gpu``) compiles them at B = 4096 and an odd
size. The ``triton`` backend's twins are in ``test_native_triton.py`` (its
leg has the triton extra).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax.backends import registry
from tests import group_reference as gr
from tests import test_pallas_sigmoid
from tests.helpers import as64, assert_rel_close, default_tiles, rand_emb

ON_GPU = jax.default_backend() == "gpu"
# The sigmoid tests' tiles, every size below off their grid; num_programs=3
# gives several rounds of the softmax forward and column splits of the
# sigmoid forward, panel_rows=32 several backward panels; "highest" keeps
# float32 exact when compiled.
TINY = dataclasses.replace(test_pallas_sigmoid.TINY, num_programs=3)
GPU_SMALL = dataclasses.replace(test_pallas_sigmoid.GPU_SMALL, num_programs=3)
STRUCTURES = ("singletons", "pairs", "big", "all_keys", "all_queries",
              "sparse")
# G is stored in the input dtype before the GEMMs: bfloat16 keeps ~3
# digits. The statistics are float32 sums of exact products.
GRAD_RTOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}
LSE_RTOL = 1e-5


def make_groups(structure, n, m, seed):
  """(gx (n,), gy (m,)) int32 group ids of one structure."""
  rng = np.random.default_rng(seed)
  if structure == "singletons":
    gx, gy = np.arange(n), rng.permutation(max(n, m))[:m]
  elif structure == "pairs":
    gx, gy = np.arange(n) // 2, rng.permutation(np.arange(m) // 2)
  elif structure == "big":
    gx = np.where(rng.random(n) < 0.6, 0, 1000 + np.arange(n))
    gy = np.where(rng.random(m) < 0.6, 0, 5000 + np.arange(m))
  elif structure == "all_keys":
    # Every key in group 7: rows of group 7 have only related keys (LSE
    # -inf); row 1 has none.
    gx = rng.integers(0, 10, n)
    gx[0], gx[1] = 7, 100
    gy = np.full(m, 7)
  elif structure == "all_queries":
    # Every query in group 7: columns of group 7 have only related rows.
    gx = np.full(n, 7)
    gy = rng.integers(0, 10, m)
    gy[0], gy[1] = 7, 100
  elif structure == "distinct":
    gx, gy = np.arange(n), n + np.arange(m)
  elif structure == "sparse":
    # Distinct ids but for a few related pairs (row rows[0] has three): a
    # few tiles hold a related pair, the others none.
    gx, gy = np.arange(n), n + np.arange(m)
    k = max(4, min(n, m) // 64)
    rows = rng.choice(n, size=k, replace=False)
    cols = rng.choice(m, size=k + 2, replace=False)
    gy[cols[:k]] = gx[rows]
    gy[cols[k:]] = gx[rows[0]]
  else:
    raise ValueError(structure)
  return np.asarray(gx, np.int32), np.asarray(gy, np.int32)


def with_duplicates(structure, x, y, gx, gy):
  """y with each related key a copy of its query for "sparse" (duplicate
  images): those logits dominate, so a tile that skipped its related pairs
  shows in every output. Other structures keep y."""
  if structure != "sparse":
    return y
  i, j = np.nonzero(gx[:, None] == gy[None, :])
  return y.at[j].set(x[i])


def check_lse(actual, ref, what):
  """-inf (or <= -1e30) where the reference is -inf, close elsewhere."""
  actual = np.asarray(actual, np.float64)
  assert not np.isnan(actual).any(), f"{what}: NaN"
  empty = np.isneginf(ref)
  assert np.all(actual[empty] <= -1e30), f"{what}: finite where all related"
  assert np.all(np.isfinite(actual[~empty])), f"{what}: non-finite"
  assert_rel_close(actual[~empty], ref[~empty], rtol=LSE_RTOL, what=what)


def check_grads(actual, ref, dtype, what):
  for a, r, name in zip(actual, ref, ("dx", "dy", "dscale", "dbias")):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    assert not np.isnan(a).any(), f"{what} {name}: NaN"
    scale = np.linalg.norm(np.asarray(ref[0]).ravel()) + 1e-30
    # The scalars are float32 sums of n * m terms of both signs.
    rtol = GRAD_RTOL[jnp.dtype(dtype).type]
    if name in ("dx", "dy"):
      atol = 1e-5 * scale
    else:
      rtol, atol = max(rtol, 1e-4), 1e-4 * (1 + scale)
    assert_rel_close(a, r, rtol=rtol, atol=atol, what=f"{what} {name}")


# Module-level jitted ops (the backend and the static settings are jit's
# static arguments): the group ids, inputs and statistics are traced, so
# every structure of a test reuses one compiled kernel per shape.

@functools.partial(jax.jit, static_argnames=("be", "rows", "cols", "bs"))
def _lse(be, x, y, t, b, g, *, rows, cols, bs):
  return be.lse(x, y, t, b, rows=rows, cols=cols, block_sizes=bs, groups=g)


@functools.partial(jax.jit, static_argnames=("be", "bs"))
def _lse_grad(be, x, y, t, b, r, c, a_r, a_c, g, *, bs):
  return be.lse_grad(x, y, t, b, r, c, a_r, a_c, block_sizes=bs, groups=g)


def _sigmoid_kw(bs, has_diagonal, g, mode):
  kw = dict(has_diagonal=has_diagonal, block_sizes=bs, groups=g)
  if g is not None:
    kw["group_mode"] = mode
  return kw


@functools.partial(jax.jit,
                   static_argnames=("be", "bs", "has_diagonal", "mode"))
def _sigmoid_sum(be, x, y, t, b, g, *, bs, has_diagonal, mode):
  return be.sigmoid_sum(x, y, t, b, **_sigmoid_kw(bs, has_diagonal, g, mode))


@functools.partial(jax.jit,
                   static_argnames=("be", "bs", "has_diagonal", "mode"))
def _sigmoid_grad(be, x, y, t, b, g, *, bs, has_diagonal, mode):
  return be.sigmoid_grad(x, y, t, b, 1.0,
                         **_sigmoid_kw(bs, has_diagonal, g, mode))


@functools.cache
def _backend(name, family, platform):
  return registry.get(name, family, platform=platform)


def _f32(*vals):
  return [jnp.float32(v) for v in vals]


class TestPallasGroupsInterpret:
  """The groups contract of a Triton-family backend (NAME)."""
  NAME = "pallas"
  INTERPRET = True
  BLOCKS = TINY
  SHAPES = ((37, 53, 40), (45, 45, 24))
  LOW_PRECISION = (jnp.bfloat16,)
  # float16 sigmoid panels take the max-|G| pre-pass (its kernel too).
  SIGMOID_LOW_PRECISION = (jnp.bfloat16, jnp.float16)
  # The sum of n * m float32 softplus terms.
  SUM_RTOL = 1e-5

  def backend(self, family):
    return _backend(self.NAME, family, "cpu" if self.INTERPRET else "gpu")

  # ------------------------------------------------------------ softmax

  def softmax_case(self, n, m, d, dtype, structures, seed, bwd_impls,
                   one_way=True, blocks=None):
    """Both LSEs (and, ``one_way``, each alone) and ``lse_grad`` with both
    statistics (and each alone) per structure and backward route."""
    be = self.backend("softmax")
    blocks = blocks or self.BLOCKS
    rng = np.random.default_rng(seed)
    x, y0 = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
    t, b = 9.0, -0.5
    for k, structure in enumerate(structures):
      gx, gy = make_groups(structure, n, m, seed + k)
      g = (jnp.asarray(gx), jnp.asarray(gy))
      y = with_duplicates(structure, x, y0, gx, gy)
      rr, cr = gr.tile_lse(as64(x), as64(y), t, b, gx, gy)
      r, c = _lse(be, x, y, *_f32(t, b), g, rows=True, cols=True, bs=blocks)
      check_lse(r, rr, f"{structure} row lse")
      check_lse(c, cr, f"{structure} col lse")
      if one_way:
        r1, c1 = _lse(be, x, y, *_f32(t, b), g, rows=True, cols=False,
                      bs=blocks)
        assert c1 is None
        check_lse(r1, rr, f"{structure} row-only lse")
        r1, c1 = _lse(be, x, y, *_f32(t, b), g, rows=False, cols=True,
                      bs=blocks)
        assert r1 is None
        check_lse(c1, cr, f"{structure} col-only lse")
      # The reference statistics (their -inf included), as a loss passes
      # them.
      r32, c32 = jnp.asarray(rr, jnp.float32), jnp.asarray(cr, jnp.float32)
      a_r, a_c = 0.4 / n, -1.3 / m
      ways = [(True, True)] + ([(True, False), (False, True)] if one_way
                               else [])
      for impl in bwd_impls:
        bs = dataclasses.replace(blocks, bwd_impl=impl)
        for rows, cols in ways:
          out = _lse_grad(be, x, y, *_f32(t, b), r32 if rows else None,
                          c32 if cols else None, *_f32(a_r, a_c), g, bs=bs)
          ref = gr.tile_lse_grads(as64(x), as64(y), t, b,
                                  rr if rows else None, cr if cols else None,
                                  a_r, a_c, gx, gy)
          check_grads(out, ref, dtype, f"{structure} {impl} rows={rows} "
                      f"cols={cols}")

  def test_softmax_float32(self):
    n, m, d = self.SHAPES[0]
    self.softmax_case(n, m, d, jnp.float32, STRUCTURES, seed=1,
                      bwd_impls=("pallas", "xla"))

  def test_softmax_low_precision(self):
    n, m, d = self.SHAPES[0]
    for dtype in self.LOW_PRECISION:
      self.softmax_case(n, m, d, dtype, ("pairs", "all_keys", "all_queries"),
                        seed=2, bwd_impls=("pallas",), one_way=False)

  # ------------------------------------------------------------ sigmoid

  def sigmoid_case(self, n, m, d, dtype, structures, seed, has_diagonal,
                   bwd_impls, blocks=None):
    """``sigmoid_sum`` and ``sigmoid_grad`` per structure, mode and
    backward route."""
    be = self.backend("sigmoid")
    blocks = blocks or self.BLOCKS
    if has_diagonal:
      m = n
    rng = np.random.default_rng(seed)
    x, y0 = rand_emb(rng, n, d, dtype), rand_emb(rng, m, d, dtype)
    t, b = 7.0, -3.0
    for k, structure in enumerate(structures):
      gx, gy = make_groups(structure, n, m, seed + k)
      g = (jnp.asarray(gx), jnp.asarray(gy))
      y = with_duplicates(structure, x, y0, gx, gy)
      for mode in ("mask", "positives"):
        what = f"{structure} {mode} diag={has_diagonal}"
        ref = gr.sigmoid_tile(as64(x), as64(y), t, b, gx, gy, has_diagonal,
                              mode)
        total = _sigmoid_sum(be, x, y, *_f32(t, b), g, bs=blocks,
                             has_diagonal=has_diagonal, mode=mode)
        assert_rel_close(total, ref[0], rtol=self.SUM_RTOL,
                         what=f"{what} sum")
        for impl in bwd_impls:
          out = _sigmoid_grad(be, x, y, *_f32(t, b), g,
                              bs=dataclasses.replace(blocks, bwd_impl=impl),
                              has_diagonal=has_diagonal, mode=mode)
          check_grads(out, ref[1:], dtype, f"{what} {impl}")

  @pytest.mark.parametrize("has_diagonal", [True, False])
  def test_sigmoid_float32(self, has_diagonal):
    n, m, d = self.SHAPES[1 if has_diagonal else 0]
    self.sigmoid_case(n, m, d, jnp.float32, STRUCTURES, seed=3,
                      has_diagonal=has_diagonal, bwd_impls=("pallas", "xla"))

  def test_sigmoid_low_precision(self):
    n, _, d = self.SHAPES[1]
    for dtype in self.SIGMOID_LOW_PRECISION:
      self.sigmoid_case(n, n, d, dtype, ("pairs", "all_keys", "sparse"),
                        seed=4,
                        has_diagonal=True, bwd_impls=("pallas",))

  # ----------------------------------------------------- distinct groups

  def test_distinct_groups_are_no_groups(self):
    """Ids that never match give the results without groups."""
    n, m, d = self.SHAPES[0]
    rng = np.random.default_rng(5)
    x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, m, d, jnp.float32)
    gx, gy = make_groups("distinct", n, m, 5)
    t, b = _f32(9.0, -0.5)
    bs = self.BLOCKS
    soft, sig = self.backend("softmax"), self.backend("sigmoid")

    def run(g):
      r, c = _lse(soft, x, y, t, b, g, rows=True, cols=True, bs=bs)
      out = (r, c) + tuple(_lse_grad(soft, x, y, t, b, r, c,
                                     *_f32(0.5 / n, 0.5 / m), g, bs=bs))
      out += (_sigmoid_sum(sig, x, y, t, b, g, bs=bs, has_diagonal=False,
                           mode="mask"),)
      return out + tuple(_sigmoid_grad(sig, x, y, t, b, g, bs=bs,
                                       has_diagonal=False, mode="mask"))

    names = ("row lse", "col lse", "softmax dx", "dy", "dscale", "dbias",
             "sigmoid sum", "dx", "dy", "dscale", "dbias")
    for a, e, what in zip(run((jnp.asarray(gx), jnp.asarray(gy))), run(None),
                          names):
      # The same arithmetic; compiled, the select may reorder an FMA.
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-6,
                                 atol=1e-6, err_msg=what)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestPallasGroupsGpu(TestPallasGroupsInterpret):
  """The same checks compiled (small tiles, odd sizes), and at B = 4096 and
  an odd B with the GPU's default tiles, in every input dtype."""
  INTERPRET = False
  BLOCKS = GPU_SMALL
  SHAPES = ((129, 300, 40), (133, 133, 72))
  LOW_PRECISION = (jnp.bfloat16, jnp.float16)
  SUM_RTOL = 1e-4  # up to 3001^2 terms

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
  @pytest.mark.parametrize("n,d,structure", [(4096, 768, "pairs"),
                                             (4096, 768, "sparse"),
                                             (3001, 1000, "all_keys")])
  def test_default_tiles(self, n, d, structure, dtype):
    for family in ("softmax", "sigmoid"):
      bs = dataclasses.replace(default_tiles(self.NAME, dtype, family=family),
                               f32_precision="highest")
      if family == "softmax":
        self.softmax_case(n, n, d, dtype, (structure,), seed=6,
                          bwd_impls=("pallas",), one_way=False, blocks=bs)
      else:
        self.sigmoid_case(n, n, d, dtype, (structure,), seed=7,
                          has_diagonal=True, bwd_impls=("pallas",),
                          blocks=bs)
