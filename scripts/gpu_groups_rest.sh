#!/usr/bin/env bash
# The second H200 job of the groups session (< 9 min): the -m gpu tests
# that scripts/gpu_groups.sh's time box left unrun (node ids in
# scripts/.gpu_remaining.txt, 4 xdist workers), beside the float32-on-TF32
# test of the triton backend alone (its failure text), then
# benchmarks/probes/odd_batch.py (the Mosaic forward's padding mask, A/B).
#   OUT=... bash scripts/gpu_groups_rest.sh
set -u
cd "$(dirname "$0")/.."
. scripts/gpu_lib.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
mapfile -t ids < scripts/.gpu_remaining.txt
gpu_pytest "$out/gpu_tests_rest.log" "${TEST_S:-280}" 4 "${ids[@]}" &
gpu_pytest "$out/triton_f32.log" "${TEST_S:-280}" "" -k "tf32_tiles and triton" \
  tests/test_groups.py &
wait
echo "== tests done at $((SECONDS - T0)) s"
gpu_summary "$out/gpu_tests_rest.log" "$out/triton_f32.log"
timeout -k 10 $((520 - (SECONDS - T0))) python3 benchmarks/probes/odd_batch.py > "$out/odd_batch.log" 2>&1
echo "== odd_batch rc=$? at $((SECONDS - T0)) s"
sed -n '/SUMMARY/,$p' "$out/odd_batch.log"
