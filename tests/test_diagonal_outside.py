"""``panel_backward.sigmoid_grad(diagonal_outside=True)``: a grouped panel
("mask" or "positives") run without its diagonal, the diagonal's G written
afterwards and the scalar sums corrected, gives what the panel with its
diagonal gives. The seam's sum (``backends.base``) likewise: the tiles
without their diagonal plus ``diagonal_sum_fix``.

Checked on the XLA panels (any platform) against the same call without
the option and against the float64 reference, on diagonals that are
related (dropped by the kernel), unrelated (a negative there), padded
rows and several panels, in float32 and in float16 (whose max-|G|
pre-pass must see the diagonal too). The Triton backend, which turns the
option on, runs the kernel twins in ``test_native_triton.py``.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax.backends import panel_backward as pb
from infcl_jax.backends import registry
from tests import group_reference as gr
from tests.helpers import as64, assert_rel_close, rand_emb


def groups(kind, n, rng):
  if kind == "paired":  # every diagonal pair related (one id array)
    g = rng.permutation(n) // 2
    return g, g
  if kind == "mixed":  # some diagonal pairs related, some not
    gx = rng.permutation(n) // 2
    gy = gx.copy()
    flip = rng.random(n) < 0.5
    gy[flip] = 10 * n + np.arange(n)[flip]
    return gx, gy
  raise ValueError(kind)


@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("kind", ["paired", "mixed"])
def test_diagonal_outside_equals_inside(kind, dtype, mode):
  n, d = 45, 24
  rng = np.random.default_rng(3)
  x = rand_emb(rng, n, d, dtype)
  gx, gy = (np.int32(a) for a in groups(kind, n, rng))
  # Half the positives duplicate their query (confident, a large logit),
  # half are random.
  y = x.at[n // 2:].set(rand_emb(rng, n - n // 2, d, dtype))
  layout = pb.panel_layout(n, n, d, block_q=8, block_k=16, block_d=8,
                           panel_rows=16)  # 3 panels, padded rows
  kw = dict(has_diagonal=True, layout=layout, precision="highest",
            groups=(jnp.asarray(gx), jnp.asarray(gy)), group_mode=mode)
  inside = pb.sigmoid_grad(x, y, 7.0, -3.0, 1.0, **kw)
  outside = pb.sigmoid_grad(x, y, 7.0, -3.0, 1.0, diagonal_outside=True,
                            **kw)
  ref = gr.sigmoid_tile(as64(x), as64(y), 7.0, -3.0, gx, gy, True, mode)
  tol = 1e-5 if dtype == jnp.float32 else 2e-3
  for a, b, r, what in zip(outside, inside, ref[1:],
                           ("dx", "dy", "dscale", "dbias")):
    assert_rel_close(a, b, rtol=tol, atol=1e-6, what=f"{what} vs inside")
    assert_rel_close(a, r, rtol=tol, atol=1e-6, what=f"{what} vs float64")


def test_off_without_a_diagonal():
  """Off-diagonal tiles have no diagonal to take out: the option changes
  nothing there (same program, same numbers)."""
  n, d = 32, 16
  rng = np.random.default_rng(4)
  x, y = rand_emb(rng, n, d, jnp.float32), rand_emb(rng, n, d, jnp.float32)
  g = jnp.asarray(rng.permutation(n) // 2, jnp.int32)
  layout = pb.panel_layout(n, n, d, block_q=8, block_k=16, block_d=8,
                           panel_rows=16)
  for mode in ("mask", "positives"):
    kw = dict(has_diagonal=False, layout=layout, precision="highest",
              groups=(g, g), group_mode=mode)
    a = pb.sigmoid_grad(x, y, 5.0, -2.0, 1.0, diagonal_outside=True, **kw)
    b = pb.sigmoid_grad(x, y, 5.0, -2.0, 1.0, **kw)
    for u, v in zip(a, b):
      np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_float16_divisor_sees_the_diagonal():
  """float16 panels are stored divided by their largest |G|: with every
  negative far below (bias -20) and the positives unsure, that largest
  |G| is the diagonal's, which the kernel did not compute; the divisor
  must still include it (else G_ii / max overflows float16)."""
  n, d = 40, 16
  rng = np.random.default_rng(5)
  x = rand_emb(rng, n, d, jnp.float16)
  g = np.int32(rng.permutation(n) // 2)
  layout = pb.panel_layout(n, n, d, block_q=8, block_k=16, block_d=8,
                           panel_rows=16)
  out = pb.sigmoid_grad(x, x, 7.0, -20.0, 1.0, has_diagonal=True,
                        layout=layout, precision="highest",
                        groups=(jnp.asarray(g), jnp.asarray(g)),
                        group_mode="mask", diagonal_outside=True)
  ref = gr.sigmoid_tile(as64(x), as64(x), 7.0, -20.0, g, g, True, "mask")
  for a, r, what in zip(out, ref[1:], ("dx", "dy", "dscale", "dbias")):
    assert np.all(np.isfinite(np.asarray(a))), what
    assert_rel_close(a, r, rtol=2e-3, atol=1e-6, what=what)


def _square_case(kind, seed, n=45, d=24):
  """float32 (x, y, gx, gy) of a diagonal block pair: half the positives
  duplicate their query (a large logit), half are random."""
  rng = np.random.default_rng(seed)
  x = rand_emb(rng, n, d, jnp.float32)
  y = x.at[n // 2:].set(rand_emb(rng, n - n // 2, d, jnp.float32))
  gx, gy = (np.int32(a) for a in groups(kind, n, rng))
  return x, y, gx, gy


@pytest.mark.parametrize("mode", ["mask", "positives"])
@pytest.mark.parametrize("kind", ["paired", "mixed"])
def test_sum_without_the_diagonal(kind, mode, monkeypatch):
  """A backend with GROUP_DIAGONAL_OUTSIDE sums the grouped tiles of a
  diagonal block pair without the diagonal and corrects the diagonal's
  terms: equal to the sum with it and to float64, on related and unrelated
  diagonals. Without the option the tiles take the diagonal themselves."""
  x, y, gx, gy = _square_case(kind, 6)
  be = registry.get("xla", "sigmoid")
  calls = []
  real = be._sigmoid_sum  # pylint: disable=protected-access
  monkeypatch.setattr(be, "_sigmoid_sum", lambda *a, **k: calls.append(
      k["has_diagonal"]) or real(*a, **k))
  kw = dict(has_diagonal=True, groups=(jnp.asarray(gx), jnp.asarray(gy)),
            group_mode=mode)
  inside = be.sigmoid_sum(x, y, 7.0, -3.0, **kw)
  monkeypatch.setattr(type(be), "GROUP_DIAGONAL_OUTSIDE", True)
  outside = be.sigmoid_sum(x, y, 7.0, -3.0, **kw)
  assert calls == [True, False]
  ref = gr.sigmoid_tile(as64(x), as64(y), 7.0, -3.0, gx, gy, True, mode)
  assert_rel_close(inside, ref[0], rtol=1e-5, what="inside vs float64")
  assert_rel_close(outside, inside, rtol=1e-5, what="sum vs inside")
  assert_rel_close(outside, ref[0], rtol=1e-5, what="sum vs float64")
