#!/usr/bin/env bash
# The README's test command: set up the environment, then run the CPU tests.
#   bash scripts/test.sh [pytest args]         # .venv, jax 0.11.2: the full suite
#   bash scripts/test.sh jax012 [pytest args]  # .venv-jax012, jax 0.12.x: the
#       fast library tests (no trainer, tower, data, evaluation, optimizer,
#       notebook, benchmark or multi-process tests; not slow, not gpu)
# Extra arguments go to pytest (e.g. -m "not slow", -k ring). pytest's own exit
# code is returned; 5 (no tests collected) is a failure like any other. The
# interpreter cases marked `interpret` (tests/interpret_tests.txt) run only
# when -m names them (the GPU job). The 20 slowest tests are printed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "jax012" ]; then
  shift
  bash scripts/setup_env.sh jax012
  py=${INFCL_JAX012_VENV:-.venv-jax012}/bin/python
  want=0.12.
  # That venv has no install of this project: the checkout is imported.
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  # Library tests = every test file except these, so that renaming or adding a
  # library test file needs no change here.
  select=(-m "not slow and not gpu"
          --ignore-glob="tests/test_train*.py"
          --ignore-glob="tests/test_data.py"
          --ignore-glob="tests/test_bad_data.py"
          --ignore-glob="tests/test_remote_data.py"
          --ignore-glob="tests/test_gcs_checkpoint.py"
          --ignore-glob="tests/test_outage.py"
          --ignore-glob="tests/test_file_keys.py"
          --ignore-glob="tests/test_gpu_decode*.py"
          --ignore-glob="tests/test_config_validation.py"
          --ignore-glob="tests/test_preemption.py"
          --ignore-glob="tests/test_workdir_record.py"
          --ignore-glob="tests/test_recipe.py"
          --ignore-glob="tests/test_notebooks.py"
          --ignore-glob="tests/test_bench_*.py"
          --ignore-glob="tests/test_multiprocess*.py"
          --ignore-glob="tests/test_eval*.py"
          --ignore-glob="tests/test_optim*.py"
          --ignore-glob="tests/test_pretrained*.py"
          --ignore-glob="tests/test_sources*.py"
          --ignore-glob="tests/test_stream*.py"
          --ignore-glob="tests/test_tokenizer*.py"
          --ignore-glob="tests/test_towers*.py"
          --ignore=tests/test_native_triton.py --ignore=tests/test_triton_aot.py
          # The kernels' interpreter grids and the float64 oracle grids run
          # in leg 1 (jax 0.11.2, the GPU-tested version); here, what a jax
          # upgrade breaks first: the API, the xla backend, ring and gather,
          # groups and labels, the heads, x64-free numerics, and every
          # kernel family forward and backward at the GPU's tiles under the
          # watchdog (tests/test_interpreter_watchdog.py).
          --ignore=tests/test_groups_mosaic.py --ignore=tests/test_x64.py
          --ignore=tests/test_mosaic_backend.py --ignore=tests/test_confident.py
          --ignore=tests/test_exact_groups.py --ignore=tests/test_mosaic_kernels.py
          --ignore=tests/test_group_tiles.py --ignore=tests/test_pallas_sigmoid.py
          --ignore=tests/test_mosaic_padding.py --ignore=tests/test_diagonal_outside.py
          --ignore=tests/test_groups_kernels.py --ignore=tests/test_np_reference.py
          --ignore=tests/test_tf32_emulated.py --ignore=tests/test_gpu_verify.py
          --deselect="tests/test_readme.py::test_pretrained_tower_snippet_embeds_as_transformers_does")
else
  bash scripts/setup_env.sh
  py=.venv/bin/python
  want=0.11.2
  # The triton backend's kernels need the triton extra: their own leg
  # (scripts/triton_interpret.sh) and the GPU run.
  select=(--ignore=tests/test_native_triton.py --ignore=tests/test_triton_aot.py)
fi

"$py" - "$want" <<'PY'
import sys, jax, jaxlib
want = sys.argv[1]
print(f"test: jax {jax.__version__}, jaxlib {jaxlib.__version__}, python {sys.version.split()[0]}",
      file=sys.stderr)
if not (jax.__version__.startswith(want) and jaxlib.__version__.startswith(want)):
  sys.exit(f"error: expected jax/jaxlib {want}*, found {jax.__version__}/{jaxlib.__version__}")
PY
. scripts/cpu_test_env.sh "$py"
exec "$py" -m pytest -q -n 2 --dist loadfile --durations=20 "${select[@]}" "$@"
