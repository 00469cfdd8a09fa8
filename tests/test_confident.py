"""A confident model: the positive outside the log-sum-exp, on every path.

When p_pos -> 1 the loss LSE - s_pos and the gradient's p_pos - 1 are
differences of nearly equal numbers; the library computes them as
softplus(n - s_pos) and sigmoid(n - s_pos) from the negatives' LSE n
(docs/math.md, "A confident model"). Each case here is a confident model built to a chosen
float64 loss (``np_reference.confident_inputs``: per-row losses spread
around it), and the loss, the embedding gradients and d scale are compared
with the float64 reference (itself in that form), relative to the TRUE
values: at a loss of 1e-30 the gradient is ~1e-32 and must still point the
right way. 16-bit inputs are compared with the reference on the rounded
inputs.

Kernel backends run in their interpreters here (few, small cases, with
tiles smaller than the batch so that the positive sits in several tiles);
the GPU runs the same class compiled (``-m gpu``). The triton backend
subclasses ``TestConfidentKernels`` in ``test_native_triton.py``.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from infcl_jax import BlockSizes, contrastive_loss
from infcl_jax.backends import precision as precision_lib
from tests import np_reference
from tests.helpers import as64, seed_of

ON_GPU = jax.default_backend() == "gpu"
LOSSES = [10.0, 1e-4, 1e-9, 1e-20, 1e-30]
# Relative error bounds of the issue: float32 1e-3; 16-bit 3e-2 against the
# reference on the rounded inputs.
BOUND = {jnp.float32: 1e-3, jnp.bfloat16: 3e-2, jnp.float16: 3e-2}
XLA_TILES = BlockSizes(block_q=16, block_k=32)
KERNEL_TILES = BlockSizes(block_q=16, block_k=32, block_d=16, num_programs=3,
                          bwd_block_q=16, bwd_block_k=32, panel_rows=32)
MOSAIC_TILES = BlockSizes(block_q=64, block_k=128, block_d=64,
                          num_programs=3, bwd_block_q=64, bwd_block_k=128,
                          panel_rows=128)


def rel_err(actual, ref):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  assert np.all(np.isfinite(actual)), "non-finite values"
  return np.linalg.norm(actual - ref) / np.linalg.norm(ref)


def make_case(loss, n_x, n_y, d, dtype, *, direction="both", labels=None,
              groups=None):
  rng = np.random.default_rng(seed_of(loss, n_x, n_y, d, direction,
                                      labels is None, groups is None))
  x, y, t = np_reference.confident_inputs(
      rng, n_x, n_y, d, loss, direction=direction, labels=labels,
      groups=groups)
  x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
  rel = None if groups is None else np.equal.outer(groups, groups)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), t, 0.0, direction,
                                         labels, rel)
  return x, y, jnp.float32(t), ref


def reference_tiles(dtype, backend, depth, precision=None):
  """``np_reference.clip_loss_and_grads``'s ``tiles`` for this call:
  "tf32" where float32 runs on the GPU's TF32 tiles (a kernel backend at
  "default", its own default from ``TF32_MIN_DEPTH`` on), else None. TF32
  tiles are held to float64 of their TF32-rounded operands, as 16-bit
  inputs are to float64 of theirs: TF32's own logit error,
  ~4e-4 * scale / sqrt(D), is not the kernels' and grows with the scale
  (a very confident model at scale 130: 1e-3 at D = 200, 1e-2 at D = 64;
  docs/losses.md, "Float32 precision"). The interpreters compute exact
  float32: there, as everywhere else, plain float64."""
  if (ON_GPU and jnp.dtype(dtype) == jnp.float32 and backend != "xla"
      and precision_lib.f32_mode(precision, precision_lib.BY_DEPTH,
                                 depth) == "default"):
    return "tf32"
  return None


def check(out, ref, dtype, what, bound=None):
  """Loss, d image, d text and d scale within the bound (default
  ``BOUND[dtype]``), relative to the true values."""
  bound = BOUND[dtype] if bound is None else bound
  val, (dx, dy, dt) = out
  assert dx.dtype == dtype and dy.dtype == dtype
  errs = {"loss": abs(float(val) - ref[0]) / ref[0],
          "d image": rel_err(dx, ref[1]), "d text": rel_err(dy, ref[2]),
          "d scale": abs(float(dt) - ref[3]) / abs(ref[3])}
  bad = {k: f"{v:.2e}" for k, v in errs.items() if not v <= bound}
  assert not bad, f"{what}: true loss {ref[0]:.2e}, errors over {bound}: {bad}"


def loss_and_grads(x, y, t, labels=None, groups=None, **kw):
  """The loss and its gradients w.r.t. (x, y, t); one compiled program per
  static setting, shared by the confidence levels (only t changes)."""
  return _grad_fn(**kw)(x, y, t, labels, groups)


@functools.lru_cache(maxsize=None)
def _grad_fn(**kw):
  f = lambda x, y, t, labels, groups: contrastive_loss(
      x, y, t, labels=labels, groups=groups, **kw)
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


# ------------------------------------------------------------ xla, reference


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_both_directions(backend, dtype, loss):
  x, y, t, ref = make_case(loss, 61, 61, 16, dtype)
  out = loss_and_grads(x, y, t, backend=backend, block_sizes=(
      XLA_TILES if backend == "xla" else None))
  check(out, ref, dtype, backend)


@pytest.mark.parametrize("loss", [1e-4, 1e-30])
@pytest.mark.parametrize("direction,n_x,n_y,labels", [
    ("image_to_text", 37, 70, None),
    ("text_to_image", 70, 37, None),
    # Arbitrary positives, one key the positive of two queries.
    ("image_to_text", 37, 70, "perm"),
    ("text_to_image", 70, 37, "perm")])
def test_one_way_and_labels(direction, n_x, n_y, labels, loss):
  n_q, n_k = (n_y, n_x) if direction == "text_to_image" else (n_x, n_y)
  if labels == "perm":
    labels = np.random.default_rng(n_q).permutation(n_k)[:n_q]
    labels[1] = labels[0]
  for dtype in (jnp.float32, jnp.bfloat16):
    x, y, t, ref = make_case(loss, n_x, n_y, 16, dtype, direction=direction,
                             labels=labels)
    lab = None if labels is None else jnp.asarray(labels)
    out = loss_and_grads(x, y, t, direction=direction, labels=lab,
                         backend="xla", block_sizes=XLA_TILES)
    check(out, ref, dtype, f"{direction} labels={lab is not None}")


@pytest.mark.parametrize("loss", [10.0, 1e-9, 1e-30])
def test_groups_mask(loss):
  """Related pairs (other captions of an image) left out, the positive
  outside the LSE: the row stays confident although a related key sits as
  close as its positive."""
  groups = np.repeat(np.arange(20), 3)[:59]
  for dtype in (jnp.float32, jnp.bfloat16):
    x, y, t, ref = make_case(loss, 59, 59, 16, dtype, groups=groups)
    out = loss_and_grads(x, y, t, groups=jnp.asarray(groups), backend="xla",
                         block_sizes=XLA_TILES)
    check(out, ref, dtype, "groups mask")


# ------------------------------------------------------ "positives" groups
#
# Multi-positive InfoNCE: most queries have one related key (an image
# without duplicates), whose term is the confident form of the plain loss;
# a few groups of 2 and 3 have terms of at least log 2. Their gradients
# dominate the batch's, so beside the loss and the gradients' norms the
# rows of dx and dy that only the one-partner terms touch are checked on
# their own, relative to their own (tiny) true norm.


def mixed_ids(n, pair=False):
  """Group ids of n pairs: singletons, groups of 2 and 3, one across the
  8 devices' shards of 7 (rows 6, 7). ``pair``: (image ids, text ids,
  near) where also images 30 and 31 share text 30 alone (an id with two
  queries and one key), text 31 joins texts 40, 41 of images 40, 41, and
  images 3 and n - 6 swap their texts (a one-partner pair across
  devices); each image sits near its first related text (``near``)."""
  g = np.arange(n)
  for members in ([6, 7], [20, 21, 22], [n - 3, n - 2]):
    g[members] = members[0]
  if not pair:
    return g
  g_x, g_y = g.copy(), g.copy()
  g_x[31] = 30
  g_x[[40, 41]] = g_y[[31, 40, 41]] = 40
  g_y[[3, n - 6]] = g_y[[n - 6, 3]]
  near = np.arange(n)
  near[[31, 3, n - 6]] = 30, n - 6, 3
  return g_x, g_y, near


def make_positives(loss, n_x, n_y, d, dtype, g_x, g_y, *, direction="both",
                   near=None):
  rng = np.random.default_rng(seed_of("positives", loss, n_x, n_y, d,
                                      direction, near is None))
  x, y, t = np_reference.positives_inputs(rng, n_x, n_y, d, loss, g_x, g_y,
                                          direction=direction, near=near)
  x, y = jnp.asarray(x, dtype), jnp.asarray(y, dtype)
  rel = np.equal.outer(g_x, g_y)
  ref = np_reference.clip_loss_and_grads(as64(x), as64(y), t, 0.0, direction,
                                         None, rel, group_mode="positives")
  return x, y, jnp.float32(t), ref, (rel, direction)


def check_positives(out, ref, dtype, what, layout, bound=None):
  """``check``, and the rows of dx (dy) whose every entry of G is a
  one-partner term's (``one_partner_rows``) within the bound relative to
  their own true norm."""
  check(out, ref, dtype, what, bound)
  rel = layout[0]
  if dtype == jnp.float16 and ON_GPU and max(rel.sum(0).max(),
                                             rel.sum(1).max()) > 1:
    # The kernels' float16 G panels share one scale with the batch's
    # largest entries (``terms.confident_scale``), O(1) for a query with
    # several related keys: next to them a confident one-partner row's
    # entries fall below float16's range (docs/losses.md). Within the
    # bound relative to the whole gradient (above), not row by row.
    return
  one_x, one_y = one_partner_rows(*layout)
  bound = BOUND[dtype] if bound is None else bound
  for name, got, want, rows in (("d image", out[1][0], ref[1], one_x),
                                ("d text", out[1][1], ref[2], one_y)):
    assert rows.sum() >= 10, f"{what}: too few one-partner rows to check"
    err = rel_err(np.asarray(jnp.asarray(got, jnp.float32))[rows],
                  want[rows])
    assert err <= bound, (f"{what}: {name} of the one-partner rows, error "
                          f"{err:.2e} > {bound} (true loss {ref[0]:.2e})")


def one_partner_rows(rel, direction):
  """(images, texts): bool, those whose gradient comes only from terms of
  one related partner (tiny when confident): every term that counts and
  touches the row (its own, and its related partners') has one partner."""
  k_x, k_y = rel.sum(1), rel.sum(0)
  rows, cols = direction != "text_to_image", direction != "image_to_text"
  one_x = np.ones(len(k_x), bool)
  one_y = np.ones(len(k_y), bool)
  if rows:
    one_x &= k_x == 1
    one_y &= ~np.any(rel & (k_x[:, None] > 1), axis=0)
  if cols:
    one_y &= k_y == 1
    one_x &= ~np.any(rel & (k_y[None, :] > 1), axis=1)
  return one_x, one_y


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", ["xla", "reference"])
def test_positives(backend, dtype, loss):
  """group_mode="positives": mixed groups (one id array, then a pair of id
  arrays with an id of two images and one text), and every id distinct,
  where the loss is the plain one and every term is confident."""
  tiles = XLA_TILES if backend == "xla" else None
  n = 59
  g_x, g_y, near = mixed_ids(n, pair=True)
  for what, ids, nr in (("mixed", (mixed_ids(n),) * 2, None),
                        ("pair ids", (g_x, g_y), near),
                        ("distinct", (np.arange(n),) * 2, None)):
    x, y, t, ref, layout = make_positives(loss, n, n, 16, dtype, *ids,
                                          near=nr)
    out = loss_and_grads(x, y, t, groups=tuple(map(jnp.asarray, ids)),
                         group_mode="positives", backend=backend,
                         block_sizes=tiles)
    check_positives(out, ref, dtype, f"{backend} positives {what}", layout)


@pytest.mark.parametrize("loss", [1e-4, 1e-30])
@pytest.mark.parametrize("direction", ["image_to_text", "text_to_image"])
def test_positives_one_way(direction, loss):
  """One-way "positives" with extra keys: one of them joins a query's
  group (its query then has two related keys), the others are related to
  no query."""
  n_q, n_k = 37, 70
  g_q = mixed_ids(n_q)
  g_k = np.concatenate([g_q, 1000 + np.arange(n_k - n_q)])
  g_k[45] = g_q[3]
  ids = (g_k, g_q) if direction == "text_to_image" else (g_q, g_k)
  n_x, n_y = (n_k, n_q) if direction == "text_to_image" else (n_q, n_k)
  for dtype in (jnp.float32, jnp.bfloat16):
    x, y, t, ref, layout = make_positives(loss, n_x, n_y, 16, dtype, *ids,
                                          direction=direction)
    out = loss_and_grads(x, y, t, groups=tuple(map(jnp.asarray, ids)),
                         group_mode="positives", direction=direction,
                         backend="xla", block_sizes=XLA_TILES)
    check_positives(out, ref, dtype, f"positives {direction}", layout)


def test_positives_oracle():
  """The float64 "positives" oracle: its loss is LSE - mean of the related
  logits, its gradients match central differences."""
  rng = np.random.default_rng(11)
  g_x = np.array([0, 1, 1, 2, 3, 3, 3, 4, 5, 6, 7, 8])
  g_y = g_x.copy()
  g_x[9], g_y[9] = 7, 2  # A pair of id arrays: ids of 1 : 2 and 2 : 1.
  rel = np.equal.outer(g_x, g_y)
  x, y = rng.standard_normal((12, 5)), rng.standard_normal((12, 5))

  def plain(x, y, t, direction):
    s = t * (x @ y.T)
    term = lambda s, rel: np.mean(np.log(np.exp(s).sum(1)) - np.sum(
        np.where(rel, s, 0.0), 1) / rel.sum(1))
    r, c = term(s, rel), term(s.T, rel.T)
    return {"both": 0.5 * (r + c), "image_to_text": r,
            "text_to_image": c}[direction]

  for direction in ("both", "image_to_text", "text_to_image"):
    loss, dx, dy, dt, _ = np_reference.clip_loss_and_grads(
        x, y, 1.7, 0.0, direction, None, rel, group_mode="positives")
    assert abs(loss - plain(x, y, 1.7, direction)) < 1e-12
    eps = 1e-6
    for a, grad in ((x, dx), (y, dy)):
      num = np.zeros_like(a)
      for i in np.ndindex(a.shape):
        a[i] += eps
        up = plain(x, y, 1.7, direction)
        a[i] -= 2 * eps
        num[i] = (up - plain(x, y, 1.7, direction)) / (2 * eps)
        a[i] += eps
      np.testing.assert_allclose(grad, num, atol=1e-8)
    num_t = (plain(x, y, 1.7 + eps, direction)
             - plain(x, y, 1.7 - eps, direction)) / (2 * eps)
    assert abs(dt - num_t) < 1e-8


def test_cancelling_form_would_fail():
  """The check has teeth: LSE - s_pos in float32 (the form this replaced)
  is far off at the same confident inputs where the library is within
  1e-3."""
  x, y, t, ref = make_case(1e-9, 61, 61, 16, jnp.float32)
  s = t * (x @ y.T)
  naive = 0.5 * (jnp.mean(jax.nn.logsumexp(s, 1) - jnp.diagonal(s))
                 + jnp.mean(jax.nn.logsumexp(s, 0) - jnp.diagonal(s)))
  assert abs(float(naive) - ref[0]) / ref[0] > 0.1
  val = contrastive_loss(x, y, t, backend="xla")
  assert abs(float(val) - ref[0]) / ref[0] < 1e-3


def test_nan_is_not_hidden():
  """A NaN embedding still gives a NaN loss and NaN gradients."""
  x, y, t, _ = make_case(1e-9, 20, 20, 16, jnp.float32)
  x = x.at[3, 2].set(jnp.nan)
  val, (dx, _, _) = loss_and_grads(x, y, t, backend="xla")
  assert np.isnan(float(val)) and np.isnan(np.asarray(dx)).any()


# ----------------------------------------------------------- across devices


def _mesh(n):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices (conftest.py sets XLA_FLAGS)")
  return Mesh(np.array(jax.devices()[:n]), ("data",))


@pytest.mark.parametrize("loss", [10.0, 1e-9, 1e-30])
@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_across_8_devices(strategy, loss):
  """The ring and the gather on 8 devices, odd local batches (7 rows), both
  directions and a one-way direction with labels spanning devices."""
  mesh = _mesh(8)
  for dtype in (jnp.float32, jnp.bfloat16):
    x, y, t, ref = make_case(loss, 56, 56, 16, dtype)

    @functools.partial(jax.shard_map, mesh=mesh,
                       in_specs=(P("data"), P("data"), P()), out_specs=P())
    def both(x, y, t):
      return contrastive_loss(x, y, t, axis_name="data", strategy=strategy,
                              backend="xla", block_sizes=XLA_TILES)

    check(jax.jit(jax.value_and_grad(both, argnums=(0, 1, 2)))(x, y, t), ref,
          dtype, f"{strategy} both")

  labels = np.random.default_rng(5).permutation(56)
  x, y, t, ref = make_case(loss, 56, 56, 16, jnp.float32,
                           direction="image_to_text", labels=labels)

  @functools.partial(jax.shard_map, mesh=mesh,
                     in_specs=(P("data"), P("data"), P(), P("data")),
                     out_specs=P())
  def one_way(x, y, t, lab):
    return contrastive_loss(x, y, t, direction="image_to_text", labels=lab,
                            axis_name="data", strategy=strategy,
                            backend="xla", block_sizes=XLA_TILES)

  check(jax.jit(jax.value_and_grad(one_way, argnums=(0, 1, 2)))(
      x, y, t, jnp.asarray(labels)), ref, jnp.float32, f"{strategy} labels")


@pytest.mark.parametrize("loss", [10.0, 1e-9, 1e-30])
@pytest.mark.parametrize("strategy", ["ring", "gather"])
def test_positives_across_8_devices(strategy, loss):
  """"positives" on 8 devices (7 rows each): groups across the shards, a
  pair of id arrays (an id of two images and one text, whose pairs live on
  different devices than that text); then one-way with extra keys."""
  _mesh(8)
  n = 56
  g_x, g_y, near = mixed_ids(n, pair=True)
  both = _sharded_positives(strategy, "both")
  for dtype in (jnp.float32, jnp.bfloat16):
    x, y, t, ref, layout = make_positives(loss, n, n, 16, dtype, g_x, g_y,
                                          near=near)
    out = both(x, y, t, jnp.asarray(g_x), jnp.asarray(g_y))
    check_positives(out, ref, dtype, f"{strategy} positives both", layout)

  g_q = mixed_ids(n)
  g_k = np.concatenate([g_q, 1000 + np.arange(8)])
  g_k[60] = g_q[9]  # Query 9 (device 1) gains a key on device 7.
  x, y, t, ref, layout = make_positives(loss, n, n + 8, 16, jnp.float32, g_q,
                                        g_k, direction="image_to_text")
  out = _sharded_positives(strategy, "image_to_text")(
      x, y, t, jnp.asarray(g_q), jnp.asarray(g_k))
  check_positives(out, ref, jnp.float32, f"{strategy} positives one-way",
                  layout)


@functools.lru_cache(maxsize=None)
def _sharded_positives(strategy, direction):
  """The loss and gradients of "positives" on 8 devices, one compiled
  program per setting (shared by the confidence levels)."""
  @functools.partial(jax.shard_map, mesh=_mesh(8),
                     in_specs=(P("data"), P("data"), P(), P("data"),
                               P("data")), out_specs=P())
  def f(x, y, t, gx, gy):
    return contrastive_loss(x, y, t, groups=(gx, gy), group_mode="positives",
                            direction=direction, axis_name="data",
                            strategy=strategy, backend="xla",
                            block_sizes=XLA_TILES)

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


# ------------------------------------------------------------------ kernels


class TestConfidentKernels:
  """The kernel backends, in their interpreters off the GPU (two confident
  levels, both directions, the one-way direction with labels); compiled on
  the GPU with all levels and dtypes at odd sizes (``-m gpu``)."""
  NAME = "pallas"
  TILES = KERNEL_TILES
  N = 45

  def _run(self, loss, dtype, direction="both", labels=None, n=None):
    n = n or self.N
    n_y = n if direction == "both" else n + 6
    x, y, t, ref = make_case(loss, n, n_y, 16, dtype, direction=direction,
                             labels=labels)
    lab = None if labels is None else jnp.asarray(labels)
    out = loss_and_grads(x, y, t, direction=direction, labels=lab,
                         backend=self.NAME,
                         block_sizes=None if ON_GPU else self.TILES)
    check(out, ref, dtype, f"{self.NAME} {direction}")

  def _run_positives(self, loss, dtype, n=None):
    """group_mode="positives", both directions, a pair of id arrays with
    singletons, groups of 2 and 3 and an id of two images and one text."""
    n = n or self.N
    g_x, g_y, near = mixed_ids(n, pair=True)
    x, y, t, ref, layout = make_positives(loss, n, n, 16, dtype, g_x, g_y,
                                          near=near)
    out = loss_and_grads(x, y, t, groups=(jnp.asarray(g_x),
                                          jnp.asarray(g_y)),
                         group_mode="positives", backend=self.NAME,
                         block_sizes=None if ON_GPU else self.TILES)
    check_positives(out, ref, dtype, f"{self.NAME} positives", layout)

  @pytest.mark.skipif(ON_GPU, reason="the GPU runs test_gpu_levels")
  @pytest.mark.parametrize("loss", [1e-4, 1e-30])
  def test_interpret(self, loss):
    self._run(loss, jnp.float32)
    self._run(loss, jnp.bfloat16)
    labels = np.random.default_rng(3).permutation(self.N + 6)[:self.N]
    self._run(loss, jnp.float32, "image_to_text", labels)
    self._run_positives(loss, jnp.float32)

  @pytest.mark.gpu
  @pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
  @pytest.mark.parametrize("loss", LOSSES)
  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16,
                                     jnp.float16])
  def test_gpu_levels(self, dtype, loss):
    if dtype == jnp.float16 and loss < 1e-4:
      # float16's smallest normal is 6e-5: the gradients of a loss below
      # ~1e-4 (their entries ~ scale * loss / B) are not representable in
      # the float16 the caller gets back, whatever the kernel did.
      pytest.skip("float16 gradients underflow below a loss of ~1e-4")
    self._run(loss, dtype, n=1031)
    self._run_positives(loss, dtype, n=1031)
    if loss in (1e-4, 1e-30):
      self._run(loss, dtype, "image_to_text", None, n=517)


class TestConfidentMosaic(TestConfidentKernels):
  NAME = "mosaic"
  TILES = MOSAIC_TILES
  N = 129

  @pytest.fixture(autouse=True)
  def _reset(self, reset_mosaic_interpreter):
    yield
