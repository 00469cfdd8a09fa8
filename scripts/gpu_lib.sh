# What the GPU job scripts share (sourced): time-boxed pytest runs whose
# logs keep every test's line (-v) and their one-paragraph summaries, and
# the job's clock.
#   gpu_pytest LOG BOX_S WORKERS PYTEST_ARGS...   (in the background: &)
#   gpu_summary LOG...
#   $out (from $OUT), $T0 (the job's start), left N: seconds left of the
#   first N of the job
# SIGINT at the box, so that pytest still writes what it has.
gpu_pytest() {
  local log=$1 box=$2 workers=$3
  shift 3
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 15 "$box" \
    python3 -m pytest -m gpu -v -rfE -p no:cacheprovider --tb=short \
    ${workers:+-n "$workers"} "$@" > "$log" 2>&1
}

gpu_summary() {
  local f
  for f in "$@"; do
    echo "-- $(basename "$f" .log): $(grep -c ' PASSED' "$f") passed, $(grep -c ' FAILED' "$f") failed, $(grep -c ' SKIPPED' "$f") skipped"
    grep -E "^(FAILED|ERROR)|^E  " "$f" | cut -c1-250 | head -20
    tail -1 "$f"
  done
}

out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
