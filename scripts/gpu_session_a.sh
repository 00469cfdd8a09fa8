#!/usr/bin/env bash
# One H200 job (< 9.5 min): the kernel backends' GPU tests after the
# triton merge, the triton bench beside pallas/mosaic, the float32 probe.
#   OUT=... bash scripts/gpu_session_a.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$SECONDS
# 1. In parallel (none of these time anything): triton tests, the
#    pallas/mosaic -m gpu tests (2 xdist workers), the float32 fidelity probe.
OUT=$out/triton BENCH_S=0 bash scripts/gpu_triton.sh 200 > "$out/triton.log" 2>&1 &
p1=$!
timeout -s INT -k 15 200 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -n 2 \
  -k "not past_2_to_the_31" tests/test_mosaic_kernels.py tests/test_pallas_sigmoid.py \
  tests/test_pallas.py tests/test_mosaic_backend.py tests/test_auto.py > "$out/gpu_tests.log" 2>&1 &
p2=$!
timeout -k 10 210 python3 benchmarks/probes/f32_precision.py --parts fidelity > "$out/f32_fidelity.log" 2>&1 &
p3=$!
wait $p1 $p2 $p3
echo "== parallel part done at $((SECONDS - T0)) s"
tail -3 "$out/gpu_tests.log"; grep -E "^tests \[|passed|failed" "$out/triton.log" | tail -5
# 2. The > 2^31-element cases alone (they OOM beside other processes).
timeout -s INT -k 10 90 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
  -k "past_2_to_the_31" tests/test_pallas.py tests/test_pallas_sigmoid.py \
  tests/test_mosaic_backend.py tests/test_native_triton.py > "$out/gpu_tests_big.log" 2>&1
echo "== big tests rc=$? at $((SECONDS - T0)) s"; tail -3 "$out/gpu_tests_big.log"
# 3. bench: triton beside pallas and mosaic, B = 65,536, bf16, both families.
timeout -k 10 150 python3 benchmarks/bench_loss.py --out "$out/bench" \
  --loss softmax,sigmoid --backends triton,pallas,mosaic --dtypes bfloat16 \
  --batches 65536 --budget-s 2 --timeout-s 60 > "$out/bench.log" 2>&1
echo "== bench rc=$? at $((SECONDS - T0)) s"; tail -12 "$out/bench.log"
# 4. float32 speeds (alone on the GPU).
timeout -k 10 $((560 - (SECONDS - T0))) python3 benchmarks/probes/f32_precision.py \
  --parts speed > "$out/f32_speed.log" 2>&1
echo "== f32 speed rc=$? at $((SECONDS - T0)) s"
grep -A80 "SUMMARY" "$out/f32_fidelity.log" "$out/f32_speed.log" | cut -c1-160
