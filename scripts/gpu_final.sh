#!/usr/bin/env bash
# The H200 jobs of the session that closes issues 20, 25 and 26, one per
# device call (each < 9.5 min):
#   groups: the -m gpu tests of the kernel that changed (Mosaic sigmoid
#           "mask"), then bench_groups (three interleaved rounds per row)
#   table:  issue 25's table in one bench_loss run (one ceiling, one case per
#           process), the per-stage times (bench_mosaic) at 65,536 in bf16
#           and float32; then the ViT-B/16 forward, ours (last block pruned
#           and not) beside timm eager and compiled
#   text_lit: the CLIP text tower fwd+bwd, ours (pruned and not) beside HF
#           eager and compiled; the LiT step with the HF CLIP tower on the fly
#   rerun:  the two groups rows whose kernels changed after "groups"
#   OUT=... bash scripts/gpu_final.sh JOB
set -u
cd "$(dirname "$0")/.."
. scripts/gpu_lib.sh
out=${OUT:-/tmp/out}; mkdir -p "$out"
T0=$SECONDS
left() { echo $(( $1 - (SECONDS - T0) )); }
case "${1:?job: groups, table, text_lit or rerun}" in
groups)
  # After the Pallas / Triton sigmoid "mask" change (its tests passed in the
  # first groups job), the Mosaic sigmoid's: its groups tests.
  gpu_pytest "$out/gpu_tests.log" 110 3 -k "sigmoid" tests/test_groups_mosaic.py
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/gpu_tests.log"
  # One autotuning of each GEMM for every compile of the job: the variants
  # then differ by their groups work only.
  XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune_groups" \
    timeout -k 10 "$(left 540)" python3 benchmarks/bench_groups.py --backends mosaic,triton,pallas \
    --rounds 3 > "$out/bench_groups.log" 2>&1
  echo "== bench_groups rc=$? at $((SECONDS - T0)) s"
  sed -n '/SUMMARY/,$p' "$out/bench_groups.log"
  ;;
table)
  # Issue 25's table, then the ViT-B/16 forward beside timm (issue 20).
  b() { timeout -k 10 "$1" python3 benchmarks/bench_loss.py --out "$out/bench" --budget-s 2 \
          --timeout-s 100 --resume "${@:2}" >> "$out/bench.log" 2>&1
        echo "bench ${*:2} rc=$? at $((SECONDS - T0)) s"; }
  b 80 --loss softmax,sigmoid --backends mosaic --dtypes bfloat16 --batches 65536
  b 70 --loss softmax --backends mosaic --dtypes float32,float16 --batches 65536
  b 60 --loss softmax,sigmoid --backends mosaic --dtypes bfloat16 --batches 16384,50000
  b 110 --loss softmax --backends mosaic --dtypes bfloat16 --batches 1048576
  grep -B2 -A30 "bf16 matmul ceiling" "$out/bench.log" | tail -24
  st() { timeout -k 10 "$2" python3 benchmarks/bench_mosaic.py --full 0 "${@:3}" > "$out/stages_$1.log" 2>&1
         echo "stages $1 rc=$? at $((SECONDS - T0)) s"; cat "$out/stages_$1.log"; }
  st 65536 60 --b 65536 --r_list 4096
  st 65536_f32 60 --b 65536 --dtype float32 --r_list 4096
  timeout -k 10 "$(left 470)" python3 benchmarks/bench_towers.py --out "$out/towers" \
    --cases vit_ab,vit_torch --budget_s "$(left 460)" > "$out/towers.log" 2>&1
  echo "== towers rc=$? at $((SECONDS - T0)) s"
  tail -16 "$out/towers.log"
  ;;
text_lit)
  # The CLIP text tower fwd+bwd beside HF, then the LiT step with the HF
  # CLIP tower on the fly (issue 20).
  timeout -k 10 "$(left 415)" python3 benchmarks/bench_towers.py --out "$out/towers" \
    --cases text_jax_eos,text_torch,lit_hf_on_the_fly \
    --budget_s "$(left 405)" > "$out/towers.log" 2>&1
  echo "== towers rc=$? at $((SECONDS - T0)) s"
  tail -24 "$out/towers.log"
  ;;
rerun)
  # After the Mosaic softmax panel and the Triton sigmoid backward took the
  # -inf logit for related pairs: their groups tests, then their two rows.
  gpu_pytest "$out/mosaic_tests.log" 45 3 -k "softmax" tests/test_groups_mosaic.py &
  gpu_pytest "$out/triton_tests.log" 45 2 -k "Groups and Gpu and sigmoid" tests/test_native_triton.py &
  wait
  echo "== tests done at $((SECONDS - T0)) s"
  gpu_summary "$out/mosaic_tests.log" "$out/triton_tests.log"
  g() { XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune_groups" \
          timeout -k 5 "$1" python3 benchmarks/bench_groups.py --rounds 3 --modes "none,mask,none again" \
          "${@:2}" >> "$out/bench_groups.log" 2>&1; echo "bench_groups ${*:2} rc=$? at $((SECONDS - T0)) s"; }
  g "$(left 97)" --backends mosaic --families softmax
  g "$(left 147)" --backends triton --families sigmoid
  grep "^check\|^time\|^cost" "$out/bench_groups.log"
  ;;
esac
