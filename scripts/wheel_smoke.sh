#!/usr/bin/env bash
# The library as a user installs it: build the sdist and the wheel from this
# checkout (python -m build, the wheel from the sdist), install the wheel
# into a clean venv that holds only the [flax] extra's packages, and run
# scripts/wheel_smoke.py from a directory outside the checkout, without
# PYTHONPATH: import, one loss and gradient against float64, the linen and
# NNX heads, the README's NNX example.
#
#   bash scripts/wheel_smoke.sh
#
# The venv (jax, flax, build: ~1 min to make) is made once and reused while
# scripts/wheel-smoke-requirements.txt is unchanged; $INFCL_WHEEL_VENV picks
# it. The wheel is always built and installed afresh (the one a previous run
# installed is uninstalled first), with --no-index: its dependencies must be
# those the venv already holds, so a wrong or missing requirement fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
. scripts/cached_venv.sh
venv=${INFCL_WHEEL_VENV:-$HOME/.cache/infcl_jax/wheel-venv}
cached_venv "wheel smoke leg (set INFCL_WHEEL_PYTHON)" 3.12 scripts/wheel-smoke-requirements.txt \
  "$venv" "${INFCL_WHEEL_PYTHON:-}" "jax, flax, optax, build"
py=$venv/bin/python

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The checkout's files (tracked, and untracked ones git does not ignore),
# copied, so that the build writes its egg-info and build/ there.
mkdir "$tmp/src"
git ls-files -z --cached --others --exclude-standard \
  | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$tmp/src"
start=$SECONDS
"$py" -m build --no-isolation --outdir "$tmp/dist" "$tmp/src" > "$tmp/build.log" 2>&1 || {
  cat "$tmp/build.log" >&2; echo "error: the build failed" >&2; exit 1; }
wheel=$(ls "$tmp"/dist/*.whl)
echo "wheel smoke: built $(basename "$wheel") and its sdist in $((SECONDS - start)) s" >&2

"$py" -m pip uninstall -q -y infcl-jax 2>/dev/null || true
"$py" -m pip install -q --no-index "$wheel[flax]"
"$py" -m pip check

# From a directory of its own (the script copied there: Python puts a
# script's directory first on sys.path).
mkdir "$tmp/user"
cp scripts/wheel_smoke.py "$tmp/user/"
cd "$tmp/user"
env -u PYTHONPATH "$py" wheel_smoke.py --readme "$root/README.md" \
  --sdist "$(ls "$tmp"/dist/*.tar.gz)" --wheel "$wheel"
