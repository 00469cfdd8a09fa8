"""Shared test utilities: random inputs, relative-norm comparisons, and
launching several processes (jax.distributed tests)."""
import socket
import subprocess
import tempfile
import time
import zlib

import jax.numpy as jnp
import numpy as np

# Relative-norm tolerances by input dtype: float32
# arithmetic lands far under 1e-4; bf16 / f16 operands near 1e-2.
TOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-2, jnp.float16: 1e-2}


def tol(dtype):
  return TOL[jnp.dtype(dtype).type]


def seed_of(*parts):
  """A seed fixed by a test case's parameters. Python's hash() of a string is
  salted per process, so a case seeded with it draws other inputs on every
  run and its failure does not reproduce; crc32 of the parameters' repr is
  the same everywhere."""
  return zlib.crc32(repr(parts).encode())


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


def loss_floor(x, y, t, b=None):
  """Absolute tolerance of a float32 softmax loss against float64.

  Each term is LSE_i - s_ii in float32: where the loss is small the two
  cancel and leave rounding of the logits' size (up to ~2 eps32 max|s|
  over 3,000 random 2 x 2 cases at t = 14.3), so the floor scales with
  the largest logit; 1e-6 at the least."""
  s_max = np.abs(float(t) * as64(x) @ as64(y).T
                 + (0.0 if b is None else float(b))).max(initial=0.0)
  return max(1e-6, 4 * float(np.finfo(np.float32).eps) * s_max)


def free_port():
  """A TCP port on localhost that is free now (for jax.distributed)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(cmds, *, env, timeout_s, cwd=None):
  """Runs ``cmds`` at once; stops all as soon as one fails or at the deadline.

  A process that dies leaves its peers blocked in a collective, so waiting
  for each in turn could hang until the deadline (or forever). Output goes
  to temporary files, not pipes, so a chatty process never blocks on a full
  pipe while nobody reads it.

  Returns:
    (returncodes, outputs, timed_out): outputs are stdout+stderr as text;
    timed_out is True when no process had failed but some still ran at the
    deadline (killed, so their return codes are negative).
  """
  logs = [tempfile.TemporaryFile("w+") for _ in cmds]
  procs = [subprocess.Popen(c, env=env, cwd=cwd, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
           for c, log in zip(cmds, logs)]
  deadline = time.monotonic() + timeout_s
  timed_out = False
  try:
    while any(p.poll() is None for p in procs):
      if any(p.poll() not in (None, 0) for p in procs):
        break  # Its peers are killed below, not reported as hung.
      if time.monotonic() > deadline:
        timed_out = True
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    for p in procs:
      p.wait()
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
      log.close()
  return [p.returncode for p in procs], outputs, timed_out


def subjaxprs(v):
  """The jaxprs held by an equation's parameter ``v`` (a jaxpr, a closed
  jaxpr, or tuples and lists of them)."""
  if hasattr(v, "eqns"):
    yield v
  elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
    yield v.jaxpr
  elif isinstance(v, (tuple, list)):
    for u in v:
      yield from subjaxprs(u)


def kernel_calls(closed_jaxpr):
  """[(name, interpret)] of every kernel call in a jaxpr, nested ones too.

  Read from the equations' parameters rather than the printed jaxpr, whose
  format changes between JAX versions.
  """
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      # Pallas' kernels are pallas_calls; Mosaic GPU kernels (plgpu.kernel)
      # appear as mpmd_map; the Triton-language ones as jax-triton's
      # triton_kernel_call (compiled, on a GPU).
      if eqn.primitive.name in ("pallas_call", "mpmd_map",
                                "triton_kernel_call"):
        interp = eqn.params.get("interpret")
        found.append((str(eqn.params.get("name")),
                      interp is not None and interp is not False))
        continue
      for v in eqn.params.values():
        for sub in subjaxprs(v):
          walk(sub)

  walk(closed_jaxpr.jaxpr)
  return found


def default_tiles(backend, dtype, platform="gpu", family="softmax"):
  """The ``BlockSizes`` that ``backend`` runs by default on ``platform``."""
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  return registry.get(backend, family, platform=platform).default_block_sizes(
      platform, dtype)


def primitive_operands(closed_jaxpr, primitive):
  """[[(shape, dtype) of each operand]] of every ``primitive`` equation in a
  jaxpr, nested ones (scan bodies, custom_vjp rules) too."""
  found = []

  def subjaxprs(v):
    if hasattr(v, "eqns"):
      yield v
    elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
      yield v.jaxpr
    elif callable(v) and not isinstance(v, type):
      return
    elif isinstance(v, (tuple, list)):
      for u in v:
        yield from subjaxprs(u)

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == primitive:
        found.append([(tuple(a.aval.shape), str(a.aval.dtype))
                      for a in eqn.invars])
      for v in eqn.params.values():
        for sub in subjaxprs(v):
          walk(sub)

  walk(closed_jaxpr.jaxpr)
  return found


def compiled_pallas_class():
  """The Pallas-Triton backend as configured on a GPU, on any platform.

  Registered under a test-only name, it lets a CPU trace the compiled (not
  interpreted) kernels, e.g. under shard_map. Imported lazily, so that
  importing this module loads no kernel code.
  """
  from infcl_jax.backends import pallas  # pylint: disable=import-outside-toplevel

  class CompiledPallas(pallas.PallasBackend):

    def __init__(self, platform=None):
      del platform
      super().__init__(platform="gpu")

  return CompiledPallas


def compiled_kernels_in_shard_map(monkeypatch, mesh, loss_fn, dtype):
  """[(name, interpret)] of the pallas_calls that jax.grad of ``loss_fn``
  traces inside shard_map (check_vma=True) with the GPU-configured Pallas
  backend, on any platform.

  Tracing only (no lowering), so a CPU can check the compiled path for type
  errors of the varying mesh axes (e.g. a scan carry that does not vary like
  what the panels add to it), which the interpret-mode tests cannot see:
  interpret mode runs kernel bodies differently (kernels/pallas/interpret_vma.py).
  ``loss_fn(x, y, t, b, backend)`` is the local loss; the backend is
  registered under a test-only name (so no cached trace of "pallas" is
  reused), and monkeypatch removes it afterwards.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import registry  # pylint: disable=import-outside-toplevel
  name = "pallas_compiled_for_test"
  monkeypatch.setitem(registry._TABLE, name, compiled_pallas_class())
  n = mesh.shape["data"]
  x = jax.ShapeDtypeStruct((n * 24, 40), dtype)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  step = jax.shard_map(
      jax.grad(lambda x, y, t, b: loss_fn(x, y, t, b, name),
               argnums=(0, 1, 2, 3)),
      mesh=mesh, in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P("data"), P("data"), P(), P()))
  return kernel_calls(jax.make_jaxpr(step)(x, x, t, t))


def check_past_int32_against_xla(loss_fn, backend, seed):
  """``loss_fn(x, y, backend)`` on inputs of B * D = 65,536 * 32,832 > 2**31
  elements (bf16, 4.3 GB each) against ``backend="xla"``, whose tiling
  (2048 x 8192 blocks, cuBLAS) differs, so agreement is no coincidence of
  one tiling: the loss, and every row's gradient norm (compact, and they see
  every row, those past the 2**31-th element included). GPU only.
  """
  import jax  # pylint: disable=import-outside-toplevel
  b, d = 65536, 32832
  assert b * d > 2**31
  key_x, key_y = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(key_x, (b, d), jnp.bfloat16) / jnp.sqrt(d)
  y = x + jax.random.normal(key_y, (b, d), jnp.bfloat16) / jnp.sqrt(d)
  y = (y / jnp.sqrt(2.0)).astype(jnp.bfloat16)
  out = {}
  for name in (backend, "xla"):
    val, (dx, dy) = jax.jit(jax.value_and_grad(
        lambda x, y, name=name: loss_fn(x, y, name), argnums=(0, 1)))(x, y)
    row_norm = lambda g: np.asarray(jnp.linalg.norm(g.astype(jnp.float32),
                                                    axis=1))
    out[name] = (float(val), row_norm(dx), row_norm(dy))
    del dx, dy
  (vp, nxp, nyp), (vx, nxx, nyx) = out[backend], out["xla"]
  assert abs(vp - vx) <= 1e-4 * abs(vx), (vp, vx)
  assert_rel_close(nxp, nxx, rtol=2e-2, what="|d image| per row")
  assert_rel_close(nyp, nyx, rtol=2e-2, what="|d text| per row")
  tail = slice(2**31 // d, None)
  assert_rel_close(nxp[tail], nxx[tail], rtol=2e-2, what="rows past 2**31")


def set_overrides(config, overrides):
  """Sets ``{"a.b.c": value}`` entries on an ml_collections config, as
  ``--config.a.b.c=value`` would."""
  for k, v in overrides.items():
    node = config
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return config
