#!/usr/bin/env bash
# The second H200 job of the groups session (< 9 min): the -m gpu tests
# that scripts/gpu_groups.sh's time box left unrun (node ids in
# scripts/.gpu_remaining.txt, 4 xdist workers), beside the float32-on-TF32
# test of the triton backend alone (its failure text), then
# benchmarks/probes/odd_batch.py (the Mosaic forward's padding mask, A/B).
#   OUT=... bash scripts/gpu_groups_rest.sh
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mapfile -t ids < scripts/.gpu_remaining.txt
timeout -s INT -k 15 ${TEST_S:-280} python3 -m pytest -m gpu -v -rfE -p no:cacheprovider -n 4 \
  "${ids[@]}" > "$out/gpu_tests_rest.log" 2>&1 &
p1=$!
timeout -s INT -k 15 ${TEST_S:-280} python3 -m pytest -m gpu -v -rfE -p no:cacheprovider --tb=short \
  -k "tf32_tiles and triton" tests/test_groups.py > "$out/triton_f32.log" 2>&1 &
p2=$!
wait $p1 $p2
unset XLA_PYTHON_CLIENT_PREALLOCATE
echo "== tests done at $((SECONDS - T0)) s"
for f in gpu_tests_rest triton_f32; do
  echo "-- $f: $(grep -c ' PASSED' "$out/$f.log") passed, $(grep -c ' FAILED' "$out/$f.log") failed"
  grep -E "^(FAILED|ERROR)|^E  " "$out/$f.log" | cut -c1-250 | head -20; tail -1 "$out/$f.log"
done
timeout -k 10 $((520 - (SECONDS - T0))) python3 benchmarks/probes/odd_batch.py > "$out/odd_batch.log" 2>&1
echo "== odd_batch rc=$? at $((SECONDS - T0)) s"
sed -n '/SUMMARY/,$p' "$out/odd_batch.log"
