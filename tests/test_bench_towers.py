"""benchmarks/bench_towers.py on the CPU: the plan, the HLO summary, and a
quick run of two A/B cases in their own processes (the pipeline, not the
numbers)."""
import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_towers as bt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shape of XLA:GPU's optimised HLO: kernels inside a command buffer, a
# Triton GEMM whose computation holds the erf (fused as a prologue), and a
# cuBLASLt call with a bias epilogue.
GPU_HLO = """HloModule m

%gemm_fusion_dot.1_computation (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %c = f32[8,16]{1,0} convert(%p0)
  %e = f32[8,16]{1,0} erf(%c)
  %b = bf16[8,16]{1,0} convert(%e)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.1 = bf16[8,4]{1,0} dot(%b, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%command_buffer (p0: bf16[8,16], p1: bf16[16,4]) -> bf16[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %gemm_fusion_dot.1 = bf16[8,4]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}

ENTRY %main (a: bf16[8,16], w: bf16[16,4], x: bf16[8,16], y: bf16[16,16]) -> bf16[8,4] {
  %a = bf16[8,16]{1,0} parameter(0)
  %w = bf16[16,4]{1,0} parameter(1)
  %x = bf16[8,16]{1,0} parameter(2)
  %y = bf16[16,16]{1,0} parameter(3)
  %cublas = (bf16[8,16]{1,0}, s8[0]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"epilogue":"BIAS"}}
  ROOT %call = bf16[8,4]{1,0} call(%a, %w), to_apply=%command_buffer
}
"""


def test_hlo_kernels_lists_kernels_through_command_buffers():
  lines = bt._hlo_kernels(GPU_HLO).splitlines()  # pylint: disable=protected-access
  assert len(lines) == 2, lines
  assert lines[0].split()[:2] == ["cublas", "custom-call"]
  assert "__cublas$lt$matmul" in lines[0] and "BIAS" in lines[0]
  assert lines[1].split()[:2] == ["gemm_fusion_dot.1", "fusion"]
  assert "__triton_gemm" in lines[1] and lines[1].endswith("dotx1 erfx1")


def test_every_planned_case_has_a_spec_and_the_gelu_forms_agree():
  names = [p[0] for p in bt.PLAN]
  assert len(set(names)) == len(names)
  assert set(bt.VIT_CASES) <= set(names)
  for name, kind, est, cap in bt.PLAN:
    label, case = bt.case_spec(name, kind)
    assert label and 0 < est < cap, name
    if kind == "lit":
      assert case["tower"] in ("hf", "own")
      assert case["mode"] in ("precomputed", "on_the_fly")
  assert set(bt.VIT_AB_CASES) <= set(names)
  for label, case in bt.VIT_AB_CASES.values():
    assert set(case["variants"]) <= set(bt.VIT_VARIANTS), label
  assert bt.case_spec("text_jax_eos", "text_jax")[1]["pools"] == ("eos",
                                                              "eos_full")
  forms = bt._gelu_forms()  # pylint: disable=protected-access
  assert {c.get("gelu") for _, c in bt.VIT_CASES.values()} - {None} == set(
      forms)
  x = np.linspace(-6, 6, 1001)
  ref = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x])
  for name, f in forms.items():
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(x, jnp.float32))),
                               ref, atol=2e-6, err_msg=name)


@pytest.mark.slow
def test_quick_run_writes_rows_and_hlo_and_keeps_the_budget(tmp_path):
  cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_towers.py"),
         "--quick", "--out", str(tmp_path), "--cases", "vit_ab,vit_erf,vit_erfc",
         "--profile"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  p = subprocess.run(cmd, capture_output=True, text=True, env=env,
                     timeout=300, check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "bench_towers.jsonl") as f:
    rows = [json.loads(line) for line in f]
  ab = [r for r in rows if r["case"] == "vit_ab"]
  assert [r["variant"] for r in ab] == list(bt.VIT_VARIANTS), ab
  assert all(r["status"] == "ok" and r["per_s"] > 0 for r in ab)
  assert (tmp_path / "hlo" / "vit_ab.full_last.kernels.txt").exists()
  rows = rows[len(ab):]
  assert [(r["case"], r["status"]) for r in rows] == [
      ("vit_erf", "ok"), ("vit_erfc", "ok")], rows
  assert all(r["per_s"] > 0 and r["reps"] == 2 for r in rows)
  assert "ours, GELU erf in f32 (default)" in p.stdout
  # Each child put its own formulation in place: erfc lowers through exp,
  # the default through erf.
  k = {c: (tmp_path / "hlo" / f"{c}.kernels.txt").read_text()
       for c in ("vit_erfc", "vit_erf")}
  assert "erfx" in k["vit_erf"] and "erfx" not in k["vit_erfc"]
  assert (tmp_path / "hlo" / "vit_erfc.hlo.txt").stat().st_size > 1000
  # --profile: each ViT case's ops with their times, longest first.
  lines = (tmp_path / "hlo" / "vit_erf.profile.txt").read_text().splitlines()
  ms = [float(l.split()[-2]) for l in lines[1:-1]]
  assert len(ms) > 3 and ms == sorted(ms, reverse=True) and ms[-1] >= 0
  assert lines[-1].startswith("total") and float(lines[-1].split()[-1]) > 0
  # No budget left: every case is skipped, with the reason, and no child runs.
  p = subprocess.run(cmd + ["--budget_s", "0"], capture_output=True,
                     text=True, env=env, timeout=120, check=False)
  assert p.returncode == 0, p.stderr[-2000:]
  with open(tmp_path / "bench_towers.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert [r["case"] for r in rows] == ["vit_ab", "vit_erf", "vit_erfc"]
  assert all(r["status"].startswith("skipped: ") for r in rows), rows


def test_every_xla_flag_of_a_case_is_known_to_this_jax():
  """XLA aborts a process on an unknown flag: each case's flags, all
  together, in a process that runs a computation."""
  flags = {c.get("xla_flags", "") for _, c in bt.VIT_CASES.values()}
  flags |= {c.get("xla_flags", "") for _, c in bt.VIT_AB_CASES.values()}
  flags = " ".join(sorted(f for f in flags if f))
  assert "--xla_gpu_enable_cudnn_layer_norm=true" in flags
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", "import jax.numpy as j; "
                      "print(float(j.ones(3).sum()))"], capture_output=True,
                     text=True, env=env, timeout=120, check=False)
  assert p.returncode == 0 and p.stdout.strip() == "3.0", p.stderr[-800:]
  env["XLA_FLAGS"] = flags + " --xla_gpu_no_such_flag=true"
  p = subprocess.run([sys.executable, "-c", "import jax.numpy as j; "
                      "j.ones(3).block_until_ready()"], capture_output=True,
                     text=True, env=env, timeout=120, check=False)
  assert p.returncode != 0 and "Unknown flag" in p.stderr


def test_patched_variants_are_in_place_inside_and_restored():
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from train.towers import layers  # pylint: disable=g-import-not-at-top
  before = (layers.Encoder, nn.LayerNorm, dict(layers.ACTIVATIONS))
  with bt._Patched("gelu", dict(prune="off", ln="shift", gelu="erfc")):  # pylint: disable=protected-access
    assert nn.LayerNorm is layers.LayerNorm
    assert layers.Encoder(depth=1, num_heads=1, mlp_dim=4).prune_last is False
    assert layers.ACTIVATIONS["gelu"] is not before[2]["gelu"]
  assert (layers.Encoder, nn.LayerNorm, layers.ACTIVATIONS) == before
  assert layers.Encoder(depth=1, num_heads=1, mlp_dim=4).prune_last


def test_kernel_profile_times_each_op_of_a_jitted_call():
  """harness.kernel_profile: the XLA ops of the call (the sort among them),
  each with its time per call, longest first (here the host's thunks; on a
  GPU its kernels)."""
  import jax  # pylint: disable=import-outside-toplevel
  from benchmarks import harness  # pylint: disable=import-outside-toplevel
  f = jax.jit(lambda x: (jnp.tanh(x @ x.T), jnp.sort(x, axis=1)))
  rows = harness.kernel_profile(f, jnp.ones((256, 256)), steps=2)
  assert len(rows) >= 2, rows
  assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)
  assert all(ms > 0 and n >= 1 for _, ms, n in rows), rows
  assert any("sort" in op for op, _, _ in rows), rows
