#!/usr/bin/env bash
# The last H200 job of the groups session (< 5 min): the Mosaic forward's
# padding mask now only in edge tiles (edge_mask="cond" by default): every
# Mosaic -m gpu test (4 xdist workers, nothing timed), then the fwd+bwd
# step at B = 50,000 and 65,536, both families (bench_loss, one ceiling).
#   OUT=... bash scripts/gpu_odd_final.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout -s INT -k 15 ${TEST_S:-190} python3 -m pytest -m gpu -v -rfE -p no:cacheprovider -n 4 \
  -k "not past_2_to_the_31" tests/test_mosaic_kernels.py tests/test_mosaic_backend.py \
  tests/test_groups_mosaic.py > "$out/mosaic_tests.log" 2>&1
unset XLA_PYTHON_CLIENT_PREALLOCATE
echo "== tests rc=$? at $((SECONDS - T0)) s: $(grep -c ' PASSED' "$out/mosaic_tests.log") passed, $(grep -c ' FAILED' "$out/mosaic_tests.log") failed"
grep -E "^(FAILED|ERROR)|^E  " "$out/mosaic_tests.log" | cut -c1-250 | head -20; tail -1 "$out/mosaic_tests.log"
timeout -k 10 $((300 - (SECONDS - T0))) python3 benchmarks/bench_loss.py --out "$out/bench" --budget-s 2 \
  --timeout-s 60 --loss softmax,sigmoid --backends mosaic --dtypes bfloat16 --batches 50000,65536 \
  > "$out/bench.log" 2>&1
echo "== bench rc=$? at $((SECONDS - T0)) s"
grep -B2 -A12 "bf16 matmul ceiling" "$out/bench.log" | tail -14
