#!/usr/bin/env bash
# One GPU job for groups= in the Triton-family kernels (one H200, < 9 min):
# the -m gpu groups tests of backend "pallas" (tests/test_groups_kernels.py)
# and "triton" (tests/test_native_triton.py -k Groups), time-boxed, then
# benchmarks/bench_groups_kernels.py (with / without group ids at
# B = 65,536, D = 768, bf16; target ratio <= 1.05). Writes under
# ${OUT:-/tmp/out}: tests.log (pytest output) and bench.log (the table and
# its groups_bench JSON lines).
#
#   bash scripts/gpu_groups_triton.sh [TEST_TIMEOUT_S]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
py=${PYTHON:-python}
test_s=${1:-300}
if ! "$py" -c "import jax_triton" 2>/dev/null; then
  "$py" -m pip install -q --no-deps .whl/jax_triton-*.whl || true
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: > "$out/tests.log"
start=$SECONDS
timeout -k 10 "$test_s" "$py" -m pytest -q -p no:cacheprovider --tb=short \
  -rfE -m gpu tests/test_groups_kernels.py tests/test_native_triton.py \
  -k "Groups" >> "$out/tests.log" 2>&1
echo "groups tests: exit $? in $((SECONDS - start)) s (box $test_s s)" | tee -a "$out/tests.log"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -30
timeout -k 10 "${BENCH_S:-240}" "$py" benchmarks/bench_groups_kernels.py \
  --dtypes bfloat16 --reps 5 2>&1 | grep -v Warning | tee "$out/bench.log"
