#!/usr/bin/env bash
# The measurements still open after the session of 2026-12-01 (16:30 UTC),
# in one H200 job (< 9.5 min); each part has its own time box:
#   1. issue 25: Mosaic's per-stage times at B = 50,000 and 16,384 (where
#      the odd and the small batch lose their rate; 65,536's are in
#      BENCHMARKS.md), with larger panels for the small batch;
#   2. issue 20: the LiT step at B = 65,536 with the loaded HF CLIP tower
#      beside our own ViT, on the fly and precomputed;
#   3. issue 21: ViT-L/14 streamed (uint8 micro-batches from 12 decode
#      workers) at B = 65,536: its rate and peak memories;
#   4. issue 25: Mosaic's Triton path on the Triton-language kernels
#      (TRITON_PATH = "triton"): its GPU tests, then the float32 step;
#   5. issue 25: the float32 probe's fidelity on the rebuilt correlated inputs.
#   OUT=... bash scripts/gpu_next.sh
set -u
cd "$(dirname "$0")/.."
# Everything goes to a work folder and comes back as one archive ($OUT
# returns at most 8 files; the towers write HLO and profiles per case).
final=${OUT:-/tmp/out}; out=/tmp/gpu_next; mkdir -p "$out" "$final"
T0=$SECONDS
step() { echo "== $1 rc=$2 at $((SECONDS - T0)) s"; }
timeout -k 5 80 python3 benchmarks/bench_mosaic.py --b 50000 --f32 0 > "$out/mosaic_stages_50000.log" 2>&1
step "bench_mosaic B=50000" $?
timeout -k 5 50 python3 benchmarks/bench_mosaic.py --b 16384 --f32 0 --r_list 4096,8192,16384 \
  > "$out/mosaic_stages_16384.log" 2>&1
step "bench_mosaic B=16384" $?
timeout -k 5 170 python3 benchmarks/bench_towers.py --out "$out/towers" \
  --cases lit_hf_on_the_fly,lit_own_on_the_fly,lit_hf_precomputed --budget_s 165 > "$out/towers.log" 2>&1
step "bench_towers lit" $?
timeout -k 5 130 python3 benchmarks/bench_train.py --out "$out/l14" --step_batches "" --ladder "" \
  --stream_batches 65536 --microbatch 4096 --stream_steps 1 --decode_size 256 --workers 12 --image_model l14 \
  --timeout_s 125 > "$out/l14.log" 2>&1
step "bench_train l14" $?
timeout -s INT -k 5 75 python3 -m pytest -m gpu -v -rfE -p no:cacheprovider --tb=short \
  -k triton_path tests/test_mosaic_backend.py > "$out/triton_path_tests.log" 2>&1
step "triton path tests" $?
grep -E "PASSED|FAILED|^E " "$out/triton_path_tests.log" | cut -c1-200 | head -30
timeout -k 5 $((560 - (SECONDS - T0))) python3 benchmarks/probes/f32_precision.py --parts fidelity \
  > "$out/f32_fidelity.log" 2>&1
step "f32 fidelity" $?
grep -h -A40 "^part\|^kind\|SUMMARY" "$out/towers.log" "$out/l14.log" "$out/f32_fidelity.log" | cut -c1-200
tar czf "$final/gpu_next.tgz" -C "$out" .
cp "$out"/*.log "$final"/ 2>/dev/null || true
ls -la "$final"
