#!/usr/bin/env bash
# One H200 job (< 8 min): every kernel backend's -m gpu tests (triton's
# beside the others, 2 + 3 xdist workers: nothing is timed), then issue 25's
# table and the triton rows in one bench_loss run (resumed across calls,
# one ceiling), each case alone on the GPU.
#   OUT=... bash scripts/gpu_session_c.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout -s INT -k 15 230 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider -n 3 \
  -k "not past_2_to_the_31" tests/test_mosaic_kernels.py tests/test_pallas_sigmoid.py \
  tests/test_pallas.py tests/test_mosaic_backend.py tests/test_auto.py > "$out/gpu_tests.log" 2>&1 &
p1=$!
timeout -s INT -k 15 230 python3 -m pytest -v -rfE -p no:cacheprovider -n 2 \
  -k "not past_2_to_the_31" tests/test_native_triton.py > "$out/triton_tests.log" 2>&1 &
p2=$!
wait $p1 $p2
unset XLA_PYTHON_CLIENT_PREALLOCATE
echo "== tests done at $((SECONDS - T0)) s"
for f in gpu_tests triton_tests; do
  echo "-- $f: $(grep -c ' PASSED' "$out/$f.log") passed, $(grep -c ' FAILED' "$out/$f.log") failed, $(grep -c ' SKIPPED' "$out/$f.log") skipped"
  grep -E "^(FAILED|ERROR)" "$out/$f.log" | head -20; tail -1 "$out/$f.log"
done
b() { timeout -k 10 "$1" python3 benchmarks/bench_loss.py --out "$out/bench" --budget-s 2 \
        --timeout-s 90 --resume "${@:2}" >> "$out/bench.log" 2>&1; echo "bench $* rc=$? at $((SECONDS - T0)) s"; }
b 120 --loss softmax,sigmoid --backends mosaic,triton,pallas --dtypes bfloat16 --batches 65536
b 90 --loss softmax --backends mosaic,triton --dtypes float32,float16 --batches 65536
b 70 --loss softmax,sigmoid --backends mosaic --dtypes bfloat16 --batches 16384,50000
b $((470 - (SECONDS - T0))) --loss softmax --backends mosaic --dtypes bfloat16 --batches 1048576
grep -B2 -A30 "bf16 matmul ceiling" "$out/bench.log" | tail -24
