"""The float32 precision API (``precision=``, ``BlockSizes(f32_precision=)``
without block sizes) and float32 fidelity against float64.

CPU: the policy, TF32 rounding, the operands the Triton kernels get, the
losses' ``precision=`` against float64 (xla, Pallas interpreter).
GPU (``-m gpu``): every backend on inputs that look trained (related pairs
near each other, high scale, small D): the default float32 path within
1e-3 of float64 everywhere, and the TF32 path ("default") on the inputs
where TF32's logits allow it.
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import infcl_jax
from infcl_jax import BlockSizes
from infcl_jax.backends import precision as precision_lib
from infcl_jax.backends import registry
from tests.helpers import seed_of

ON_GPU = jax.default_backend() == "gpu"


# ------------------------------------------------------------------ policy


def _tf32_reference(x):
  """Round to nearest, ties to even, at 10 mantissa bits, in float64:
  independent of the bit trick it checks."""
  x = np.asarray(x, np.float64)
  out = x.copy()
  fin = np.isfinite(x) & (x != 0)
  e = np.maximum(np.floor(np.log2(np.abs(x[fin]))), -126)
  ulp = 2.0 ** (e - 10)
  r = np.round(x[fin] / ulp) * ulp  # np.round: ties to even
  r[np.abs(r) >= 2.0 ** 128] = np.inf * np.sign(r[np.abs(r) >= 2.0 ** 128])
  out[fin] = r
  return out.astype(np.float32)


def test_round_tf32_is_round_to_nearest_even():
  rng = np.random.default_rng(seed_of("round_tf32"))
  mags = 2.0 ** rng.uniform(-140, 127, 4000)
  x = (rng.choice([-1.0, 1.0], 4000) * mags).astype(np.float32)
  one = np.float32(1.0)
  edge = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0,
                   one + np.float32(2.0 ** -11),  # a tie: rounds to 1 (even)
                   one + np.float32(3 * 2.0 ** -11),  # a tie: rounds up
                   one + np.float32(2.0 ** -11 + 2.0 ** -20),  # above a tie
                   np.finfo(np.float32).max, 2.0 ** -149, 2.0 ** -127],
                  np.float32)
  x = np.concatenate([x, edge])
  got = np.asarray(precision_lib.round_tf32(jnp.asarray(x)))
  want = _tf32_reference(x)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(x))
  ok = ~np.isnan(x)
  np.testing.assert_array_equal(got[ok], want[ok])
  # TF32 has 10 mantissa bits: the low 13 of the float32 are zero.
  bits = got[np.isfinite(got)].view(np.uint32)
  assert not np.any(bits & 0x1FFF)


def test_precision_names_and_order():
  """Explicit setting, then JAX's switch, then the backend's default: on
  the kernel backends TF32 from ``TF32_MIN_DEPTH`` on and 3-pass below it,
  "highest" on xla."""
  hi, high, dflt = (lax.Precision.HIGHEST, lax.Precision.HIGH,
                    lax.Precision.DEFAULT)
  pallas = registry.get("pallas", "softmax")
  xla = registry.get("xla", "softmax")
  f32, bf16 = jnp.float32, jnp.bfloat16
  deep, shallow = precision_lib.TF32_MIN_DEPTH, precision_lib.TF32_MIN_DEPTH - 1
  cases = [(pallas, None, f32, deep, dflt, hi),
           (pallas, None, f32, shallow, high, hi),
           (pallas, "default", f32, 3, dflt, dflt),
           (pallas, "tf32", f32, deep, dflt, dflt),
           (pallas, "high", f32, deep, high, high),
           (pallas, "highest", bf16, deep, dflt, dflt),
           (pallas, None, bf16, 3, dflt, dflt),
           (xla, None, f32, deep, hi, hi), (xla, None, f32, 3, hi, hi),
           (xla, "default", f32, deep, dflt, dflt),
           (xla, "high", f32, deep, high, high)]
  for be, f32p, dt, d, outside, inside in cases:
    bs = be.block_sizes(BlockSizes(f32_precision=f32p), dt)
    assert be.precision(bs, dt, d) == outside, (be.name, f32p, dt, d)
    with jax.default_matmul_precision("highest"):
      assert be.precision(bs, dt, d) == inside, (be.name, f32p, dt, d)
  # TF32 tiles (the positive put back, the Triton operands rounded):
  # float32 at "default", explicit or the kernels' default at depth.
  tf32 = precision_lib.tf32_tiles
  assert tf32(f32, None, pallas.F32_DEFAULT, deep) is True
  assert tf32(f32, None, pallas.F32_DEFAULT, shallow) is False
  assert tf32(f32, "high", pallas.F32_DEFAULT, deep) is False
  assert tf32(f32, "default", pallas.F32_DEFAULT, 3) is True
  assert tf32(bf16, "default", pallas.F32_DEFAULT, deep) is False
  assert tf32(f32, None, xla.F32_DEFAULT, deep) is False
  assert tf32(f32, "tf32", xla.F32_DEFAULT, 3) is True
  with jax.default_matmul_precision("highest"):
    assert tf32(f32, None, pallas.F32_DEFAULT, deep) is False


def test_block_sizes_without_tiles_keep_each_backends_tiles():
  """``BlockSizes(f32_precision=...)`` alone: the backend's own tiles and
  tuning, this precision; "tf32" is "default" (one jit cache entry)."""
  only = BlockSizes(f32_precision="highest")
  assert not only.tiles and only.block_q is None
  assert BlockSizes(f32_precision="tf32") == BlockSizes(
      f32_precision="default")
  for name in ("xla", "pallas", "mosaic"):
    be = registry.get(name, "softmax")
    for dt in (jnp.float32, jnp.bfloat16):
      got = be.block_sizes(only, dt)
      want = dataclasses.replace(be.default_block_sizes(be.platform, dt),
                                 f32_precision="highest")
      assert got == want, (name, dt)
  tiles = BlockSizes(block_q=16, block_k=32, f32_precision="high")
  assert registry.get("xla", "softmax").block_sizes(tiles, jnp.float32) is tiles


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_d=32), r"BlockSizes.block_d needs block_q and block_k"),
    (dict(block_q=32), r"block_q and block_k together"),
    (dict(block_k=32, f32_precision="high"), r"block_q and block_k together"),
    (dict(f32_precision="fp16"), r"f32_precision must be one of"),
])
def test_block_sizes_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    BlockSizes(**kwargs)


def test_precision_argument_errors():
  x = jnp.ones((8, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"precision must be one of \('default"):
    infcl_jax.contrastive_loss(x, x, 1.0, precision="fp16")
  with pytest.raises(ValueError, match=r"precision='high' and "
                     r"block_sizes.f32_precision='highest' disagree"):
    infcl_jax.sigmoid_loss(x, x, 1.0, 0.0, precision="high",
                           block_sizes=BlockSizes(f32_precision="highest"))


def test_triton_operands_rounded_on_compiled_tf32_tiles_only():
  """Compiled TF32 tiles get operands rounded to nearest TF32 (Triton's
  TF32 dot truncates); the interpreter and the other precisions get them
  as they are."""
  from infcl_jax.backends import pallas  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed_of("operands"))
  x = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
  gpu = pallas.PallasBackend(platform="gpu")
  cpu = pallas.PallasBackend(platform="cpu")
  for be, f32p, rounded in [(gpu, "default", True), (gpu, "high", False),
                            (gpu, "highest", False), (cpu, "default", False)]:
    bs = be.block_sizes(BlockSizes(f32_precision=f32p), jnp.float32)
    xo, yo = be.tiles._operands(x, y, bs)  # pylint: disable=protected-access
    want = (precision_lib.round_tf32(x), precision_lib.round_tf32(y)) if (
        rounded) else (x, y)
    np.testing.assert_array_equal(np.asarray(xo), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(yo), np.asarray(want[1]))
  # "high": Pallas' lowering needs the 3-pass TF32 preset (its reading of
  # Precision.HIGH is plain TF32); the interpreter runs exact float32.
  # pylint: disable=protected-access
  assert gpu.tiles._kernel_precision(lax.Precision.HIGH) == (
      lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
  assert cpu.tiles._kernel_precision(lax.Precision.HIGH) == (
      lax.Precision.HIGHEST)
  assert gpu.tiles._kernel_precision(lax.Precision.DEFAULT) == (
      lax.Precision.DEFAULT)


# ------------------------------------------------------ float64 references


def _trained(n, m, d, noise, seed):
  """Unit-norm pairs near each other (a trained model): key i is query i
  plus noise; both normalised."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((max(n, m), d))
  a /= np.linalg.norm(a, axis=1, keepdims=True)
  b = a + noise * rng.standard_normal(a.shape) / np.sqrt(d)
  b /= np.linalg.norm(b, axis=1, keepdims=True)
  return a[:n].astype(np.float32), b[:m].astype(np.float32)


def _lse(a, axis):
  mx = np.max(a, axis=axis, keepdims=True)
  return np.squeeze(mx, axis) + np.log(np.sum(np.exp(a - mx), axis=axis))


def softmax64(x, y, t, direction):
  """Float64 (loss, dx, dy, terms_x, terms_y): terms_* are each row's
  t * sum_j |G_ij| ||y_j|| (the summed magnitudes its gradient adds up)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  s = t * x @ y.T
  n, m = s.shape
  k = min(n, m)
  e = np.zeros_like(s)
  e[np.arange(k), np.arange(k)] = 1.0
  diag = np.diagonal(s)[:k]
  # Per direction taken: its mean LSE - positive, P = its softmax, over
  # its queries (rows or columns).
  taken = []
  if direction in ("both", "image_to_text"):
    r = _lse(s, 1)
    taken.append((np.mean(r - diag), np.exp(s - r[:, None]), n))
  if direction in ("both", "text_to_image"):
    c = _lse(s, 0)
    taken.append((np.mean(c - diag), np.exp(s - c[None, :]), m))
  w = 1.0 / len(taken)
  loss = w * sum(term for term, _, _ in taken)
  g = sum(w * (p - e) / q for _, p, q in taken)
  gabs = sum(w * (p + e) / q for _, p, q in taken)
  return (loss, t * g @ y, t * g.T @ x, t * gabs @ np.linalg.norm(y, axis=1),
          t * gabs.T @ np.linalg.norm(x, axis=1))


def sigmoid64(x, y, t, b):
  """Float64 (loss, dx, dy, terms_x, terms_y) of the SigLIP loss."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  s = t * x @ y.T + b
  z = -np.ones_like(s)
  np.fill_diagonal(z, 1.0)
  n = s.shape[0]
  loss = np.sum(np.logaddexp(0.0, -z * s)) / n
  g = -z / (1.0 + np.exp(z * s)) / n
  return (loss, t * g @ y, t * g.T @ x, t * np.abs(g) @ np.linalg.norm(
      y, axis=1), t * np.abs(g).T @ np.linalg.norm(x, axis=1))


def assert_fidelity(got, ref, what, rtol=1e-3):
  """Loss relative error, and the gradients' error relative to the summed
  magnitudes of their terms (norm over rows), both at most ``rtol``."""
  val, gx, gy = got
  loss, dx, dy, tx, ty = ref
  rel = abs(float(val) - loss) / abs(loss)
  assert rel <= rtol, f"{what}: loss {float(val)!r} vs {loss!r}: rel {rel:.2e}"
  for name, a, r, terms in (("dx", gx, dx, tx), ("dy", gy, dy, ty)):
    a = np.asarray(a, np.float64)
    err = np.linalg.norm(np.linalg.norm(a - r, axis=1))
    bound = rtol * np.linalg.norm(terms)
    assert err <= bound, f"{what}: {name} err {err:.3e} > {bound:.3e}"


def _softmax_run(backend, x, y, t, direction, precision):
  f = lambda x, y: infcl_jax.contrastive_loss(  # noqa: E731
      x, y, jnp.float32(t), direction=direction, backend=backend,
      precision=precision)
  val, (gx, gy) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, y)
  return val, gx, gy


def _sigmoid_run(backend, x, y, t, b, precision):
  f = lambda x, y: infcl_jax.sigmoid_loss(  # noqa: E731
      x, y, jnp.float32(t), jnp.float32(b), backend=backend,
      precision=precision)
  val, (gx, gy) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, y)
  return val, gx, gy


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("precision", [None, "default", "high", "highest"])
def test_precision_argument_against_float64_on_the_cpu(backend, precision):
  """Off the GPU every precision is exact float32: ``precision=`` reaches
  the tiles (a bad one would fail to trace) and the loss stays float64's
  to float32's own rounding (LSE - positive at logits ~20: ~1e-6
  absolute on a loss ~0.1)."""
  x, y = _trained(24, 40, 8, 0.5, seed_of("cpu", backend, precision))
  assert_fidelity(_softmax_run(backend, x, y, 20.0, "image_to_text",
                               precision),
                  softmax64(x, y, 20.0, "image_to_text"),
                  f"softmax {backend} {precision}", rtol=1e-4)
  x, y = _trained(24, 24, 8, 0.5, seed_of("cpu sigmoid", backend, precision))
  assert_fidelity(_sigmoid_run(backend, x, y, 20.0, -5.0, precision),
                  sigmoid64(x, y, 20.0, -5.0),
                  f"sigmoid {backend} {precision}", rtol=1e-4)


def test_references_match_np_reference():
  """This file's float64 references agree with tests/np_reference (whose
  gradients are checked by finite differences)."""
  from tests import np_reference  # pylint: disable=import-outside-toplevel
  for n, m, direction in [(9, 9, "both"), (7, 11, "image_to_text"),
                          (11, 7, "text_to_image")]:
    x, y = _trained(n, m, 5, 1.0, seed_of("refs", direction))
    want = np_reference.clip_loss_and_grads(x, y, 9.0, 0.0, direction)
    for a, b in zip(softmax64(x, y, 9.0, direction)[:3], want[:3]):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)
  x, y = _trained(9, 9, 5, 1.0, seed_of("refs sigmoid"))
  want = np_reference.sigmoid_loss_and_grads(x, y, 9.0, -3.0)
  for a, b in zip(sigmoid64(x, y, 9.0, -3.0)[:3], want[:3]):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15)


def _rounded_tf32_tiles64(x, y, t):
  """A float64 model of the kernels' TF32 tiles (direction "both"): the
  operands of every product rounded to nearest TF32 (as compiled TF32
  tiles get them), products and sums exact (a TF32 x TF32 product is exact
  in float32; the float32 accumulation's error is float32's own), each
  positive put back with its exact logit. Returns (loss, dx, dy)."""
  r = lambda a: np.asarray(precision_lib.round_tf32(  # noqa: E731
      jnp.asarray(a, jnp.float32)), np.float64)
  x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
  s = t * r(x) @ r(y).T
  pos = t * np.sum(x64 * y64, axis=1)
  n = s.shape[0]
  s[np.arange(n), np.arange(n)] = pos
  rows, cols = _lse(s, 1), _lse(s, 0)
  loss = 0.5 * (np.mean(rows - pos) + np.mean(cols - pos))
  g = 0.5 * (np.exp(s - rows[:, None]) + np.exp(s - cols[None, :])
             - 2.0 * np.eye(n)) / n
  return loss, t * r(g) @ r(y), t * r(g.T) @ r(x)


def test_tf32_min_depth_keeps_the_gradients_within_1e3():
  """Why the kernels' float32 default switches to TF32 at
  ``TF32_MIN_DEPTH``: on the float64 model of rounded TF32 tiles, at scale
  100 on trained-looking inputs, the gradients are within 1e-3 (relative to
  their summed terms) from that depth on with a margin of at least 2, and
  past 1e-3 at D = 3, where the default stays 3-pass."""
  def grad_err(d, noise):
    x, y = _trained(1024, 1024, d, noise, seed_of("min depth", d))
    loss, dx, dy, tx, ty = softmax64(x, y, 100.0, "both")
    got = _rounded_tf32_tiles64(x, y, 100.0)
    assert abs(got[0] - loss) <= 2e-4 * abs(loss), (d, got[0], loss)
    return max(np.linalg.norm(np.linalg.norm(a - b, axis=1)) /
               np.linalg.norm(terms)
               for a, b, terms in ((got[1], dx, tx), (got[2], dy, ty)))
  assert grad_err(precision_lib.TF32_MIN_DEPTH, 2.0) <= 5e-4
  assert grad_err(3, 1.0) > 1e-3


def test_scaled_half_keeps_each_column_to_float16_rounding():
  """float16 copies for the 16-bit GEMMs: each column over a power of two
  (so 1e6 and 1e-9 columns keep 2^-11 relative), zero and non-finite
  columns unscaled (NaN and inf reach the copy)."""
  from infcl_jax.backends import panel_backward as pb  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed_of("scaled half"))
  a = rng.standard_normal((37, 6)).astype(np.float32)
  a[:, 0] *= 1e6
  a[:, 1] *= 1e-9
  a[:, 2] = 0.0
  a[3, 4] = np.nan
  a[5, 5] = np.inf
  h, s = pb.scaled_half(jnp.asarray(a))
  assert h.dtype == jnp.float16
  s = np.asarray(s, np.float64)
  assert np.all(np.log2(s) == np.round(np.log2(s)))  # powers of two
  back = np.asarray(h, np.float64) * s
  ok = slice(0, 4)
  np.testing.assert_allclose(back[:, ok], a[:, ok], rtol=2.0 ** -11, atol=0)
  assert s[2] == 1.0 and not back[:, 2].any()
  assert np.isnan(back[3, 4]) and s[4] == 1.0
  assert np.isinf(back[5, 5]) and s[5] == 1.0


@pytest.mark.parametrize("d,t,noise", [(64, 100.0, 2.0), (200, 50.0, 2.0),
                                       (768, 50.0, 3.0)])
def test_half_panels_within_1e3_of_float64(monkeypatch, d, t, noise):
  """The float16 G and 16-bit GEMMs that float32 TF32 tiles take on the GPU
  (``triton_tiles.TritonTiles._half_panels``), forced on here over XLA's panels
  (whose logits are exact float32 on the CPU, so what is left is G's and
  the operands' float16 rounding): within 1e-3 of float64 on trained-looking
  inputs, the loss untouched. NaN still reaches the gradients."""
  from infcl_jax.backends import triton_tiles  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(triton_tiles.TritonTiles, "_half_panels",
                      lambda self, x, bs: x.dtype == jnp.float32)
  x, y = _trained(515, 515, d, noise, seed_of("half panels", d, t))
  bs = BlockSizes(block_q=64, block_k=64, block_d=32, bwd_block_q=64,
                  bwd_block_k=64, panel_rows=128, bwd_impl="xla")
  f = lambda x, y: infcl_jax.contrastive_loss(  # noqa: E731
      x, y, jnp.float32(t), backend="pallas", block_sizes=bs)
  grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
  # The GEMMs took float16 operands.
  assert re.search(r"dot_general[^\n]*xf16>", grad.lower(x, y).as_text())
  val, (gx, gy) = grad(x, y)
  assert_fidelity((val, gx, gy), softmax64(x, y, t, "both"),
                  f"half panels D {d} scale {t}")
  x_nan = x.copy()
  x_nan[7, 3] = np.nan
  _, (gx, gy) = grad(x_nan, y)
  assert np.isnan(np.asarray(gx)).any() and np.isnan(np.asarray(gy)).any()


# ------------------------------------------------------------------ GPU

BACKENDS = ["xla", "pallas", "mosaic", "triton"]


def _need(backend, family="softmax"):
  if not registry.available(backend, family):
    pytest.skip(f"backend {backend!r} does not run here")


# (images, texts, D, scale, direction, noise): trained-looking inputs, from
# a thousand to several thousand rows, D from 3 to 768, scale to 100, with
# losses of 5e-3 to 30. A smaller loss is not a float32 question: the loss
# is mean(LSE) - mean(s_pos) in float32, whose rounding (~4 eps |s|max
# absolute, ``helpers.loss_floor``) is then beyond 1e-3 of it on every
# backend and precision (measured: 0.0 for a float64 loss of 3.7e-6 at
# scale 50 on all four backends, "highest" included).
TF32_OK = [(2500, 1000, 96, 50.0, "text_to_image", 2.0),
           (1000, 2500, 96, 50.0, "image_to_text", 2.0),
           (3001, 3001, 200, 30.0, "both", 2.0),
           (3001, 3001, 200, 50.0, "both", 3.0),
           (2048, 2048, 768, 50.0, "both", 3.0),
           (2048, 2048, 64, 100.0, "both", 2.0)]  # TF32_MIN_DEPTH's edge
# Small D at scale 100: TF32's logits err by ~4e-4 * scale / sqrt(D) (~2e-2
# at D = 3), which the gradients carry; the default path holds them to 1e-3.
SMALL_D = [(2048, 2048, 32, 100.0, "both", 2.0),
           (2048, 2048, 16, 100.0, "both", 1.0),
           (1024, 1024, 3, 100.0, "both", 1.0)]
SIGMOID = [(2048, 16, 100.0, -10.0, 0.3), (3001, 200, 30.0, -10.0, 1.0),
           (2048, 768, 100.0, -15.0, 1.0)]


def _case_id(c):
  return "x".join(map(str, c[:3])) + f"-t{c[3]:g}-{c[4]}-n{c[5]:g}"


def _softmax_case(case, backend, precision):
  n, m, d, t, direction, noise = case
  x, y = _trained(n, m, d, noise, seed_of(n, m, d, noise))
  assert_fidelity(_softmax_run(backend, x, y, t, direction, precision),
                  softmax64(x, y, t, direction),
                  f"{backend} {precision} {_case_id(case)}")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: off it every "
                    "precision is exact float32")
@pytest.mark.parametrize("case", SMALL_D + TF32_OK, ids=_case_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_float32_within_1e3_of_float64(backend, case):
  """Every backend's default float32 path, every direction, D from 3."""
  _need(backend)
  _softmax_case(case, backend, None)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: off it every "
                    "precision is exact float32")
@pytest.mark.parametrize("case", TF32_OK, ids=_case_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tf32_within_1e3_where_its_logits_allow(backend, case):
  """precision="default" (TF32, positives put back in float32) on every
  backend, the Triton-language kernels included: with their TF32 dot's
  truncation such cases were 1.5e-3 to 4.4e-3 off (a float64 model of the
  truncation; 3.2e-3 measured on the H200 at 3001 x 3001 x 200)."""
  _need(backend)
  _softmax_case(case, backend, "default")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU: off it every "
                    "precision is exact float32")
@pytest.mark.parametrize("precision", [None])
@pytest.mark.parametrize("case", SIGMOID,
                         ids=lambda c: f"{c[0]}x{c[1]}-t{c[2]:g}-n{c[4]:g}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigmoid_float32_within_1e3_of_float64(backend, case, precision):
  _need(backend, "sigmoid")
  n, d, t, b, noise = case
  x, y = _trained(n, n, d, noise, seed_of("sigmoid", n, d, noise))
  assert_fidelity(_sigmoid_run(backend, x, y, t, b, precision),
                  sigmoid64(x, y, t, b), f"sigmoid {backend} {precision}")


def test_high_is_three_pass_tf32_in_xlas_own_dots_on_the_gpu():
  """XLA on the GPU reads ``Precision.HIGH`` as one TF32 pass, so "high"
  must reach XLA's dots (the xla backend's tiles, the kernels' backward
  GEMMs) as the 3-pass TF32 algorithm: lowered for CUDA here (one TF32
  pass put float32 gradients 1.5e-3 off at D = 16 on an H100). Off the GPU
  the precision is left as it is (exact float32 there)."""
  from infcl_jax.backends import xla  # pylint: disable=import-outside-toplevel
  high = jax.lax.Precision.HIGH
  assert (precision_lib.xla_dot_precision(high, "gpu")
          == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
  assert precision_lib.xla_dot_precision(high, "cpu") == high
  assert (precision_lib.xla_dot_precision(jax.lax.Precision.DEFAULT, "gpu")
          == jax.lax.Precision.DEFAULT)
  gpu = xla.BACKEND(platform="gpu")
  x = jnp.ones((64, 16), jnp.float32)
  y = jnp.ones((80, 16), jnp.float32)
  f = lambda x, y: gpu.lse_grad(
      x, y, 1.0, 0.0, jnp.zeros(64), jnp.zeros(80), 1.0, 1.0,
      block_sizes=BlockSizes(f32_precision="high"))
  text = jax.jit(f).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
  dots = [l for l in text.splitlines() if "dot_general" in l]
  assert dots
  assert all("lhs_precision_type = tf32" in l
             and "num_primitive_operations = 3" in l for l in dots), dots
