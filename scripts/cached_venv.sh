# Sourced by the CI legs that need their own venv (tower_oracles.sh,
# triton_interpret.sh): one way to make it once and reuse it.
#
#   cached_venv LEG VERSION REQUIREMENTS VENV PYTHON IMPORTS
#
# VENV is (re)made from REQUIREMENTS with PYTHON (if empty: the first of
# pythonVERSION and pyenv's VERSION that runs), and reused while REQUIREMENTS is unchanged (a
# stamp in VENV holds its hash); IMPORTS must import in it afterwards. With
# no such Python it fails: a leg is never skipped.
cached_venv() {
  local leg=$1 version=$2 req=$3 venv=$4 py=${5:-} imports=$6 c start stamp
  if [ -z "$py" ]; then
    for c in "python$version" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version"*/bin/"python$version"; do
      if "$c" -c "import sys" >/dev/null 2>&1; then py=$c; break; fi
    done
  fi
  if [ -z "$py" ]; then
    echo "error: no Python $version for the $leg" >&2
    return 1
  fi
  stamp="$venv/.requirements-$(sha256sum "$req" | cut -c1-16)"
  if [ ! -e "$stamp" ]; then
    start=$SECONDS
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/pip" install -q -r "$req" 2>&1 | grep -v "^WARNING: Location" || true
    "$venv/bin/python" -c "import $imports"
    touch "$stamp"
    echo "$leg: venv made in $((SECONDS - start)) s ($venv)" >&2
  fi
}
