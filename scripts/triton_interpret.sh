#!/usr/bin/env bash
# The triton backend's CI leg, on the CPU:
#   1. tests/test_native_triton.py: its kernels in Triton's interpreter
#      (TRITON_INTERPRET=1) against float64;
#   2. tests/test_triton_aot.py: every kernel compiled ahead of time for
#      sm80, sm86, sm89, sm90 and sm100 with the tiles each GPU gets, and
#      checked against its shared memory, registers and spills (Triton's
#      compiled kernels are cached in ~/.triton/cache).
# pytest args go to both.
#
#   bash scripts/triton_interpret.sh [pytest args]
#
# The venv (triton is ~1.3 GB installed, a ~25 s install here) is made once
# and reused while scripts/triton-requirements.txt is unchanged (a stamp
# holds its hash). $INFCL_TRITON_VENV picks the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cached_venv.sh
venv=${INFCL_TRITON_VENV:-$HOME/.cache/infcl_jax/triton-venv}
cached_venv "triton leg (set INFCL_TRITON_PYTHON)" 3.12 scripts/triton-requirements.txt "$venv" "${INFCL_TRITON_PYTHON:-}" "triton, jax"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. scripts/cpu_test_env.sh "$venv/bin/python"
run() {
  "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning -m "not gpu" "$@"
}
rc=0
TRITON_INTERPRET=1 run tests/test_native_triton.py "$@" || rc=$?
TRITON_INTERPRET=0 run -n 2 tests/test_triton_aot.py "$@" || rc=$?
exit "$rc"
