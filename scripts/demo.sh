#!/usr/bin/env bash
# The README's main command: set up .venv, then train the embedded LiT demo
# (offline, CPU-sized). Extra arguments go to train.main, e.g.
#   bash scripts/demo.sh --config.total_steps=200
# Re-running resumes from the newest checkpoint in $WORKDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
# setuptools prints an informational "Editable installation" warning block
# while pip builds the editable package; keep it out of the demo's output.
PYTHONWARNINGS="ignore:Editable installation" bash scripts/setup_env.sh
workdir=${WORKDIR:-workdir/lit_demo}
exec .venv/bin/python -m train.main --config configs/lit_demo.py --workdir "$workdir" "$@"
