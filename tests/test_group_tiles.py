"""``kernels.mosaic.group_tiles`` and the Mosaic kernels' use of it.

``tile_order`` and ``dirty_spans`` must never call a tile that holds a
related pair clean (for ids in any order), and on sorted ids must leave
only the tiles around each row block's own ids dirty. The Mosaic G panel
and forward must run exactly the tiles called clean without the compare
and select: with the true order / spans they match the masked reference;
told that every tile is clean they match the unmasked one (so the clean
loops do skip the mask). In the Mosaic GPU interpreter.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax.backends import panel_backward as pb
from infcl_jax.kernels.mosaic import group_tiles
from infcl_jax.kernels.mosaic import g_panel as mg_panel
from infcl_jax.kernels.mosaic import lse_fwd as mlse_fwd
from tests import group_reference as gref
from tests.helpers import as64, assert_rel_close, rand_emb
from tests.test_groups_mosaic import make_groups

pytestmark = pytest.mark.usefixtures("reset_mosaic_interpreter")

KINDS = ("mixed", "one_key_group", "distinct", "sparse", "pairs",
         "all_related")


def related_tiles(gx, gy, br, bc):
  """dirty[i, j]: tile (i, j) holds a related pair (brute force)."""
  rel = gx[:, None] == gy[None, :]
  ni, nj = len(gx) // br, len(gy) // bc
  return rel.reshape(ni, br, nj, bc).any(axis=(1, 3))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sort", [False, True])
def test_clean_tiles_hold_no_related_pair(kind, sort):
  br, bc = 16, 32
  gx, gy = make_groups(kind, 12 * br, 9 * bc, seed=3)
  if sort:
    gx, gy = np.sort(gx), np.sort(gy)
  order, n_clean = group_tiles.tile_order(jnp.asarray(gx), jnp.asarray(gy),
                                          br, bc)
  order, n_clean = np.asarray(order), int(n_clean)
  ni = len(gx) // br
  assert order.dtype == np.int32
  np.testing.assert_array_equal(np.sort(order), np.arange(ni * 9))
  clean, dirty = order[:n_clean], order[n_clean:]
  # Each part in grid order (row blocks fastest).
  assert np.all(np.diff(clean) > 0) and np.all(np.diff(dirty) > 0)
  held = related_tiles(gx, gy, br, bc)
  assert not held[clean % ni, clean // ni].any()
  if kind == "distinct" and sort:
    # Disjoint id ranges: every tile clean.
    assert n_clean == ni * 9
  start, stop = (np.asarray(v) for v in group_tiles.dirty_spans(
      jnp.asarray(gx), jnp.asarray(gy), br, bc))
  assert start.dtype == stop.dtype == np.int32
  j = np.arange(9)[None, :]
  inside = (j >= start[:, None]) & (j < stop[:, None])
  assert not (held & ~inside).any()
  dirty_grid = np.zeros((ni, 9), bool)
  dirty_grid[dirty % ni, dirty // ni] = True
  # The span runs from the first dirty tile to the last (empty: none).
  assert np.array_equal(inside.any(axis=1), dirty_grid.any(axis=1))
  assert np.all(dirty_grid[inside.any(axis=1), start[inside.any(axis=1)]])


def test_sorted_pairs_leave_a_band():
  """Two captions per image, ids sorted: a row block overlaps at most the
  column blocks holding its ids (one, two where a group or the block's
  range straddles a boundary), not the unsorted ~all."""
  br, bc, n = 128, 256, 4096
  gx, _ = make_groups("pairs", n, n, seed=5)
  order, n_clean = group_tiles.tile_order(jnp.asarray(np.sort(gx)),
                                          jnp.asarray(np.sort(gx)), br, bc)
  ni, nj = n // br, n // bc
  dirty = np.asarray(order)[int(n_clean):]
  per_row_block = np.bincount(dirty % ni, minlength=ni)
  assert per_row_block.min() >= 1 and per_row_block.max() <= 2
  _, unsorted_clean = group_tiles.tile_order(jnp.asarray(gx), jnp.asarray(gx),
                                             br, bc)
  assert int(unsorted_clean) == 0 < int(n_clean) == ni * nj - dirty.size


def _sorted_pairs(seed, n, m, d, n_pad, m_pad):
  """Sorted pairs whose related keys copy their rows (a tile that skipped
  the mask shows): (rng, x, y, gx, gy, xp, yp, padded groups), the inputs
  zero-padded, the ids padded with the last one."""
  rng = np.random.default_rng(seed)
  gx, gy = (np.sort(g) for g in make_groups("pairs", n, m, seed + 1))
  x, y = rand_emb(rng, n, d, jnp.bfloat16), rand_emb(rng, m, d, jnp.bfloat16)
  i, j = np.nonzero(gx[:, None] == gy[None, :])
  y = y.at[j].set(x[i])
  xp = jnp.zeros((n_pad, d), x.dtype).at[:n].set(x)
  yp = jnp.zeros((m_pad, d), y.dtype).at[:m].set(y)
  groups = (jnp.asarray(np.pad(gx, (0, n_pad - n), mode="edge")),
            jnp.asarray(np.pad(gy, (0, m_pad - m), mode="edge")))
  return rng, x, y, gx, gy, xp, yp, groups


def _panel_inputs(seed=0):
  """A 3 x 4 grid of (64, 128) tiles, padding in both directions."""
  n, m = 170, 500
  rng, _, _, _, _, xp, yp, groups = _sorted_pairs(seed, n, m, 64, 192, 512)
  r2 = jnp.full((192,), jnp.inf).at[:n].set(
      jnp.asarray(rng.uniform(2, 4, n), jnp.float32))
  c2 = jnp.full((512,), jnp.inf).at[:m].set(
      jnp.asarray(rng.uniform(2, 4, m), jnp.float32))
  params = jnp.asarray([3.0, -0.5, 0.7, -0.3], jnp.float32)
  return xp, yp, r2, c2, params, groups


def _panels(monkeypatch=None, all_clean=False):
  xp, yp, r2, c2, params, groups = _panel_inputs()
  kw = dict(rows=True, cols=True, mask=True)
  if all_clean:
    monkeypatch.setattr(
        group_tiles, "tile_order",
        lambda gx, gy, br, bc: (jnp.arange(12, dtype=jnp.int32),
                                jnp.asarray(12, jnp.int32)))
  out = mg_panel.g_panel(xp, yp, r2, c2, params, block_q=64, block_k=64,
                         num_programs=2, interpret=True, groups=groups, **kw)
  ref = lambda g: pb._xla_softmax_panel(  # pylint: disable=protected-access
      xp, yp, r2, c2, params, precision=None, groups=g, **kw)
  return out, ref(groups), ref(None), groups


def _close(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return np.allclose(a, b, rtol=1e-2, atol=1e-3)


def test_panel_masks_the_dirty_tiles_only():
  out, masked, _, groups = _panels()
  order, n_clean = group_tiles.tile_order(*groups, 64, 128)
  assert 0 < int(n_clean) < 12   # both loops run
  assert _close(out[0], masked[0])
  for o, e in zip(out[1:], masked[1:]):
    np.testing.assert_allclose(float(o), float(e), rtol=2e-3, atol=1e-4)


def test_panel_runs_the_clean_tiles_without_the_mask(monkeypatch):
  out, masked, plain, _ = _panels(monkeypatch, all_clean=True)
  assert _close(out[0], plain[0]) and not _close(out[0], masked[0])


def test_forward_masks_the_dirty_spans_only(monkeypatch):
  """The forward's three loops per row block: with the true spans the
  grouped LSEs; told that no tile is dirty, the ungrouped ones."""
  n, m = 200, 333
  _, x, y, gx, gy, xp, yp, groups = _sorted_pairs(6, n, m, 64, 256, 512)
  start, stop = group_tiles.dirty_spans(*groups, 64, 128)
  assert np.all(np.asarray(stop) - np.asarray(start) < 4)  # clean tiles too
  run = lambda: mlse_fwd.lse_fwd(xp, yp, 4.0, 0.5, n=n, m=m, rows=True,
                                 cols=True, block_q=64, block_k=64,
                                 num_programs=2, interpret=True,
                                 groups=groups)
  r, c = run()
  for out, ref, what in zip((r, c), gref.tile_lse(as64(x), as64(y), 4.0,
                                                  0.5, gx, gy), ("row", "col")):
    assert_rel_close(out, ref, rtol=2e-6, what=what)
  monkeypatch.setattr(group_tiles, "dirty_spans", lambda gx, gy, br, bc: (
      jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32)))
  r, c = run()
  never = (np.full(n, -1), np.full(m, -2))
  for out, ref, what in zip((r, c), gref.tile_lse(as64(x), as64(y), 4.0,
                                                  0.5, *never), ("row", "col")):
    assert_rel_close(out, ref, rtol=2e-6, what=what)
