"""backend="auto" per GPU, its environment override, the one-time warnings,
and the per-capability Pallas-Triton configs.

The device is mocked (``jax.devices`` returns a fake device), so every rule
runs on a CPU. Each non-Hopper config is checked for exactness in interpret
mode against float64 here, and compiled through Triton at B = 4096 on a GPU
by ``TestConfigsOnGpu`` (``-m gpu``; skipped without a GPU). A config that
fits a smaller GPU's shared memory runs on a larger one too.
"""
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infcl_jax.backends import triton_tiles as tc
from infcl_jax import contrastive_loss
from infcl_jax.backends import capability
from infcl_jax.backends import registry
from infcl_jax.block_sizes import BlockSizes
from tests import test_pallas as softmax_checks
from tests import test_pallas_sigmoid as sigmoid_checks
from tests.helpers import rand_emb, tol

ON_GPU = jax.default_backend() == "gpu"
ENV = registry.ENV_VAR
Warn = capability.InfclPerformanceWarning


class FakeDevice:
  """What ``capability.device_info`` reads of a jax Device."""

  def __init__(self, kind, cc=None, platform="gpu"):
    self.device_kind = kind
    self.platform = platform
    if cc is not None:
      self.compute_capability = cc


class FakeMosaic:
  """A registered "mosaic" with softmax tiles only."""
  name = "mosaic"
  families = ("softmax",)
  RUNS_ON = capability.RunsOn(tuned=((9, 0),), needs="sm90")

  def __init__(self, platform=None):
    self.platform = platform

  def lse(self, *a, **k):
    raise NotImplementedError

  def lse_grad(self, *a, **k):
    raise NotImplementedError


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
  """No override, the real backend table without the triton extra (so that
  the choices below do not depend on what this venv has installed; with
  the extra they are the same while Pallas' Triton lowering imports, and
  "triton" takes "pallas"'s place once it does not:
  test_triton_backend_host), fresh warnings."""
  monkeypatch.delenv(ENV, raising=False)
  monkeypatch.setitem(sys.modules, "triton", None)
  monkeypatch.setitem(sys.modules, "jax_triton", None)
  monkeypatch.delitem(sys.modules, "infcl_jax.backends.triton",
                      raising=False)
  capability.reset_warnings()
  yield
  capability.reset_warnings()


def fake_gpu(monkeypatch, kind, cc=None, platform="gpu"):
  dev = FakeDevice(kind, cc, platform)
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [dev])
  return dev


def resolve_recording(family="softmax", platform="gpu"):
  """resolve("auto") and the InfclPerformanceWarnings it raised."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = registry.resolve("auto", family, platform=platform)
  return name, [w for w in caught if issubclass(w.category, Warn)]


# ------------------------------------------------------------ reading the GPU

@pytest.mark.parametrize("value,want", [
    ("9.0", (9, 0)), ("8.6", (8, 6)), ("12.0", (12, 0)), ("90", (9, 0)),
    ("sm_90a", (9, 0)), ("100", (10, 0)), ((8, 9), (8, 9)), (None, None),
    ("gfx942", None), ("", None)])
def test_parse_capability(value, want):
  assert capability.parse_capability(value) == want


@pytest.mark.parametrize("kind,want", [
    ("NVIDIA H200", (9, 0)), ("NVIDIA H100 80GB HBM3", (9, 0)),
    ("NVIDIA GH200 480GB", (9, 0)), ("NVIDIA H20", (9, 0)),
    ("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA A10", (8, 6)),
    ("NVIDIA A10G", (8, 6)), ("NVIDIA RTX A6000", (8, 6)),
    ("NVIDIA GeForce RTX 3090", (8, 6)), ("NVIDIA L4", (8, 9)),
    ("NVIDIA L40S", (8, 9)), ("NVIDIA GeForce RTX 4090", (8, 9)),
    ("NVIDIA RTX 6000 Ada Generation", (8, 9)), ("Tesla T4", (7, 5)),
    ("Tesla V100-SXM2-16GB", (7, 0)), ("NVIDIA B200", (10, 0)),
    ("NVIDIA GeForce RTX 5090", (12, 0)), ("AMD Instinct MI300X", None),
    ("cpu", None), ("", None)])
def test_capability_from_device_kind(kind, want):
  assert capability.capability_from_kind(kind) == want


def test_device_info_prefers_compute_capability(monkeypatch):
  fake_gpu(monkeypatch, "NVIDIA H200", "8.6")  # The attribute wins.
  assert capability.device_info().capability == (8, 6)
  fake_gpu(monkeypatch, "NVIDIA L4")  # No attribute: from the name.
  assert capability.device_info().capability == (8, 9)
  fake_gpu(monkeypatch, "NVIDIA L4", "garbage")
  assert capability.device_info().capability == (8, 9)
  fake_gpu(monkeypatch, "TPU v5 lite", platform="tpu")
  info = capability.device_info()
  assert info.platform == "tpu" and info.capability is None
  assert capability.device_capability() is None

  def no_gpu(*a, **k):
    raise RuntimeError("Unknown backend gpu")
  monkeypatch.setattr(jax, "devices", no_gpu)
  assert capability.device_info("gpu") is None
  assert capability.device_capability() is None


# ------------------------------------------------------------ the one rule

N, U, T, I = (capability.NATIVE, capability.UNSUPPORTED, capability.UNTESTED,
              capability.INTERPRET)

# Written down, not recomputed: kind, compute_capability attribute (None: not
# exposed), auto's choice (both families), the verdicts of (xla, pallas,
# mosaic) and the Pallas config the GPU gets.
RULES = [
    ("NVIDIA H200", "9.0", "mosaic", (N, N, N), "smem227k"),
    ("NVIDIA H100 80GB HBM3", None, "mosaic", (N, N, N), "smem227k"),
    ("NVIDIA GH200 480GB", "9.0", "mosaic", (N, N, N), "smem227k"),
    ("NVIDIA B200", "10.0", "pallas", (N, N, U), "smem227k"),
    ("NVIDIA B200", None, "pallas", (N, N, U), "smem227k"),
    ("NVIDIA A100-SXM4-80GB", "8.0", "pallas", (N, N, U), "smem163k"),
    ("Jetson AGX Orin", "8.7", "pallas", (N, N, U), "smem163k"),
    ("NVIDIA A10", "8.6", "pallas", (N, N, U), "smem99k"),
    ("NVIDIA GeForce RTX 3090", None, "pallas", (N, N, U), "smem99k"),
    ("NVIDIA L4", "8.9", "pallas", (N, N, U), "smem99k"),
    ("NVIDIA L4", None, "pallas", (N, N, U), "smem99k"),
    ("NVIDIA GeForce RTX 4090", None, "pallas", (N, N, U), "smem99k"),
    ("NVIDIA GeForce RTX 5090", "12.0", "pallas", (N, N, U), "smem99k"),
    ("Tesla T4", "7.5", "xla", (N, U, U), None),
    ("Tesla T4", None, "xla", (N, U, U), None),
    ("Tesla V100-SXM2-16GB", "7.0", "xla", (N, U, U), None),
    ("Some Future GPU", None, "xla", (N, T, U), None),
    ("Some Future GPU", "13.7", "xla", (N, T, U), None),
]
TILED = ("xla", "pallas", "mosaic")


@pytest.mark.parametrize("kind,cc,want,verdicts,config", RULES)
@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_auto_rule_per_gpu(monkeypatch, kind, cc, want, verdicts, config,
                           family):
  fake_gpu(monkeypatch, kind, cc)
  assert tuple(registry.support(n, "gpu") for n in TILED) == verdicts
  name, warned = resolve_recording(family)
  assert name == want
  # Exactly the fallback to xla on a GPU warns, in one line.
  assert len(warned) == (want == "xla"), [str(w.message) for w in warned]
  if want == "xla":
    msg = str(warned[0].message)
    assert kind in msg and "\n" not in msg
    # Pallas is offered only where it may run (untested, not unsupported).
    assert ("INFCL_JAX_BACKEND=pallas" in msg) == (verdicts[1] == T), msg
  # available() and an explicit name read the same verdicts.
  for backend, verdict in zip(TILED, verdicts):
    assert registry.available(backend, family, "gpu") == (verdict != U)
    if verdict == U:
      with pytest.raises(ValueError) as e:
        registry.resolve(backend, family, platform="gpu")
      msg = str(e.value)
      assert "\n" not in msg and kind in msg, msg
      assert msg.startswith(f"backend={backend!r} cannot run on "), msg
      assert f"use backend={want!r}" in msg, msg
    else:
      assert registry.resolve(backend, family, platform="gpu") == backend
  if config is not None:
    # The Triton defaults on this GPU are that capability's config.
    be = registry.get("pallas", family, platform="gpu")
    for dtype, idx in ((jnp.bfloat16, 1), (jnp.float16, 1), (jnp.float32, 2)):
      assert be.default_block_sizes("gpu", dtype) == tc.CONFIGS[
          config][idx]


def test_explicit_mosaic_on_b200_names_the_gpu_and_pallas(monkeypatch):
  fake_gpu(monkeypatch, "NVIDIA B200", "10.0")
  x = jnp.ones((8, 4), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"^backend='mosaic' cannot run on "
                     r"NVIDIA B200 \(compute capability 10\.0\): it needs "
                     r"an sm90 GPU .*; use backend='pallas'"):
    registry.resolve("mosaic", "sigmoid", platform="gpu")
  # The public API says the same, before any kernel is traced.
  monkeypatch.setattr(registry, "default_platform", lambda: "gpu")
  with pytest.raises(ValueError, match=r"backend='mosaic' cannot run on "
                     r"NVIDIA B200"):
    contrastive_loss(x, x, 2.0, backend="mosaic")


@pytest.mark.parametrize("platform,kind", [("cpu", "cpu"),
                                           ("tpu", "TPU v5 lite")])
def test_no_gpu_auto_is_xla_silently_and_kernels_interpret(monkeypatch,
                                                           platform, kind):
  fake_gpu(monkeypatch, kind, platform=platform)
  for family in ("softmax", "sigmoid"):
    assert resolve_recording(family, platform=platform) == ("xla", [])
    assert tuple(registry.support(n, platform) for n in TILED) == (N, I, I)
    for backend in TILED:  # Interpreted kernels are allowed by name.
      assert registry.available(backend, family, platform)
      assert registry.resolve(backend, family, platform=platform) == backend


def test_gpu_platform_without_a_readable_gpu_is_an_unknown_gpu(monkeypatch):
  def no_gpu(*a, **k):
    raise RuntimeError("Unknown backend gpu")
  monkeypatch.setattr(jax, "devices", no_gpu)
  assert tuple(registry.support(n, "gpu") for n in TILED) == (N, T, U)
  assert resolve_recording("softmax")[0] == "xla"
  with pytest.raises(ValueError, match=r"backend='mosaic' cannot run on this "
                     r"GPU \(compute capability unknown\)"):
    registry.resolve("mosaic", "softmax", platform="gpu")


def test_mosaic_with_one_family_gives_the_other_to_pallas(monkeypatch):
  monkeypatch.setitem(registry._TABLE, "mosaic", FakeMosaic)  # pylint: disable=protected-access
  fake_gpu(monkeypatch, "NVIDIA H200", "9.0")
  assert resolve_recording("softmax") == ("mosaic", [])
  assert resolve_recording("sigmoid") == ("pallas", [])  # No sigmoid tiles.
  with pytest.raises(ValueError, match="backend 'mosaic' has no sigmoid"):
    registry.resolve("mosaic", "sigmoid", platform="gpu")


def test_auto_off_the_gpu_imports_no_kernel_backend(monkeypatch):
  """auto on a CPU is "xla" by the rule (kernel backends only interpret
  there) without importing them: a broken kernel module cannot matter."""
  monkeypatch.setitem(registry._TABLE, "mosaic", "no.such.module")  # pylint: disable=protected-access
  monkeypatch.setitem(registry._TABLE, "pallas", "no.such.module")  # pylint: disable=protected-access
  assert registry.resolve("auto", "softmax", platform="cpu") == "xla"


def test_fallback_warns_once_per_process(monkeypatch):
  fake_gpu(monkeypatch, "Tesla T4", "7.5")
  first = resolve_recording()
  second = resolve_recording("sigmoid")
  fake_gpu(monkeypatch, "Some Future GPU")
  third = resolve_recording()
  assert [len(r[1]) for r in (first, second, third)] == [1, 0, 0]
  assert all(r[0] == "xla" for r in (first, second, third))


def test_a_backend_without_runs_on_is_refused(monkeypatch):
  class NoRule:
    name = "norule"
    families = ("softmax",)
    lse = lse_grad = None

    def __init__(self, platform=None):
      del platform

  monkeypatch.setitem(registry._TABLE, "norule", NoRule)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="NoRule declares no RUNS_ON"):
    registry.resolve("norule", "softmax", platform="cpu")


# ------------------------------------------------------------ INFCL_JAX_BACKEND

def test_env_overrides_auto(monkeypatch):
  fake_gpu(monkeypatch, "NVIDIA H200", "9.0")
  monkeypatch.setenv(ENV, "xla")
  assert resolve_recording() == ("xla", [])
  fake_gpu(monkeypatch, "Some Future GPU")
  monkeypatch.setenv(ENV, "pallas")
  assert resolve_recording("sigmoid") == ("pallas", [])  # No fallback warning.
  # The variable obeys the capability rule like an explicit name.
  fake_gpu(monkeypatch, "Tesla T4", "7.5")
  with pytest.raises(ValueError, match=r"^INFCL_JAX_BACKEND='pallas': backend="
                     r"'pallas' cannot run on Tesla T4 .*use backend='xla'"):
    registry.resolve("auto", "softmax", platform="gpu")
  monkeypatch.setenv(ENV, " pallas ")
  assert registry.resolve("auto", "softmax", platform="cpu") == "pallas"
  for value in ("", "auto"):  # The rule itself.
    monkeypatch.setenv(ENV, value)
    assert resolve_recording()[0] == "xla"


@pytest.mark.parametrize("value", ["bogus", "reference", "Pallas"])
def test_env_unknown_value_is_a_one_line_error(monkeypatch, value):
  monkeypatch.setenv(ENV, value)
  with pytest.raises(ValueError) as e:
    registry.resolve("auto", "softmax", platform="cpu")
  msg = str(e.value)
  assert msg.startswith(f"INFCL_JAX_BACKEND={value!r} is not a registered "
                        f"backend") and "\n" not in msg
  assert "'pallas'" in msg and "'xla'" in msg


def test_env_backend_without_the_family_is_an_error(monkeypatch):
  monkeypatch.setitem(registry._TABLE, "mosaic", FakeMosaic)  # pylint: disable=protected-access
  fake_gpu(monkeypatch, "NVIDIA H200", "9.0")
  monkeypatch.setenv(ENV, "mosaic")
  assert registry.resolve("auto", "softmax", platform="gpu") == "mosaic"
  with pytest.raises(ValueError, match=r"INFCL_JAX_BACKEND='mosaic': backend "
                     r"'mosaic' has no sigmoid tiles"):
    registry.resolve("auto", "sigmoid", platform="gpu")


def test_env_reaches_the_public_api(monkeypatch):
  """Read when the loss is traced (shapes used nowhere else, so that jit's
  cache holds no earlier trace)."""
  rng = np.random.default_rng(0)
  x, y = rand_emb(rng, 13, 7, jnp.float32), rand_emb(rng, 13, 7, jnp.float32)
  monkeypatch.setenv(ENV, "nonsense")
  with pytest.raises(ValueError, match="INFCL_JAX_BACKEND='nonsense'"):
    contrastive_loss(x, y, 5.0)
  monkeypatch.setenv(ENV, "pallas")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    val = contrastive_loss(x, y, 5.0)
  # It ran the Pallas kernels (interpreted on this CPU: the warning says so).
  assert any(issubclass(w.category, Warn) and "interpret mode" in
             str(w.message) for w in caught)
  ref = contrastive_loss(x, y, 5.0, backend="xla")
  np.testing.assert_allclose(float(val), float(ref), rtol=1e-5)


# ------------------------------------------------------------ interpret warning

def test_interpret_mode_warns_once_on_use_not_on_probe():
  x = jnp.ones((5, 3), jnp.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert registry.available("pallas", "softmax")
    be = registry.get("pallas", "sigmoid", platform="cpu")
    assert be.interpret
    assert not [w for w in caught if issubclass(w.category, Warn)]
    be.sigmoid_sum(x, x, 1.0, 0.0, has_diagonal=True)
    be2 = registry.get("pallas", "softmax", platform="cpu")
    be2.lse(x, x, 1.0, 0.0, rows=True, cols=True)
    be.sigmoid_sum(x, x, 1.0, 0.0, has_diagonal=True)
  mine = [w for w in caught if issubclass(w.category, Warn)]
  assert len(mine) == 1
  msg = str(mine[0].message)
  assert "backend='pallas'" in msg and "interpret mode" in msg
  assert "platform 'cpu'" in msg and "\n" not in msg


def test_compiled_kernel_backend_does_not_warn():
  be = registry.get("pallas", "softmax", platform="gpu")
  assert not be.interpret
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    be.block_sizes(BlockSizes(16, 32), jnp.float32)
  assert not caught


# ------------------------------------------------------------ shared memory

def test_smem_formula_by_hand():
  h200 = tc.CONFIGS["smem227k"][1]
  fwd = tc.smem(h200, jnp.bfloat16, "fwd")
  # 3 stages x (128 + 256) rows x 64 x 2 bytes: the "~147 KB" of the H200.
  assert fwd.pipeline == 3 * 384 * 64 * 2 == 147456
  assert fwd.epilogue == 8 * 256 * 4
  bwd = tc.smem(h200, jnp.bfloat16, "bwd")
  assert bwd.epilogue == 128 * 256 * 2 + 8 * 256 * 4
  assert (bwd.peak, bwd.total) == (147456, 147456 + 73728)
  f32 = tc.smem(tc.CONFIGS["smem227k"][2], jnp.float32, "fwd")
  assert f32.pipeline == 3 * 384 * 32 * 4
  with pytest.raises(ValueError, match="kernel"):
    tc.smem(h200, jnp.bfloat16, "both")


@pytest.mark.parametrize("cc", sorted(c for c in capability.SMEM_PER_BLOCK
                                      if c >= (8, 0)))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_every_capability_config_fits_its_shared_memory(cc, dtype):
  limit = capability.SMEM_PER_BLOCK[cc]
  name = tc.config_name(cc)
  bs = tc.default("gpu", cc, dtype)
  bs.check_pallas()
  assert tc.CONFIGS[name][0] <= limit
  for kernel in ("fwd", "bwd"):
    est = tc.smem(bs, dtype, kernel)
    assert est.peak <= limit, (cc, kernel, est)
    if name != "smem227k":
      # Untested GPUs: fits even if Triton reused no buffer.
      assert est.total <= limit, (cc, kernel, est)


def test_config_names_by_capability():
  assert tc.config_name(None) == "smem227k"  # Unknown: H200's.
  assert tc.config_name((9, 0)) == "smem227k"
  assert tc.config_name((8, 0)) == "smem163k"
  assert tc.config_name((8, 9)) == "smem99k"
  assert tc.config_name((7, 5)) == "smem99k"  # Smallest: best effort.
  assert tc.config_name((42, 0)) == "smem227k"
  # Without a capability, the H200 configs; off the GPU, the interpreter's.
  assert tc.default("gpu", None, jnp.bfloat16) == tc.CONFIGS[
      "smem227k"][1]
  assert tc.default("gpu", None, jnp.float32) == tc.CONFIGS[
      "smem227k"][2]
  assert tc.default("cpu", (9, 0), jnp.bfloat16) == tc.INTERPRET


# ------------------------------------------------------------ exactness

NON_HOPPER = [n for n in tc.CONFIGS if n != "smem227k"]


@pytest.mark.parametrize("name", NON_HOPPER)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_non_hopper_config_exact_in_interpret_mode_softmax(name, dtype):
  """The config's tiles in interpret mode: 300 rows are 3 row blocks and
  2 column blocks, D = 45 two K-steps, all with padding."""
  bs = tc.config(_cc_of(name), dtype)
  rng = np.random.default_rng(11)
  x, y = rand_emb(rng, 300, 45, dtype), rand_emb(rng, 300, 45, dtype)
  softmax_checks.check_loss(x, y, 14.3, -0.5, "both", dtype, bs,
                            backend="pallas")


@pytest.mark.parametrize("name", NON_HOPPER)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_non_hopper_config_exact_in_interpret_mode_sigmoid(name, dtype):
  bs = tc.config(_cc_of(name), dtype)
  rng = np.random.default_rng(12)
  x, y = rand_emb(rng, 300, 45, dtype), rand_emb(rng, 300, 45, dtype)
  sigmoid_checks.check_loss(x, y, 10.0, -10.0, bs, rtol=tol(dtype),
                            loss_rtol=1e-4 if dtype != jnp.float32 else 2e-5,
                            backend="pallas")


def _cc_of(name):
  return min(cc for cc in capability.SMEM_PER_BLOCK
             if cc >= (8, 0) and tc.config_name(cc) == name)


# ------------------------------------------------------------------- GPU

GPU_CHECKED = NON_HOPPER


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Triton lowering)")
class TestConfigsOnGpu:
  """Each non-Hopper config compiled through Triton on this GPU, against
  float64 at B = 4096, D = 768, bf16 (a config that fits a smaller GPU's
  shared memory runs on a larger one)."""

  def test_this_gpu_is_read(self):
    info = capability.device_info()
    dev = jax.devices()[0]
    print("device:", info, "compute_capability attr:",
          getattr(dev, "compute_capability", None))
    assert info.platform == "gpu" and info.capability is not None
    known = capability.capability_from_kind(info.kind)
    assert known in (None, info.capability)
    want = {(9, 0): "mosaic"}.get(info.capability, "pallas")
    assert registry.resolve("auto", "softmax") == want
    assert registry.resolve("auto", "sigmoid") == want
    be = registry.get("pallas", "softmax")
    assert be.default_block_sizes("gpu", jnp.bfloat16) == tc.config(
        info.capability, jnp.bfloat16)

  @pytest.mark.parametrize("name", GPU_CHECKED)
  def test_softmax_b4096_matches_float64(self, name):
    bs = tc.CONFIGS[name][1]
    rng = np.random.default_rng(5)
    x = rand_emb(rng, 4096, 768, jnp.bfloat16)
    y = rand_emb(rng, 4096, 768, jnp.bfloat16)
    softmax_checks.check_loss(x, y, 14.3, -2.0, "both", jnp.bfloat16, bs,
                              rtol=2e-2, backend="pallas")

  @pytest.mark.parametrize("name", GPU_CHECKED)
  def test_sigmoid_b4096_matches_float64(self, name):
    bs = tc.CONFIGS[name][1]
    rng = np.random.default_rng(41)
    x = rand_emb(rng, 4096, 768, jnp.bfloat16)
    y = rand_emb(rng, 4096, 768, jnp.bfloat16)
    sigmoid_checks.check_loss(x, y, 10.0, -10.0, bs, rtol=tol(jnp.bfloat16),
                              loss_rtol=1e-4, backend="pallas")


@pytest.mark.parametrize("kind,cc,want", [
    ("NVIDIA H200", "9.0", True), ("NVIDIA H100 PCIe", None, True),
    ("NVIDIA B200", "10.0", False), ("NVIDIA L4", "8.9", False),
    ("NVIDIA A100", None, False), ("Some Future GPU", None, False)])
def test_mosaic_kernels_only_on_sm90(monkeypatch, kind, cc, want):
  """The Mosaic backend's own choice of kernels reads the same rule: wgmma
  kernels on sm90 only (an instance built directly, bypassing resolve)."""
  from infcl_jax.backends import mosaic  # pylint: disable=import-outside-toplevel
  fake_gpu(monkeypatch, kind, cc)
  assert mosaic.MosaicBackend(platform="gpu").mosaic_ok is want
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [])
  assert mosaic.MosaicBackend(platform="gpu").mosaic_ok is False
