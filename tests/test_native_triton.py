"""The ``triton`` backend (Triton-language kernels through jax-triton).

Needs the triton extra, so it runs in its own CI leg
(``scripts/triton_interpret.sh``: a venv with triton, kernels in Triton's
interpreter, ``TRITON_INTERPRET=1``) and on the GPU (``-m gpu``, compiled);
the main legs leave this file out (``scripts/test.sh``). What needs no
triton (configs, the auto policy, the missing extra) is in
``test_triton_backend_host.py``.

The backend contract is the Pallas-Triton one: these classes subclass the
Pallas test classes with ``NAME = "triton"``, so every case they hold (odd
n, m, D with padding, both directions and one-way ones, both exponential
paths, +-100 logits, NaN, one panel and several, float16 rescaling, the
tile ops inside shard_map) runs here too.
"""
import os
import subprocess
import sys
import textwrap

import jax

ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:
  # Read when the kernel modules are imported (by the first registry.get).
  os.environ.setdefault("TRITON_INTERPRET", "1")

import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import pytest  # noqa: E402  pylint: disable=wrong-import-position
from jax.sharding import Mesh  # noqa: E402  pylint: disable=wrong-import-position
from jax.sharding import PartitionSpec as P  # noqa: E402  pylint: disable=wrong-import-position

from infcl_jax import BlockSizes, contrastive_loss, sigmoid_loss  # noqa: E402  pylint: disable=wrong-import-position
from infcl_jax.backends import capability  # noqa: E402  pylint: disable=wrong-import-position
from infcl_jax.backends import registry  # noqa: E402  pylint: disable=wrong-import-position
from tests import np_reference  # noqa: E402  pylint: disable=wrong-import-position
from tests import test_groups_kernels as tg  # noqa: E402  pylint: disable=wrong-import-position
from tests import test_pallas as tp  # noqa: E402  pylint: disable=wrong-import-position
from tests import test_pallas_sigmoid as tps  # noqa: E402  pylint: disable=wrong-import-position
from tests.helpers import as64, assert_rel_close, rand_emb  # noqa: E402  pylint: disable=wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_triton_is_importable_here():
  # This file's leg exists to run the kernels: a missing extra fails it.
  import triton  # pylint: disable=import-outside-toplevel
  if ON_GPU:
    import jax_triton  # pylint: disable=import-outside-toplevel,unused-import
  else:
    from infcl_jax.kernels.triton import launch  # pylint: disable=import-outside-toplevel
    assert launch.interpreting(), "TRITON_INTERPRET=1 did not take effect"
  assert triton.__version__


# --------------------------------------------------------------- softmax

@pytest.mark.skipif(ON_GPU, reason="the GPU compiles these: "
                    "TestTritonSoftmaxGpu")
class TestTritonSoftmaxInterpret(tp.TestPallasSoftmaxInterpret):
  NAME = "triton"


class TestTritonSoftmaxGpu(tp.TestPallasSoftmaxGpu):
  NAME = "triton"

  @pytest.mark.parametrize("direction", ["both", "image_to_text",
                                         "text_to_image"])
  def test_odd_3001_2777_1000(self, direction):
    """Odd B and D with the GPU's default tiles, all three directions
    (one-way: B_k > B_q rows on the other side)."""
    rng = np.random.default_rng(31)
    bx, by = (3001, 2777) if direction == "text_to_image" else (
        (2777, 3001) if direction == "image_to_text" else (3001, 3001))
    x = rand_emb(rng, bx, 1000, jnp.bfloat16)
    y = rand_emb(rng, by, 1000, jnp.bfloat16)
    tp.check_loss(x, y, 14.3, 0.4, direction, jnp.bfloat16, None,
                  backend=self.NAME)

  def test_logits_100_default_tiles(self):
    x, y = tp.extreme_logit_pair(jnp.float32)
    bs = BlockSizes(block_q=64, block_k=64, block_d=16, bwd_block_q=64,
                    bwd_block_k=64, panel_rows=64, f32_precision="highest")
    tp.check_loss(x, y, 100.0, -5.0, "both", jnp.float32, bs,
                  backend=self.NAME)


# --------------------------------------------------------------- sigmoid

@pytest.mark.skipif(ON_GPU, reason="the GPU compiles these: "
                    "TestTritonSigmoidGpu")
class TestTritonSigmoidInterpret(tps.TestPallasSigmoidInterpret):
  NAME = "triton"


class TestTritonSigmoidGpu(tps.TestPallasSigmoidGpu):
  NAME = "triton"

  def test_odd_3001_2777_1000(self):
    rng = np.random.default_rng(32)
    x = rand_emb(rng, 3001, 1000, jnp.bfloat16)
    y = rand_emb(rng, 2777, 1000, jnp.bfloat16)
    tps.check_tile_ops(self.backend(), x, y, 10.0, -10.0, 1.0 / 3001, False,
                       None, rtol=2e-2, loss_rtol=1e-4)


# ---------------------------------------------------------------- groups

@pytest.mark.skipif(ON_GPU, reason="the GPU compiles these: "
                    "TestTritonGroupsGpu")
class TestTritonGroupsInterpret(tg.TestPallasGroupsInterpret):
  NAME = "triton"


class TestTritonGroupsGpu(tg.TestPallasGroupsGpu):
  NAME = "triton"


# ------------------------------------------------ API, vmap, shard_map

SMALL = BlockSizes(block_q=16, block_k=16, block_d=16, num_programs=2,
                   bwd_block_q=16, bwd_block_k=16, panel_rows=16,
                   f32_precision="highest")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=lambda d: np.dtype(d).name)
def test_x64_gives_the_x64_off_values(dtype):
  """``jax_enable_x64=True`` (tests/test_x64.py has the other backends):
  every path's loss and four gradients equal those with x64 off, and every
  launch passes ``Launch.signature`` (no 64-bit array reaches a kernel)."""
  from tests import test_x64  # pylint: disable=import-outside-toplevel
  n, d = 37, 20
  rng = np.random.default_rng(7)
  x, y = rand_emb(rng, n, d, dtype), rand_emb(rng, n, d, dtype)
  for name, make in test_x64._cases(n, d).items():  # pylint: disable=protected-access
    fn = make("triton", SMALL)
    off = test_x64._value_and_grads(fn, x, y)  # pylint: disable=protected-access
    with test_x64.x64():
      on = test_x64._value_and_grads(fn, x, y)  # pylint: disable=protected-access
    test_x64._assert_same(on, off, name)  # pylint: disable=protected-access


@pytest.mark.parametrize("direction", ["image_to_text", "text_to_image"])
def test_labels_match_xla(direction):
  """labels= (one positive key per query, one-way, more keys than queries)
  against the xla backend in float32 "highest"."""
  rng = np.random.default_rng(21)
  nq, nk = 24, 37
  bx, by = (nq, nk) if direction == "image_to_text" else (nk, nq)
  x, y = rand_emb(rng, bx, 10, jnp.float32), rand_emb(rng, by, 10, jnp.float32)
  labels = jnp.asarray(rng.integers(0, nk, nq), jnp.int32)
  got = {}
  for backend in ("triton", "xla"):
    f = lambda x, y, backend=backend: contrastive_loss(
        x, y, 7.0, labels=labels, direction=direction, backend=backend,
        block_sizes=SMALL if backend == "triton" else None)
    got[backend] = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, y)
  (v, (dx, dy)), (vx, (dxx, dyx)) = got["triton"], got["xla"]
  tol = 1e-5 if not ON_GPU else 2e-3
  assert_rel_close(v, as64(vx), rtol=tol, what="labels loss")
  assert_rel_close(dx, as64(dxx), rtol=10 * tol, atol=1e-7, what="labels dx")
  assert_rel_close(dy, as64(dyx), rtol=10 * tol, atol=1e-7, what="labels dy")


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_vmap_over_problems(family):
  """vmap runs each problem through the unbatched kernels (triton_call has
  no batching rule): the problems must not mix."""
  rng = np.random.default_rng(22)
  xs = jnp.stack([rand_emb(rng, 21, 6, jnp.float32) for _ in range(2)])
  ys = jnp.stack([rand_emb(rng, 21, 6, jnp.float32) for _ in range(2)])
  ts = jnp.asarray([3.0, 12.0], jnp.float32)

  def f(x, y, t):
    if family == "softmax":
      return contrastive_loss(x, y, t, backend="triton", block_sizes=SMALL)
    return sigmoid_loss(x, y, t, -1.0, backend="triton", block_sizes=SMALL)

  vals, (dxs, dts) = jax.vmap(jax.value_and_grad(f, argnums=(0, 2)))(
      xs, ys, ts)
  for k in range(2):
    x64, y64, t = as64(xs[k]), as64(ys[k]), float(ts[k])
    if family == "softmax":
      ref = np_reference.clip_loss_and_grads(x64, y64, t, 0.0, "both")
      ref_v, ref_dx, ref_dt = ref[0], ref[1], ref[3]
    else:
      ref = tps.np_sigmoid(x64, y64, t, -1.0, True)
      ref_v, ref_dx, ref_dt = ref[0] / 21, ref[1] / 21, ref[3] / 21
    assert_rel_close(vals[k], ref_v, rtol=2e-5, what="vmap loss")
    assert_rel_close(dxs[k], ref_dx, rtol=5e-5, atol=1e-7, what="vmap dx")
    assert_rel_close(dts[k], ref_dt, rtol=1e-4, what="vmap dscale")


@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_ring_on_every_device(family):
  """The ring under shard_map (check_vma=True) over all devices here: 8
  virtual CPU devices in the interpreter leg, one GPU on the device."""
  devs = jax.devices()
  mesh = Mesh(np.array(devs), ("data",))
  n = len(devs)
  rng = np.random.default_rng(23)
  rows = 13 * n if not ON_GPU else 4096
  d = 12 if not ON_GPU else 768
  dtype = jnp.float32 if not ON_GPU else jnp.bfloat16
  x, y = rand_emb(rng, rows, d, dtype), rand_emb(rng, rows, d, dtype)
  t, b = jnp.float32(10.0), jnp.float32(-2.0 if family == "sigmoid" else 0.5)
  bs = SMALL if not ON_GPU else None

  def local(x, y, t, b):
    if family == "softmax":
      return contrastive_loss(x, y, t, logit_bias=b, axis_name="data",
                              strategy="ring", backend="triton",
                              block_sizes=bs)
    return sigmoid_loss(x, y, t, b, axis_name="data", backend="triton",
                        block_sizes=bs)

  step = jax.jit(jax.shard_map(
      jax.value_and_grad(local, argnums=(0, 1, 2, 3)), mesh=mesh,
      in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P(), (P("data"), P("data"), P(), P()))))
  val, grads = step(x, y, t, b)
  if family == "softmax":
    ref = np_reference.clip_loss_and_grads(as64(x), as64(y), float(t),
                                           float(b), "both")
  else:
    r = tps.np_sigmoid(as64(x), as64(y), float(t), float(b), True)
    ref = [v / rows for v in r]
  rtol = 2e-5 if dtype == jnp.float32 else 2e-2
  assert_rel_close(val, ref[0], rtol=min(rtol, 1e-4), what="ring loss")
  scale = np.abs(ref[1]).max()
  for g, e, what in zip(grads[:3], ref[1:4], ("dx", "dy", "dscale")):
    assert_rel_close(g, e, rtol=rtol, atol=1e-3 * scale if dtype != jnp.float32
                     else 1e-7, what=f"ring {what}")


@pytest.mark.skipif(ON_GPU, reason="8 virtual devices: the interpreter leg")
@pytest.mark.parametrize("mode", ["mask", "positives"])
def test_ring_groups_sigmoid(mode):
  """The grouped sigmoid over the ring (groups split across devices, the
  "mask" panels with their diagonal written outside the kernel) equals the
  xla backend's, loss and every gradient."""
  devs = jax.devices()
  mesh = Mesh(np.array(devs), ("data",))
  rng = np.random.default_rng(29)
  rows, d = 13 * len(devs), 12
  x, y = (rand_emb(rng, rows, d, jnp.float32),
          rand_emb(rng, rows, d, jnp.float32))
  g = jnp.asarray(rng.permutation(rows) // 2, jnp.int32)
  t, b = jnp.float32(10.0), jnp.float32(-2.0)

  def step(backend):
    def local(x, y, t, b, g):
      return sigmoid_loss(x, y, t, b, axis_name="data", backend=backend,
                          block_sizes=SMALL if backend == "triton" else None,
                          groups=g, group_mode=mode)
    return jax.jit(jax.shard_map(
        jax.value_and_grad(local, argnums=(0, 1, 2, 3)), mesh=mesh,
        in_specs=(P("data"), P("data"), P(), P(), P("data")),
        out_specs=(P(), (P("data"), P("data"), P(), P()))))(x, y, t, b, g)

  (val, grads), (ref, ref_grads) = step("triton"), step("xla")
  assert_rel_close(val, ref, rtol=1e-5, what="ring loss")
  for a, e, what in zip(grads, ref_grads, ("dx", "dy", "dscale", "dbias")):
    assert_rel_close(a, e, rtol=2e-5, atol=1e-7, what=f"ring {what}")


# -------------------------------------------- the auto policy, for real

@pytest.mark.parametrize("kind,cc,want", [
    ("NVIDIA A100-SXM4-80GB", (8, 0), "triton"),
    ("NVIDIA L4", (8, 9), "triton"),
    ("NVIDIA GeForce RTX 4090", (8, 9), "triton"),
    ("NVIDIA B200", (10, 0), "triton"),
    ("NVIDIA H200", (9, 0), "mosaic"),
])
def test_auto_choice_with_the_extra(monkeypatch, kind, cc, want):
  """With the extra installed, auto takes ``triton`` on the non-Hopper GPUs
  even where Pallas' Triton lowering is present (expected values written
  down; without the lowering too: test_works_without_pallas_triton)."""
  info = capability.DeviceInfo("gpu", kind, cc)
  monkeypatch.setattr(capability, "device_info", lambda platform=None: info)
  monkeypatch.delenv(registry.ENV_VAR, raising=False)
  assert registry.auto_backend("softmax", platform="gpu") == want
  assert registry.auto_backend("sigmoid", platform="gpu") == want
  assert registry.available("triton", "softmax", platform="gpu")


_HIDE_PALLAS_TRITON = textwrap.dedent("""
    import importlib.abc, os, sys
    class Hide(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path, target=None):
        if name == "jax.experimental.pallas.triton" or name.startswith(
            "jax._src.pallas.triton"):
          raise ImportError(f"{name} is hidden (removed from JAX)")
        return None
    sys.meta_path.insert(0, Hide())
    import jax, jax.numpy as jnp, numpy as np
    import infcl_jax
    from infcl_jax.backends import capability, registry
    on_gpu = jax.default_backend() == "gpu"
    info = capability.DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", (8, 0))
    capability.device_info = lambda platform=None: info
    for family in ("softmax", "sigmoid"):
      choice = registry.auto_backend(family, platform="gpu")
      assert choice == "triton", (family, choice)
    # The loss itself: compiled on a GPU through auto (which now reads the
    # pretended A100), in Triton's interpreter elsewhere.
    backend = "auto" if on_gpu else "triton"
    bs = None if on_gpu else infcl_jax.BlockSizes(
        block_q=16, block_k=16, block_d=16, num_programs=2, bwd_block_q=16,
        bwd_block_k=16, panel_rows=16)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((40, 12)), jnp.float32) / 4
    y = jnp.asarray(rng.standard_normal((40, 12)), jnp.float32) / 4
    for loss, ref_loss in (
        (lambda x, y, be: infcl_jax.contrastive_loss(x, y, 5.0, backend=be,
                                                     block_sizes=bs),
         lambda x, y: infcl_jax.contrastive_loss(x, y, 5.0, backend="xla")),
        (lambda x, y, be: infcl_jax.sigmoid_loss(x, y, 5.0, -1.0, backend=be,
                                                 block_sizes=bs),
         lambda x, y: infcl_jax.sigmoid_loss(x, y, 5.0, -1.0, backend="xla"))):
      v, g = jax.value_and_grad(lambda x: loss(x, y, backend))(x)
      vr, gr = jax.value_and_grad(lambda x: ref_loss(x, y))(x)
      tol = 2e-3 if on_gpu else 1e-5  # TF32 on the GPU.
      assert abs(float(v) - float(vr)) <= tol * abs(float(vr)), (v, vr)
      assert float(jnp.max(jnp.abs(g - gr))) <= tol * float(jnp.max(jnp.abs(gr)))
    hidden = [m for m in sys.modules if m.startswith(
        ("jax.experimental.pallas.triton", "jax._src.pallas.triton"))]
    assert not hidden, hidden
    assert "infcl_jax.backends.triton" in sys.modules
    print("OK without pallas.triton")
""")


def test_works_without_pallas_triton():
  """With ``jax.experimental.pallas.triton`` removed (an import hook), a
  non-Hopper GPU's auto choice is ``triton``, both losses run and agree
  with xla, and nothing imported the Pallas Triton lowering."""
  # This repo first, and whatever else the caller's path holds (on the
  # device the extra's wheels sit on PYTHONPATH).
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p]))
  env.pop(registry.ENV_VAR, None)
  out = subprocess.run([sys.executable, "-c", _HIDE_PALLAS_TRITON],
                       capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=600, check=False)
  assert out.returncode == 0 and "OK without pallas.triton" in out.stdout, (
      out.stdout[-2000:] + out.stderr[-4000:])


# ------------------------- the GPU launch path, traced on any platform

def _fake_jax_triton():
  """A stand-in for ``jax_triton`` whose ``triton_call`` binds a primitive
  typed as jax-triton 0.3.1 types its own: outputs without varying mesh
  axes, and no batching rule. Tracing only (it cannot run)."""
  import types  # pylint: disable=import-outside-toplevel
  from jax.extend import core as jex_core  # pylint: disable=import-outside-toplevel
  from jax.interpreters import batching  # pylint: disable=import-outside-toplevel
  prim = jex_core.Primitive("fake_triton_kernel_call")
  prim.multiple_results = True
  prim.def_abstract_eval(lambda *_, out_shapes, **__: [
      jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes])

  def no_vmap(*a, **k):
    raise NotImplementedError("triton_call does not support batching")
  batching.primitive_batchers[prim] = no_vmap
  calls = []

  def triton_call(*args, kernel, out_shape, grid, name="", **kw):
    calls.append(name)
    return prim.bind(*args, out_shapes=tuple(out_shape), name=name)
  return types.SimpleNamespace(triton_call=triton_call, calls=calls)


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the real triton_call")
@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_gpu_launch_traces_under_vmap_and_shard_map(monkeypatch, family):
  """The compiled path (jax_triton.triton_call) under jax.grad inside
  shard_map with check_vma=True, and under vmap: the launch gives the
  outputs their inputs' varying axes and batches problem by problem."""
  from infcl_jax.backends import triton as triton_backend  # pylint: disable=import-outside-toplevel
  from infcl_jax.kernels.triton import launch  # pylint: disable=import-outside-toplevel
  fake = _fake_jax_triton()
  monkeypatch.setitem(sys.modules, "jax_triton", fake)
  monkeypatch.setattr(launch, "interpreting", lambda: False)

  class Compiled(triton_backend.TritonBackend):
    def __init__(self, platform=None):
      del platform
      super().__init__(platform="gpu")

  name = "triton_compiled_for_test"
  monkeypatch.setitem(registry._TABLE, name, Compiled)  # pylint: disable=protected-access
  # Every kernel output inside shard_map must vary over the mesh axis, like
  # the shards it is computed from (the fake primitive types it replicated).
  from infcl_jax import _axes  # pylint: disable=import-outside-toplevel
  typed, real_call = [], launch.call

  def recording_call(*args, **kwargs):
    outs = real_call(*args, **kwargs)
    typed.extend(_axes.varying_axes(o) for o in outs)
    return outs
  monkeypatch.setattr(launch, "call", recording_call)
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

  def local(x, y, t, b):
    if family == "softmax":
      return contrastive_loss(x, y, t, logit_bias=b, axis_name="data",
                              backend=name)
    return sigmoid_loss(x, y, t, b, axis_name="data", backend=name)

  x = jax.ShapeDtypeStruct((2 * 24, 40), jnp.bfloat16)
  t = jax.ShapeDtypeStruct((), jnp.float32)
  step = jax.shard_map(
      jax.grad(local, argnums=(0, 1, 2, 3)), mesh=mesh,
      in_specs=(P("data"), P("data"), P(), P()),
      out_specs=(P("data"), P("data"), P(), P()), check_vma=True)
  jax.make_jaxpr(step)(x, x, t, t)
  fwd, bwd = (("infcl_triton_lse_fwd", "infcl_triton_lse_bwd_panel")
              if family == "softmax" else
              ("infcl_triton_sigmoid_fwd", "infcl_triton_sigmoid_bwd_g"))
  assert fwd in fake.calls and bwd in fake.calls, fake.calls
  assert typed and all(v == {"data"} for v in typed), typed
  # vmap over problems: the primitive refuses batching, the launch maps.
  fake.calls.clear()
  xs = jax.ShapeDtypeStruct((3, 24, 40), jnp.bfloat16)
  ts = jax.ShapeDtypeStruct((3,), jnp.float32)
  single = (lambda x, y, t: contrastive_loss(x, y, t, backend=name)) if (
      family == "softmax") else (
          lambda x, y, t: sigmoid_loss(x, y, t, -1.0, backend=name))
  jax.make_jaxpr(jax.vmap(jax.grad(single, argnums=(0, 2))))(xs, xs, ts)
  assert fwd in fake.calls and bwd in fake.calls, fake.calls


# ------------------------------------------------------- a confident model

from tests import test_confident as tc  # noqa: E402  pylint: disable=wrong-import-position


class TestTritonConfident(tc.TestConfidentKernels):
  """The positive outside the log-sum-exp on the triton backend."""
  NAME = "triton"


# ------------------------------------------- the GPU's tiles, under a watchdog

@pytest.mark.skipif(ON_GPU, reason="the interpreter's case; the GPU runs "
                    "the compiled kernels above")
@pytest.mark.parametrize("loss,dtype", [("softmax", "bfloat16"),
                                        ("sigmoid", "float32")])
def test_interpreter_at_gpu_tiles(loss, dtype):
  """The Triton family's case of ``tests/test_interpreter_watchdog.py``:
  one forward + backward under jit at its Hopper tiles, in a child process
  under the watchdog (TRITON_INTERPRET=1 reaches it), against float64."""
  from tests import test_interpreter_watchdog as tw  # pylint: disable=import-outside-toplevel
  from tests import watchdog  # pylint: disable=import-outside-toplevel
  result = watchdog.run_case("triton", loss, dtype)
  assert max(result["errors"].values()) <= tw.BOUND[dtype], result


# ---------------------------------- labels x groups, the positive outside

from tests import test_exact_groups as teg  # noqa: E402  pylint: disable=wrong-import-position


class TestTritonExactGroups(teg.TestKernels):
  """``test_exact_groups``' kernel cases on the triton backend: the
  "positives" split on its kernels, positives outside their groups on the
  xla tiles."""
  NAME = "triton"
