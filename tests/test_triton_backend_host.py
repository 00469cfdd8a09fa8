"""The ``triton`` backend on the host side, without the triton extra.

What needs no GPU and no triton: the per-GPU tile configs against their
shared-memory and register budgets, the ``auto`` policy with and without
the extra, and the one-line error of a missing extra. The kernels
themselves run in ``test_native_triton.py`` (Triton's interpreter, or the
GPU).
"""
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from infcl_jax.backends import base
from infcl_jax.backends import capability
from infcl_jax.backends import registry
from infcl_jax.backends import triton_tiles as tc


class FakeDevice:

  def __init__(self, kind, cc):
    self.device_kind, self.platform, self.compute_capability = kind, "gpu", cc


class StubTriton(base.KernelBackend):
  """A registered "triton" with the real backend's RUNS_ON (the Triton
  kernels'), standing in where the extra is not installed."""
  name = "triton"
  RUNS_ON = tc.RUNS_ON

  def default_block_sizes(self, platform, dtype):
    return tc.default_here(platform, dtype)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
  monkeypatch.delenv(registry.ENV_VAR, raising=False)
  capability.reset_warnings()
  yield
  capability.reset_warnings()


# Written down: device kind, compute capability, the config entry.
GPUS = [
    ("NVIDIA A100-SXM4-80GB", "8.0", "smem163k"),
    ("NVIDIA A30", "8.0", "smem163k"),
    ("Jetson AGX Orin", "8.7", "smem163k"),
    ("NVIDIA A10", "8.6", "smem99k"),
    ("NVIDIA GeForce RTX 3090", "8.6", "smem99k"),
    ("NVIDIA L4", "8.9", "smem99k"),
    ("NVIDIA GeForce RTX 4090", "8.9", "smem99k"),
    ("NVIDIA GeForce RTX 5090", "12.0", "smem99k"),
    ("NVIDIA H100 80GB HBM3", "9.0", "smem227k"),
    ("NVIDIA H200", "9.0", "smem227k"),
    ("NVIDIA B200", "10.0", "smem227k"),
    ("NVIDIA B300", "10.3", "smem227k"),
]
# The 227 KB entry is compiled on the H200, where the compiler's shared
# memory equals the liveness-based peak (triton_tiles' tuning notes); H100 and
# B200 share its budget. The other entries are for GPUs not at hand.
COMPILED = {"smem227k"}


@pytest.mark.parametrize("kind,cc,name", GPUS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_config_of_each_gpu_fits_its_budget(monkeypatch, kind, cc, name,
                                            dtype):
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [FakeDevice(kind, cc)])
  cap = capability.device_capability()
  assert tc.config_name(cap) == name
  bs = StubTriton(platform="gpu").default_block_sizes("gpu", dtype)
  assert bs == tc.config(cap, dtype)
  limit = capability.smem_limit(cap)
  for kernel in ("fwd", "bwd"):
    est = tc.smem(bs, dtype, kernel)
    # Entries never compiled must fit without relying on the allocator's
    # reuse; the compiled one by the liveness-based peak.
    used = est.peak if name in COMPILED else est.total
    assert used <= limit, (kind, kernel, est)
    assert tc.tile_registers(bs, kernel) <= tc.REG_BUDGET, (kind, kernel)
  bs.check_pallas()  # Powers of two, panels of whole row blocks.


def test_budget_formulas_by_hand():
  bs = tc.CONFIGS["smem227k"][1]  # 128 x 256 x 64, 3 stages, 8 warps.
  assert tc.smem(bs, jnp.bfloat16, "fwd").pipeline == 3 * 384 * 64 * 2
  assert tc.tile_registers(bs, "fwd") == 128 * 256 // 256
  with pytest.raises(ValueError, match="kernel must be"):
    tc.tile_registers(bs, "both")


def test_off_the_gpu_defaults_are_the_interpreter_tiles():
  assert tc.default("cpu", None, jnp.float32) == tc.INTERPRET


# Written down: kind, capability, auto's choice with the extra, without it,
# and with the extra where jax.experimental.pallas.triton does not import.
# "triton" beat "pallas" on the H200 (registry.AUTO_ORDER): it comes first
# wherever the extra is installed.
AUTO = [
    ("NVIDIA A100-SXM4-80GB", "8.0", "triton", "pallas", "triton"),
    ("NVIDIA A10", "8.6", "triton", "pallas", "triton"),
    ("NVIDIA L4", "8.9", "triton", "pallas", "triton"),
    ("NVIDIA GeForce RTX 4090", "8.9", "triton", "pallas", "triton"),
    ("NVIDIA GeForce RTX 5090", "12.0", "triton", "pallas", "triton"),
    ("NVIDIA B200", "10.0", "triton", "pallas", "triton"),
    ("NVIDIA H100 80GB HBM3", "9.0", "mosaic", "mosaic", "mosaic"),
    ("NVIDIA H200", "9.0", "mosaic", "mosaic", "mosaic"),
    ("Tesla T4", "7.5", "xla", "xla", "xla"),
    ("Some Future GPU", "13.7", "xla", "xla", "xla"),
]


def _hide_extra(monkeypatch):
  monkeypatch.setitem(sys.modules, "triton", None)
  monkeypatch.setitem(sys.modules, "jax_triton", None)
  monkeypatch.delitem(sys.modules, "infcl_jax.backends.triton",
                      raising=False)


def _hide_pallas_triton(monkeypatch):
  """As if JAX had removed the Pallas Triton lowering: importing it (and
  so the "pallas" backend's kernels) fails."""
  for mod in list(sys.modules):
    if mod.startswith(("jax.experimental.pallas.triton",
                       "infcl_jax.backends.pallas",
                       "infcl_jax.kernels.pallas")):
      monkeypatch.delitem(sys.modules, mod)
      # ``from package import module`` reads the attribute first.
      parent, _, leaf = mod.rpartition(".")
      if parent in sys.modules:
        monkeypatch.delattr(sys.modules[parent], leaf, raising=False)
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  monkeypatch.setitem(registry._TABLE, "pallas",  # pylint: disable=protected-access
                      registry.BUILTIN["pallas"])


@pytest.mark.parametrize("kind,cc,with_extra,without_extra,no_pallas", AUTO)
@pytest.mark.parametrize("family", ["softmax", "sigmoid"])
def test_auto_policy(monkeypatch, kind, cc, with_extra, without_extra,
                     no_pallas, family):
  monkeypatch.setattr(jax, "devices", lambda *a, **k: [FakeDevice(kind, cc)])
  monkeypatch.setitem(registry._TABLE, "triton", StubTriton)  # pylint: disable=protected-access
  assert registry.auto_backend(family, platform="gpu") == with_extra
  with monkeypatch.context() as m:
    _hide_pallas_triton(m)
    assert registry.auto_backend(family, platform="gpu") == no_pallas
  _hide_extra(monkeypatch)
  monkeypatch.setitem(registry._TABLE, "triton",  # pylint: disable=protected-access
                      registry.BUILTIN["triton"])
  assert registry.auto_backend(family, platform="gpu") == without_extra


def test_explicit_triton_below_sm80_names_the_gpu(monkeypatch):
  monkeypatch.setattr(jax, "devices",
                      lambda *a, **k: [FakeDevice("Tesla T4", "7.5")])
  monkeypatch.setitem(registry._TABLE, "triton", StubTriton)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"^backend='triton' cannot run on "
                     r"Tesla T4 \(compute capability 7\.5\): it needs an "
                     r"NVIDIA GPU of compute capability 8\.0 .*; use "
                     r"backend='xla'"):
    registry.resolve("triton", "softmax", platform="gpu")


def test_without_the_extra_it_is_unavailable_in_one_line(monkeypatch):
  _hide_extra(monkeypatch)
  for family in ("softmax", "sigmoid"):
    assert not registry.available("triton", family, platform="gpu")
    assert not registry.available("triton", family, platform="cpu")
  with pytest.raises(ImportError) as e:
    registry.resolve("triton", "softmax", platform="gpu")
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("backend='triton' needs the "
                                            "triton extra"), msg
  assert 'pip install "infcl-jax[triton]"' in msg, msg
  assert "triton" in registry.names()


def test_import_infcl_jax_needs_only_jax():
  code = ("import sys, infcl_jax; "
          "bad = [m for m in ('triton', 'jax_triton') if m in sys.modules]; "
          "assert not bad, bad; print('ok')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=300, check=False)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("path,extra", [("triton", True), ("triton", False),
                                        ("pallas", True)])
def test_mosaic_triton_path_kernels(monkeypatch, path, extra):
  """Mosaic's Triton path (``fallback``: float32 inputs, stages set to
  "pallas") runs the Triton-language kernels only with ``TRITON_PATH =
  "triton"`` on a GPU where the extra imports; otherwise, and always off
  the GPU (the interpreter), Pallas-Triton's. A bad ``TRITON_PATH`` is one
  line."""
  import types  # pylint: disable=import-outside-toplevel
  from infcl_jax import backends  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import mosaic  # pylint: disable=import-outside-toplevel
  from infcl_jax.backends import pallas  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(jax, "devices",
                      lambda *a, **k: [FakeDevice("NVIDIA H200", "9.0")])
  fake = types.ModuleType("infcl_jax.backends.triton")
  fake.KERNELS = tc.Kernels(*(object() for _ in range(4)))
  monkeypatch.delattr(backends, "triton", raising=False)
  monkeypatch.setitem(sys.modules, "infcl_jax.backends.triton",
                      fake if extra else None)
  cls = type("M", (mosaic.MosaicBackend,), {"TRITON_PATH": path})
  gpu, cpu = cls(platform="gpu"), cls(platform="cpu")
  # pylint: disable=protected-access
  if path == "triton" and extra:
    assert gpu.fallback.kernels is fake.KERNELS
    assert gpu.fallback._kernel_kw() == {}
  else:
    assert gpu.fallback.kernels is pallas.KERNELS
    assert gpu.fallback._kernel_kw() == {"interpret": False}
  assert cpu.fallback.kernels is pallas.KERNELS
  assert cpu.fallback._kernel_kw() == {"interpret": True}
  # pylint: enable=protected-access
  bad = type("B", (mosaic.MosaicBackend,), {"TRITON_PATH": "cuda"})
  with pytest.raises(ValueError, match="TRITON_PATH must be 'pallas' or "
                     "'triton', got 'cuda'"):
    bad(platform="cpu")
