#!/usr/bin/env bash
# The last H200 job of the groups session (< 5 min): the Mosaic forward's
# padding mask now only in the tiles that hold padding: every
# Mosaic -m gpu test (4 xdist workers, nothing timed), then the fwd+bwd
# step at B = 50,000 and 65,536, both families (bench_loss, one ceiling).
#   OUT=... bash scripts/gpu_odd_final.sh
set -u
cd "$(dirname "$0")/.."
. scripts/gpu_lib.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
gpu_pytest "$out/mosaic_tests.log" "${TEST_S:-190}" 4 -k "not past_2_to_the_31" \
  tests/test_mosaic_kernels.py tests/test_mosaic_backend.py tests/test_groups_mosaic.py
echo "== tests done at $((SECONDS - T0)) s"
gpu_summary "$out/mosaic_tests.log"
timeout -k 10 $((300 - (SECONDS - T0))) python3 benchmarks/bench_loss.py --out "$out/bench" --budget-s 2 \
  --timeout-s 60 --loss softmax,sigmoid --backends mosaic --dtypes bfloat16 --batches 50000,65536 \
  > "$out/bench.log" 2>&1
echo "== bench rc=$? at $((SECONDS - T0)) s"
grep -B2 -A12 "bf16 matmul ceiling" "$out/bench.log" | tail -14
