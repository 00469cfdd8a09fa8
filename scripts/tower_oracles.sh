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
. scripts/cached_venv.sh
venv=${INFCL_ORACLE_VENV:-$HOME/.cache/infcl_jax/oracle-venv-py311}
cached_venv "tower oracles (set INFCL_ORACLE_PYTHON)" 3.11 scripts/oracle-requirements.txt "$venv" "${INFCL_ORACLE_PYTHON:-}" "torch, torchvision, timm, open_clip, transformers"
export PYTHONWARNINGS=ignore
if [ "${1:-}" = "--write" ]; then
  rm -rf tests/fixtures/towers
  exec "$venv/bin/python" scripts/make_tower_fixtures.py tests/fixtures/towers
fi
exec "$venv/bin/python" scripts/make_tower_fixtures.py --check tests/fixtures/towers
