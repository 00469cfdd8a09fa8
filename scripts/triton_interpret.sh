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
req=scripts/triton-requirements.txt
venv=${INFCL_TRITON_VENV:-$HOME/.cache/infcl_jax/triton-venv}
py=${INFCL_TRITON_PYTHON:-}
if [ -z "$py" ]; then
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    if "$c" -c "import sys" >/dev/null 2>&1; then py=$c; break; fi
  done
fi
if [ -z "$py" ]; then
  echo "error: no Python 3.12 for the triton leg (set INFCL_TRITON_PYTHON)" >&2
  exit 1
fi
stamp="$venv/.requirements-$(sha256sum "$req" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  start=$SECONDS
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -r "$req" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -c "import triton, jax"
  touch "$stamp"
  echo "triton leg: venv made in $((SECONDS - start)) s ($venv)" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() {
  "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::DeprecationWarning -m "not gpu" "$@"
}
rc=0
TRITON_INTERPRET=1 run tests/test_native_triton.py "$@" || rc=$?
TRITON_INTERPRET=0 run tests/test_triton_aot.py "$@" || rc=$?
exit "$rc"
