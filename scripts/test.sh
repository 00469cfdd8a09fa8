#!/usr/bin/env bash
# The README's test command: set up .venv, then run the CPU test suite.
# Extra arguments go to pytest (e.g. -m "not slow", -k ring).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
