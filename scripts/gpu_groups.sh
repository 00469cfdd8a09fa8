#!/usr/bin/env bash
# One H200 job (< 8.5 min) for issue 26 after the kernels took groups=:
# every kernel backend's -m gpu tests, the groups ones included (triton's
# beside the others, 3 + 2 xdist workers: nothing is timed), then what
# groups= costs each backend's whole loss at B = 65,536 (bench_groups.py,
# whose "none" rows are also the loss's regression benchmark).
#   OUT=... bash scripts/gpu_groups.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout -s INT -k 15 ${TEST_S:-235} python3 -m pytest -m gpu -v -rfE -p no:cacheprovider -n 3 \
  -k "not past_2_to_the_31" tests/test_groups.py tests/test_groups_kernels.py \
  tests/test_groups_mosaic.py tests/test_mosaic_kernels.py tests/test_pallas_sigmoid.py \
  tests/test_pallas.py tests/test_mosaic_backend.py tests/test_auto.py > "$out/gpu_tests.log" 2>&1 &
p1=$!
timeout -s INT -k 15 ${TEST_S:-235} python3 -m pytest -m gpu -v -rfE -p no:cacheprovider -n 2 \
  -k "not past_2_to_the_31" tests/test_native_triton.py > "$out/triton_tests.log" 2>&1 &
p2=$!
wait $p1 $p2
unset XLA_PYTHON_CLIENT_PREALLOCATE
echo "== tests done at $((SECONDS - T0)) s"
for f in gpu_tests triton_tests; do
  echo "-- $f: $(grep -c ' PASSED' "$out/$f.log") passed, $(grep -c ' FAILED' "$out/$f.log") failed, $(grep -c ' SKIPPED' "$out/$f.log") skipped"
  grep -E "^(FAILED|ERROR)" "$out/$f.log" | cut -c1-250 | head -25; tail -1 "$out/$f.log"
done
timeout -k 10 $((480 - (SECONDS - T0))) python3 benchmarks/bench_groups.py --backends mosaic,triton,pallas \
  > "$out/bench_groups.log" 2>&1
echo "== bench_groups rc=$? at $((SECONDS - T0)) s"
sed -n '/SUMMARY/,$p' "$out/bench_groups.log"
