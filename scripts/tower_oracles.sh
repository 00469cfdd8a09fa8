#!/usr/bin/env bash
# The oracle leg of CI: regenerates tests/fixtures/towers/ with the reference
# libraries (transformers, timm, open_clip on torch) and checks that they
# equal the committed fixtures the CPU tests compare against.
#
#   bash scripts/tower_oracles.sh            # check (CI)
#   bash scripts/tower_oracles.sh --write    # rewrite the committed fixtures
#
# torch needs Python 3.11 here: the venv is made once with it and reused
# while scripts/oracle-requirements.txt is unchanged (a stamp holds its
# hash). $INFCL_ORACLE_PYTHON picks the interpreter, $INFCL_ORACLE_VENV the
# venv. Without a Python 3.11 this fails: the oracle is never skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
req=scripts/oracle-requirements.txt
venv=${INFCL_ORACLE_VENV:-$HOME/.cache/infcl_jax/oracle-venv-py311}
py=${INFCL_ORACLE_PYTHON:-}
if [ -z "$py" ]; then
  for c in python3.11 /root/.pyenv/versions/3.11*/bin/python3.11; do
    if command -v "$c" >/dev/null 2>&1; then py=$c; break; fi
  done
fi
if [ -z "$py" ]; then
  echo "error: no Python 3.11 for the tower oracles (set INFCL_ORACLE_PYTHON)" >&2
  exit 1
fi
stamp="$venv/.requirements-$(sha256sum "$req" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  start=$SECONDS
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -r "$req" 2>&1 | grep -v "^WARNING: Location" || true
  "$venv/bin/python" -c "import torch, torchvision, timm, open_clip, transformers"
  touch "$stamp"
  echo "tower oracles: venv made in $((SECONDS - start)) s ($venv)" >&2
fi
export PYTHONWARNINGS=ignore
if [ "${1:-}" = "--write" ]; then
  rm -rf tests/fixtures/towers
  exec "$venv/bin/python" scripts/make_tower_fixtures.py tests/fixtures/towers
fi
exec "$venv/bin/python" scripts/make_tower_fixtures.py --check tests/fixtures/towers
