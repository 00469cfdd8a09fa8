"""Shared test utilities: random inputs and relative-norm comparisons."""
import jax.numpy as jnp
import numpy as np

# Relative-norm tolerances by input dtype (see device/METHOD.md): float32
# arithmetic lands far under 1e-4; bf16 / f16 operands near 1e-2.
TOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}


def tol(dtype):
  return TOL[jnp.dtype(dtype).type]


def rand_emb(rng, n, d, dtype, normalize=True):
  a = rng.standard_normal((n, d))
  if normalize:
    a /= np.linalg.norm(a, axis=1, keepdims=True)
  return jnp.asarray(a, dtype)


def as64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def assert_rel_close(actual, ref, rtol, atol=0.0, what=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  ref = np.asarray(ref, np.float64)
  assert actual.shape == ref.shape, (what, actual.shape, ref.shape)
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  err = np.linalg.norm((actual - ref).ravel())
  bound = rtol * np.linalg.norm(ref.ravel()) + atol
  assert err <= bound, f"{what}: |err|={err:.3e} > {bound:.3e} (|ref|={np.linalg.norm(ref):.3e})"
