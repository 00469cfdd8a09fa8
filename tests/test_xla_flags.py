"""infcl_jax.xla_flags: the ring's recommended XLA flags and how they are set."""
import subprocess
import sys

import pytest

from infcl_jax import xla_flags

LHS, OVERLAP = xla_flags.RING_GPU_FLAGS


def test_recommended_appends_missing_flags():
  assert xla_flags.recommended("").split() == [LHS, OVERLAP]
  assert xla_flags.recommended("--foo=1").split() == ["--foo=1", LHS, OVERLAP]


def test_recommended_keeps_the_users_values():
  mine = ("--xla_gpu_enable_latency_hiding_scheduler=false "
          "--xla_gpu_experimental_parallel_collective_overlap_limit=4")
  assert xla_flags.recommended(mine).split() == mine.split()
  one = "--xla_gpu_experimental_parallel_collective_overlap_limit=3"
  assert xla_flags.recommended(one).split() == [one, LHS]


def test_apply_to_a_dict():
  env = {"XLA_FLAGS": "--bar"}
  assert xla_flags.apply(env) == f"--bar {LHS} {OVERLAP}"
  assert env["XLA_FLAGS"] == f"--bar {LHS} {OVERLAP}"
  assert xla_flags.apply(env) == env["XLA_FLAGS"]  # Idempotent.
  env = {}
  xla_flags.apply(env)
  assert env["XLA_FLAGS"] == f"{LHS} {OVERLAP}"


def _run(code):
  return subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=120, env={
                            "PATH": "", "JAX_PLATFORMS": "cpu",
                            "PYTHONPATH": ":".join(sys.path)})


def test_apply_before_jax_starts_reaches_xla():
  """In a fresh process: apply() then a computation; the flags are in the
  environment XLA reads, and XLA accepts them on the CPU."""
  r = _run("import os, infcl_jax, jax.numpy as jnp\n"
           "infcl_jax.xla_flags.apply()\n"
           "print(float(jnp.ones(3).sum()), os.environ['XLA_FLAGS'])")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["3.0", LHS, OVERLAP]


def test_apply_after_jax_started_is_an_error():
  r = _run("import infcl_jax, jax.numpy as jnp\n"
           "jnp.ones(3).block_until_ready()\n"
           "infcl_jax.xla_flags.apply()")
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("RuntimeError: infcl_jax.xla_flags.apply() came "
                         "after JAX initialized its backends"), last
  assert "export XLA_FLAGS=" in last


@pytest.mark.parametrize("value", [LHS + " " + OVERLAP])
def test_apply_when_already_set_is_fine_after_start(value):
  """Nothing to add: no error even after JAX started."""
  r = _run("import os\n"
           f"os.environ['XLA_FLAGS'] = {value!r}\n"
           "import infcl_jax, jax.numpy as jnp\n"
           "jnp.ones(3).block_until_ready()\n"
           "print(infcl_jax.xla_flags.apply())")
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == value.split()
