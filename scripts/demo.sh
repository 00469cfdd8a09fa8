#!/usr/bin/env bash
# The README's main command: set up .venv, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python benchmarks/memory_demo.py "$@"
