"""Every kernel of the ``triton`` backend compiled for the GPUs it targets,
on a machine without one.

Triton compiles for a CUDA target from the host (``kernels.triton.aot``,
bundled ptxas), so this leg catches what a first GPU run would: a kernel
that does not compile for an architecture, shared memory past the GPU's
limit, registers spilled to local memory. The launches compiled are the
ones the losses make (``launch.record`` while tracing them with each GPU's
default tiles, ``triton_tiles.CONFIGS``), the same ``launch.Launch`` that
``jax_triton.triton_call`` is given on the GPU (checked below with a
stand-in for jax-triton).

Runs in the triton leg (``scripts/triton_interpret.sh``) with
``TRITON_INTERPRET`` unset: the interpreter's kernels cannot be compiled.
"""
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax import contrastive_loss, sigmoid_loss
from infcl_jax.backends import capability
from infcl_jax.backends import triton as triton_backend
from infcl_jax.backends import triton_tiles
from infcl_jax.backends import precision as precision_lib
from infcl_jax.backends import registry
from infcl_jax.kernels.triton import aot
from infcl_jax.kernels.triton import launch

# Compute capabilities Triton 3.6 compiles for, with the GPUs behind them
# (their per-block shared memory: capability.SMEM_PER_BLOCK).
TARGETS = {80: "A100", 86: "A10 / RTX 30xx", 89: "L4 / RTX 40xx",
           90: "H100 / H200", 100: "B200"}
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# ptxas gives a thread at most 255 registers; past them values go to local
# memory (spills). The kernels must need none.
MAX_REGISTERS = 255
MAX_LOCAL_BYTES = 0
NAME = "triton_aot_for_test"


class _OnGpu(triton_backend.TritonBackend):
  """The backend as it runs on a GPU (no interpreter), on any host."""

  def __init__(self, platform=None):
    del platform
    super().__init__(platform="gpu")


@pytest.fixture(autouse=True)
def _gpu_backend(monkeypatch):
  monkeypatch.setitem(registry._TABLE, NAME, _OnGpu)  # pylint: disable=protected-access


def test_kernels_are_compilable_here():
  # TRITON_INTERPRET=1 would make every kernel an interpreted function.
  assert not launch.interpreting(), "run with TRITON_INTERPRET unset"


def _losses(bs, dtype):
  """(loss(x, y, scale, bias), B_x, B_y, D): every kernel variant, aligned
  (no masks) and odd (masked) sizes, both directions and one-way ones;
  float32 also below ``TF32_MIN_DEPTH``, where its default is 3-pass TF32
  rather than TF32."""
  cases = []
  shapes = [(4096, 4096, 768), (3001, 2777, 1000)]
  if np.dtype(dtype) == np.float32:
    shapes.append((4096, 4096, precision_lib.TF32_MIN_DEPTH // 2))
  for n, m, d in shapes:
    for direction, bx, by in (("both", n, n), ("image_to_text", m, n),
                              ("text_to_image", n, m)):
      cases.append((lambda x, y, t, b, direction=direction: contrastive_loss(
          x, y, t, logit_bias=b, direction=direction, backend=NAME,
          block_sizes=bs), bx, by, d))
    cases.append((lambda x, y, t, b: sigmoid_loss(
        x, y, t, b, backend=NAME, block_sizes=bs), n, n, d))
  return cases


def _traced(loss, bx, by, d, dtype):
  x = jax.ShapeDtypeStruct((bx, d), dtype)
  y = jax.ShapeDtypeStruct((by, d), dtype)
  return jax.eval_shape(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), x, y,
                        1.0, 0.0)


def _add_distinct(distinct, launches):
  """Adds the launches to ``distinct``, one per kernel, signature,
  constants and launch options."""
  for spec in launches:
    key = (spec.name, tuple(spec.signature().items()),
           tuple(sorted(spec.constexprs.items())), spec.num_warps,
           spec.num_stages)
    distinct.setdefault(key, spec)


def assert_within_budget(launches, cc):
  """Every launch compiled for sm``cc`` fits its shared memory, 255
  registers and no spills; the failures listed by kernel."""
  smem = capability.SMEM_PER_BLOCK[(cc // 10, cc % 10)]
  over = []
  for spec in launches:
    c = aot.compile_launch(spec, cc)
    if (c.shared > smem or c.registers > MAX_REGISTERS
        or c.local > MAX_LOCAL_BYTES):
      over.append(f"{spec.name} {spec.constexprs}: shared {c.shared} B "
                  f"(limit {smem}), {c.registers} registers, {c.local} B "
                  f"local")
  assert not over, f"sm{cc} ({TARGETS[cc]}):\n" + "\n".join(over)


def recorded_launches(cc, dtype):
  """The distinct launches of both families' fwd + bwd on sm``cc``."""
  bs = triton_tiles.config((cc // 10, cc % 10), dtype)
  distinct = {}
  for loss, bx, by, d in _losses(bs, dtype):
    with launch.record() as launches:
      _traced(loss, bx, by, d, dtype)
    _add_distinct(distinct, launches)
  return list(distinct.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cc", sorted(TARGETS), ids=lambda c: f"sm{c}")
def test_every_kernel_compiles_within_budget(cc, dtype):
  launches = recorded_launches(cc, dtype)
  names = {s.name for s in launches}
  want = {"infcl_triton_lse_fwd", "infcl_triton_lse_bwd_panel",
          "infcl_triton_sigmoid_fwd", "infcl_triton_sigmoid_bwd_g"}
  if np.dtype(dtype) == np.float16:
    want.add("infcl_triton_sigmoid_bwd_max")
  assert names == want, names
  assert_within_budget(launches, cc)


def recorded_group_launches(cc, dtype):
  """The distinct launches of the tile ops with ``groups=`` (both softmax
  statistics, both sigmoid modes) on sm``cc``, at an odd size (the masks
  on: the most registers)."""
  bs = triton_tiles.config((cc // 10, cc % 10), dtype)
  be = _OnGpu()
  distinct = {}
  for n, d in ((3001, 1000),):
    x = jax.ShapeDtypeStruct((n, d), dtype)
    g = jax.ShapeDtypeStruct((n,), jnp.int32)

    def ops(x, y, gx, gy):
      groups = (gx, gy)
      r, c = be.lse(x, y, 1.0, 0.0, rows=True, cols=True, block_sizes=bs,
                    groups=groups)
      out = be.lse_grad(x, y, 1.0, 0.0, r, c, 0.5, 0.5, block_sizes=bs,
                        groups=groups)
      for mode in ("mask", "positives"):
        out += (be.sigmoid_sum(x, y, 1.0, 0.0, has_diagonal=True,
                               block_sizes=bs, groups=groups,
                               group_mode=mode),)
        out += be.sigmoid_grad(x, y, 1.0, 0.0, 1.0, has_diagonal=True,
                               block_sizes=bs, groups=groups,
                               group_mode=mode)
      return out

    with launch.record() as launches:
      jax.eval_shape(ops, x, x, g, g)
    _add_distinct(distinct, launches)
  return list(distinct.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cc", sorted(TARGETS), ids=lambda c: f"sm{c}")
def test_every_groups_kernel_compiles_within_budget(cc, dtype):
  """The kernels compiled with ``GROUPS`` (their group ids an extra compare
  and select per logit) within the same budgets."""
  launches = recorded_group_launches(cc, dtype)
  assert launches and all(s.constexprs["GROUPS"] for s in launches), [
      (s.name, s.constexprs.get("GROUPS")) for s in launches]
  assert_within_budget(launches, cc)


def test_every_config_entry_is_compiled():
  # Each tuned entry is chosen by one of the compiled targets.
  chosen = {triton_tiles.config_name((cc // 10, cc % 10))
            for cc in TARGETS}
  assert chosen == set(triton_tiles.CONFIGS), chosen


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_triton_call_gets_the_recorded_launches(monkeypatch, family):
  """The GPU path hands ``jax_triton.triton_call`` exactly the launches the
  compile test compiles: kernel, grid, options, constants, output types."""
  calls = []

  def triton_call(*arrays, kernel, out_shape, grid, num_warps, num_stages,
                  name, **constexprs):
    calls.append(launch.Launch(
        kernel=kernel,
        ins=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays),
        outs=tuple(out_shape), grid=tuple(grid), num_warps=num_warps,
        num_stages=num_stages, name=name, constexprs=constexprs))
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

  monkeypatch.setitem(sys.modules, "jax_triton",
                      types.SimpleNamespace(triton_call=triton_call))
  bs = triton_tiles.config((9, 0), jnp.float16)
  # text_to_image (B_x > B_y) and sigmoid, odd sizes.
  loss = _losses(bs, jnp.float16)[2 if family == "softmax" else 3][0]
  by = 277 if family == "softmax" else 300
  _traced(loss, 300, by, 200, jnp.float16)
  with launch.record() as launches:
    _traced(loss, 300, by, 200, jnp.float16)
  assert calls and calls == launches
