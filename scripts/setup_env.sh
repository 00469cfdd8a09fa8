#!/usr/bin/env bash
# Creates (or refreshes) .venv with Python >= 3.12 and the pinned packages.
# Python is found in this order: $PYTHON, python3.12, python3.13, python3,
# then pyenv's newest 3.12+. Usage: bash scripts/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && ok "$c" && { command -v "$c"; return; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])' | sort -rV); do
      c="$(pyenv root)/versions/$v/bin/python3"
      ok "$c" && { echo "$c"; return; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ] || ! ok .venv/bin/python; then
  py=$(find_python) || {
    echo "error: infcl-jax needs Python >= 3.12 (jax >= 0.11 does). Set PYTHON=/path/to/python3.12," \
         "or install python3.12 (or pyenv install 3.12)." >&2
    exit 1
  }
  echo "setup: creating .venv with $py ($("$py" --version))" >&2
  rm -rf .venv
  "$py" -m venv .venv
fi

stamp=.venv/.infcl-stamp
want=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing packages into .venv" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c scripts/constraints.txt -e ".[train,dev]"
  echo "$want" > "$stamp"
fi
