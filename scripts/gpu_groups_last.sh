#!/usr/bin/env bash
# The H200 jobs of the session that takes groups= under 5% (issue 26), one
# per device call (each < 9.5 min); carry .whl (jax-triton's wheel):
#   ab:    the -m gpu groups tests of the changed paths (the Mosaic softmax
#          forward's two variants, the sigmoid diagonal shortcuts on the
#          mosaic, pallas and triton kernels), then bench_groups: the Mosaic
#          softmax row, and the Mosaic and Pallas sigmoid rows with the
#          "mask" panels with and without their diagonal
#   sorted: the Mosaic -m gpu groups and kernel tests (the softmax kernels
#          on ids sorted in the backend, clean tiles unmasked), the step's
#          timeline with and without groups, then bench_groups' Mosaic
#          softmax rows
#   last:  the Mosaic -m gpu groups and kernel tests, then bench_groups,
#          every backend and family in one job (three rounds), in 430 s
#   final: bench_groups, every backend and family in one job (three
#          interleaved rounds, "none again" the noise floor), then the
#          remaining -m gpu groups tests in the time left
#   one:   the -m gpu sigmoid groups tests of every kernel backend (the
#          diagonal taken outside the tiles in both modes), then
#          bench_groups, every backend and family in one job, five rounds
#   tests: the -m gpu tests of every groups path and of the backends that
#          carry them (Mosaic, Pallas, Triton), three runs side by side
#   OUT=... bash scripts/gpu_groups_last.sh JOB
set -u
cd "$(dirname "$0")/.."
. scripts/gpu_lib.sh
export PYTHONPATH=.
export XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune_groups"
python3 -c "import jax_triton" 2>/dev/null || python3 -m pip install -q --no-deps .whl/jax_triton-*.whl
g() { timeout -k 5 "$1" python3 benchmarks/bench_groups.py "${@:2}" >> "$out/bench_groups.log" 2>&1
      echo "bench_groups ${*:2} rc=$? at $((SECONDS - T0)) s"; }
rows() { grep "^check\|^time\|^cost" "$out/bench_groups.log" | sort -u; }
# The -m gpu groups tests of the sigmoid paths (the Mosaic ones selected by
# -k "$2": "" for all), three runs side by side, boxed at $1 s.
groups_tests() {
  gpu_pytest "$out/mosaic_tests.log" "$1" 2 -k "$2" tests/test_groups_mosaic.py &
  gpu_pytest "$out/pallas_tests.log" "$1" 1 -k sigmoid tests/test_groups_kernels.py &
  gpu_pytest "$out/triton_tests.log" "$1" 1 -k "Groups and Gpu and sigmoid" tests/test_native_triton.py &
  wait
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/mosaic_tests.log" "$out/pallas_tests.log" "$out/triton_tests.log"
}
case "${1:?job: ab, sorted, last, final, one or tests}" in
tests)
  gpu_pytest "$out/mosaic_tests.log" 480 2 tests/test_groups_mosaic.py tests/test_mosaic_backend.py &
  gpu_pytest "$out/groups_tests.log" 480 2 tests/test_groups.py tests/test_groups_kernels.py tests/test_pallas_sigmoid.py &
  gpu_pytest "$out/triton_tests.log" 480 1 -k Gpu tests/test_native_triton.py &
  wait
  gpu_summary "$out/mosaic_tests.log" "$out/groups_tests.log" "$out/triton_tests.log"
  ;;
one)
  groups_tests 175 sigmoid
  g "$(left 575)" --backends mosaic,triton,pallas --rounds 5
  rows
  ;;
last)
  gpu_pytest "$out/mosaic_tests.log" 170 2 tests/test_groups_mosaic.py tests/test_mosaic_kernels.py
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/mosaic_tests.log"
  g "$(left 430)" --backends mosaic,triton,pallas --rounds 3
  rows
  ;;
sorted)
  gpu_pytest "$out/mosaic_tests.log" 260 2 tests/test_groups_mosaic.py tests/test_mosaic_kernels.py
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/mosaic_tests.log"
  timeout 120 python3 benchmarks/probes/groups_timeline.py --modes none,mask --hlo 12 > "$out/timeline.log" 2>&1
  echo "timeline rc=$? at $((SECONDS - T0)) s"
  g "$(left 530)" --backends mosaic --families softmax --rounds 3 --modes "none,mask,positives,none again"
  rows
  ;;
ab)
  [ -n "${SKIP_TESTS:-}" ] || groups_tests 175 ""
  g "$(left 300)" --backends mosaic --families softmax --rounds 3 --modes "none,mask,positives,none again"
  g "$(left 440)" --backends mosaic --families sigmoid --rounds 3 --modes "none,mask inside,mask outside,positives,none again"
  g "$(left 570)" --backends pallas --families sigmoid --rounds 3 --modes "none,mask inside,mask outside,positives,none again"
  rows
  ;;
final)
  g "$(left 470)" --backends mosaic,triton,pallas --rounds 3
  rows
  gpu_pytest "$out/tests.log" "$(left 565)" 3 tests/test_groups_mosaic.py tests/test_groups_kernels.py tests/test_mosaic_kernels.py &
  gpu_pytest "$out/triton_tests.log" "$(left 565)" 1 -k "Groups and Gpu and sigmoid" tests/test_native_triton.py &
  wait
  gpu_summary "$out/tests.log" "$out/triton_tests.log"
  ;;
esac
