#!/usr/bin/env bash
# Creates (or refreshes) a virtual environment with Python >= 3.12 and the
# pinned packages. Python is found in this order: $PYTHON, python3.12, pyenv's
# oldest 3.12+ (3.12 is what CI tests), then python3.13 or python3 if 3.12+.
#
# Usage: bash scripts/setup_env.sh            # .venv: jax 0.11.2, [train,dev]
#        bash scripts/setup_env.sh jax012     # .venv-jax012: jax 0.12.x and
#                                             # what the library tests import
# The second environment is what CI runs the fast library tests in, so the
# supported range (pyproject: jax>=0.11.2,<0.13) is tested at both ends. It
# holds no install of this project (the tests import it from the checkout,
# scripts/test.sh sets PYTHONPATH), so one such venv serves every clone:
# $INFCL_JAX012_VENV puts it elsewhere (.ci/run keeps it in ~/.cache).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
  "")
    venv=.venv
    constraints=scripts/constraints.txt
    install=(-e ".[train,dev]")
    ;;
  jax012)
    venv=${INFCL_JAX012_VENV:-.venv-jax012}
    constraints=scripts/constraints-jax012.txt
    # The library's dependencies, plus what the library tests import (flax:
    # infcl_jax.flax and the README's Flax snippet) and filelock (jax locks
    # its compile cache with it: scripts/cpu_test_env.sh). The trainer's
    # packages are not needed.
    install=(jax jaxlib numpy pytest pytest-xdist flax filelock)
    ;;
  *)
    echo "usage: bash scripts/setup_env.sh [jax012]" >&2
    exit 2
    ;;
esac

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c v
  if [ -n "${PYTHON:-}" ]; then  # An explicit choice is used or refused, never skipped.
    if command -v "$PYTHON" >/dev/null 2>&1 && ok "$PYTHON"; then command -v "$PYTHON"; return; fi
    echo "error: PYTHON=$PYTHON is not a Python >= 3.12 (jax >= 0.11 needs it)" >&2
    exit 1
  fi
  if command -v python3.12 >/dev/null 2>&1 && ok python3.12; then command -v python3.12; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    # The oldest 3.12+ first: 3.12 is the tested version.
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.[0-9]+)?$' | sort -V); do
      c="$(pyenv root)/versions/$v/bin/python3"
      ok "$c" && { echo "$c"; return; }
    done
  fi
  for c in python3.13 python3; do
    command -v "$c" >/dev/null 2>&1 && ok "$c" && { command -v "$c"; return; }
  done
  return 1
}

if [ ! -x "$venv/bin/python" ] || ! ok "$venv/bin/python"; then
  py=$(find_python) || {
    [ -n "${PYTHON:-}" ] && exit 1  # find_python said why.
    echo "error: infcl-jax needs Python >= 3.12 (jax >= 0.11 does). Set PYTHON=/path/to/python3.12," \
         "or install python3.12 (or pyenv install 3.12)." >&2
    exit 1
  }
  echo "setup: creating $venv with $py ($("$py" --version))" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
fi

stamp=$venv/.infcl-stamp
want=$( (cat pyproject.toml "$constraints"; echo "${install[*]}") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing packages into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  # setuptools' informational "Editable installation" warning block (flat
  # layout) would otherwise appear in the demo's and the tests' output.
  PYTHONWARNINGS="ignore:Editable installation" \
    "$venv/bin/python" -m pip install -q -c "$constraints" "${install[@]}"
  echo "$want" > "$stamp"
fi
