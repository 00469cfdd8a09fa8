#!/usr/bin/env bash
# The H200 jobs of the session that works on what groups= costs (issue 26),
# one per device call (each < 9.5 min):
#   diag:  where the grouped rows' extra time goes: bench_groups with
#          per-kernel profiles (mosaic softmax, triton and pallas sigmoid),
#          then Nsight Compute on the grouped kernels beside the plain ones
#          (B = 32,768: the kernels are per tile, the size only sets the
#          grid)
#   check: every groups -m gpu test of the Mosaic softmax and the Pallas
#          and Triton sigmoid kernels, then their rows of bench_groups
#          (three interleaved rounds, "none again" the noise floor); it ran
#          on the per-tile flags that BENCHMARKS.md records as reverted
#   tests: the same tests alone (the kernels as committed)
#   triton: after the triton backend's grouped "mask" sigmoid panels run
#          without the diagonal (written afterwards): its sigmoid groups
#          -m gpu tests, then its bench_groups row
#   mosaic: after the Mosaic softmax forward's per-column test moved behind
#          a branch per round: its groups -m gpu tests, then its row of
#          bench_groups
#   OUT=... bash scripts/gpu_groups_cost.sh JOB
set -u
cd "$(dirname "$0")/.."
. scripts/gpu_lib.sh
export XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune_groups"
g() { timeout -k 5 "$1" python3 benchmarks/bench_groups.py "${@:2}" >> "$out/bench_groups.log" 2>&1
      echo "bench_groups ${*:2} rc=$? at $((SECONDS - T0)) s"; }
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats --section SchedulerStats"
ncu_step() {  # LOG FAMILY BACKEND MODE
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 75 "$NCU" --clock-control none \
    -k regex:"infcl|_kernel|_sums" --launch-count 3 $NCU_SECTIONS --print-details all \
    python3 benchmarks/probes/groups_step.py --family "$2" --backend "$3" --mode "$4" > "$1" 2>&1
  echo "ncu $2 $3 $4 rc=$? at $((SECONDS - T0)) s"
}
groups_tests() {  # BOX_S: every kernel backend's groups -m gpu tests
  gpu_pytest "$out/gpu_tests.log" "$1" 3 tests/test_groups_mosaic.py tests/test_groups_kernels.py &
  gpu_pytest "$out/triton_tests.log" "$1" 2 -k "Groups and Gpu" tests/test_native_triton.py &
  wait
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/gpu_tests.log" "$out/triton_tests.log"
}
case "${1:?job: diag, check, tests, mosaic or triton}" in
triton)
  gpu_pytest "$out/triton_tests.log" 130 2 -k "Groups and Gpu and sigmoid" tests/test_native_triton.py
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/triton_tests.log"
  g "$(left 235)" --backends triton --families sigmoid --rounds 2 --modes "none,mask,positives,none again"
  grep "^check\|^time\|^cost" "$out/bench_groups.log" | sort -u
  ;;
mosaic)
  gpu_pytest "$out/gpu_tests.log" 200 3 tests/test_groups_mosaic.py
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/gpu_tests.log"
  g "$(left 330)" --backends mosaic --families softmax --rounds 3 --modes "none,mask,positives,none again"
  grep "^check\|^time\|^cost" "$out/bench_groups.log" | sort -u
  ;;
tests)
  groups_tests 230
  ;;
check)
  groups_tests 200
  g "$(left 320)" --backends mosaic --families softmax --rounds 3 --modes "none,mask,positives,none again"
  g "$(left 440)" --backends triton --families sigmoid --rounds 3 --modes "none,mask,positives,none again"
  g "$(left 560)" --backends pallas --families sigmoid --rounds 3 --modes "none,mask,positives,none again"
  grep "^check\|^time\|^cost" "$out/bench_groups.log" | sort -u
  ;;
diag)
  mkdir -p "$out/prof"
  g "$(left 150)" --backends mosaic --families softmax --rounds 2 --modes "none,mask,positives,none again" --profile "$out/prof"
  g "$(left 270)" --backends triton --families sigmoid --rounds 2 --modes "none,mask,positives,none again" --profile "$out/prof"
  g "$(left 370)" --backends pallas --families sigmoid --rounds 2 --modes "none,mask,positives" --profile "$out/prof"
  grep "^check\|^time\|^cost" "$out/bench_groups.log"
  for f in "$out"/prof/*.txt; do echo "-- $f"; head -8 "$f"; done
  for m in none mask positives; do
    [ "$(left 520)" -gt 60 ] && ncu_step "$out/ncu_triton_sigmoid_$m.log" sigmoid triton $m
  done
  for m in none mask; do
    [ "$(left 560)" -gt 60 ] && ncu_step "$out/ncu_mosaic_softmax_$m.log" softmax mosaic $m
  done
  for f in "$out"/ncu_*.log; do
    echo "-- $f"; grep -E "^  [_a-z].*\(|Duration|Registers Per|Warp Cycles Per Issued|Executed Instructions  |Achieved Occupancy|Stall|stall" "$f" | head -40
  done
  ;;
esac
