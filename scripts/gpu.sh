#!/usr/bin/env bash
# The one GPU entry point: every measurement in BENCHMARKS.md and the -m gpu
# tests, by suite.
#
#   bash scripts/gpu.sh SUITE [PART...]        run (logs under $OUT, default /tmp/out)
#   bash scripts/gpu.sh --dry-run SUITE [PART...]   print the plan, run nothing
#   bash scripts/gpu.sh --list                 the suites and their parts
#   bash scripts/gpu.sh --prepare-ref [REF]    put REF's infcl_jax/ in .verify_ref/
#   bash scripts/gpu.sh --wheels               fill .whl/ (scripts/device-wheels.txt)
#
# After any change to the kernels, the backends or the loss math, run
# `verify` first (one device call, <= 540 s): the -m gpu exactness grid
# (every backend x dtype x mode, confident inputs), one trainer step with the
# GPU decoder, and the headline loss rows at 64k as an A/B against a
# reference commit in the same job (benchmarks/bench_ab.py). The reference
# is VERIFY_REF, else the last commit in scripts/verify-passed.txt; its
# infcl_jax/ travels in .verify_ref/ (git-ignored: carry it), which
# --prepare-ref writes here, where git is.
#
# SUITE is verify, tests, loss, towers, train, data, ring or all; PART picks some of a
# suite's parts (all of them by default), PART:SECONDS in a smaller box. Every part runs under its own time
# box (timeout -s INT, so that pytest and the benchmarks still write what
# they have), writes its logs to $OUT/SUITE-PART*.log, and ends with a
# one-paragraph summary of that log. A device call is limited to 10 minutes:
# --list gives each part's box, so that a call takes the parts that fit
# (e.g. `loss table stages`, then `loss groups`). ring needs two GPUs.
#
# Wheels the GPU image lacks (scripts/device-wheels.txt: the trainer's
# packages it does not have, nvImageCodec, jax-triton) travel in .whl/
# (git-ignored; carry it), made here by --wheels from PyPI (the GPU machine
# reaches no registry); they are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
case "${1:-}" in
--dry-run) dry=1; shift ;;
esac
out=${OUT:-/tmp/out}
py=${PYTHON:-python3}

# Suites and their parts, in order, one "name:box_s" a line.
suite_parts() {
  local parts
  case "$1" in
  # exact and step run side by side (nothing there is timed), then speed.
  verify) parts="exact:390 step:390 speed:140" ;;
  tests) parts="kernels:420 large:120 precision:400 decode:240 interpret:420" ;;
  loss) parts="table:420 stages:130 compare:120 profile:120 groups:575 configs:300 f32:240 sweep:560" ;;
  towers) parts="vit:240 text:280 lit:330" ;;
  train) parts="step:420 ladder:560 stream:300 knobs:580 stream1m:580 stream1m_gpu:580 l14:150 b32:580 b32_1m:580 b32_1m_gpu:580 precompute:400 b16_few:580 remat:580 stages:300" ;;
  data) parts="pipeline:200 bytes:200" ;;
  ring) parts="schedule:120 scaling:290 plain:130 maxbatch:320" ;;
  *) return 1 ;;
  esac
  printf '%s\n' $parts
}
SUITES="verify tests loss towers train data ring"

box_of() {  # box_of SUITE PART
  local p
  for p in $(suite_parts "$1"); do
    [ "${p%%:*}" = "$2" ] && { echo "${p##*:}"; return 0; }
  done
  return 1
}

# The reference commit of verify's A/B and its tree.
verify_ref() {
  if [ -n "${VERIFY_REF:-}" ]; then echo "$VERIFY_REF"; return; fi
  grep -vE '^\s*(#|$)' scripts/verify-passed.txt | tail -1 | cut -d' ' -f1
}
ref_dir=.verify_ref
prepare_ref() {  # prepare_ref REF: REF's infcl_jax/ into $ref_dir
  local ref=$1 sha
  sha=$(git rev-parse --verify -q "$ref^{commit}") || {
    echo "gpu.sh: cannot resolve the reference commit '$ref' (git fetch it, or name another with VERIFY_REF)" >&2
    return 2
  }
  rm -rf "$ref_dir" && mkdir -p "$ref_dir"
  git archive "$sha" infcl_jax | tar -x -C "$ref_dir"
  echo "$sha" > "$ref_dir/REF"
  echo "gpu.sh: $ref_dir holds infcl_jax/ of $sha ($(git log -1 --format='%cs %s' "$sha" | cut -c1-70))"
}
if [ "${1:-}" = "--wheels" ]; then
  # Python 3.12 on x86-64 Linux, as on the GPU machine. A package with no
  # wheel on PyPI (promise) is built into one here (pure Python).
  mkdir -p .whl
  plat=(--platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)
  for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
  for r in $(grep -vE '^\s*(#|$)' scripts/device-wheels.txt); do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --abi abi3 --abi none "${plat[@]}" -d .whl "$r" \
      2>/dev/null || "$py" -m pip wheel -q --no-deps -w .whl "$r" || exit 1
  done
  echo "gpu.sh: $(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
  exit 0
fi
if [ "${1:-}" = "--prepare-ref" ]; then
  prepare_ref "${2:-$(verify_ref)}"
  exit $?
fi

if [ "${1:-}" = "--list" ]; then
  for s in $SUITES; do
    total=0; line=""
    for p in $(suite_parts "$s"); do
      line+=" ${p%%:*} (${p##*:} s)"; total=$((total + ${p##*:}))
    done
    # verify runs exact and step side by side: its box is the larger plus speed.
    [ "$s" = verify ] && total="$(($(box_of verify exact) > $(box_of verify step) ? $(box_of verify exact) : $(box_of verify step))) + $(box_of verify speed) = $(( ($(box_of verify exact) > $(box_of verify step) ? $(box_of verify exact) : $(box_of verify step)) + $(box_of verify speed)))"
    echo "$s:$line; $total s in all"
  done
  exit 0
fi

suite=${1:?usage: bash scripts/gpu.sh [--dry-run] SUITE [PART...]; --list for the suites}
shift
if [ "$suite" != all ] && ! suite_parts "$suite" > /dev/null; then
  echo "gpu.sh: unknown suite '$suite' (one of: $SUITES all)" >&2
  exit 2
fi
for p in "$@"; do
  if [ "$suite" = all ] || ! box_of "$suite" "${p%%:*}" > /dev/null \
     || { [ "$p" != "${p%%:*}" ] && ! [[ "${p##*:}" =~ ^[0-9]+$ ]]; }; then
    echo "gpu.sh: suite '$suite' has no part '$p' (bash scripts/gpu.sh --list)" >&2
    exit 2
  fi
done

# job NAME BOX CMD...: CMD under its box, its output in $out/NAME.log, its
# exit status appended to $rcs (jobs may run in the background).
rcs=$out/gpu_sh.rc
job() {
  local name=$1 box=$2 start rc
  shift 2
  if [ "$dry" = 1 ]; then
    echo "$name [${box} s]: $*"
    return 0
  fi
  start=$SECONDS
  timeout -s INT -k 15 "$box" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name $rc" >> "$rcs"
  summary "$name" "$rc" $((SECONDS - start)) "$box"
}
# One paragraph per log: exit status and time; for pytest the counts and the
# first failures, for a benchmark its last lines (each prints its table last).
summary() {
  local name=$1 rc=$2 secs=$3 box=$4 log=$out/$1.log note=""
  [ "$rc" -eq 124 ] && note=" (cut by its box)"
  echo "== $name: exit $rc$note, $secs of $box s, log $log"
  if grep -qE "^=+ .* in [0-9.]+s( \(.*\))? =+$" "$log"; then
    # Of how many: a run cut by its box still prints a passing summary line.
    local items
    items=$(grep -m1 -oE '(collected|[0-9]+ workers? \[)[ ]?[0-9]+ items' "$log" | grep -oE '[0-9]+ items')
    echo "   $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed," \
      "$(grep -c ' SKIPPED' "$log") skipped, of ${items:-? items}: $(tail -1 "$log")"
    grep -E "^(FAILED|ERROR) " "$log" | cut -c1-200 | head -15 | sed 's/^/   /'
    # The reasons, as they were written (gpu_pytest's NAME.failures).
    [ -s "$out/$name.failures" ] && grep -E "^(====|E )" "$out/$name.failures" \
      | cut -c1-240 | head -40 | sed 's/^/   /'
  else
    tail -n "${SUMMARY_LINES:-25}" "$log" | cut -c1-200 | sed 's/^/   /'
  fi
}
# pytest -m "${mark:-gpu}", every test's line kept (-v) and its failures
# summarised.
gpu_pytest() {  # [mark=MARKER] gpu_pytest NAME BOX WORKERS PYTEST_ARGS...
  local name=$1 box=$2 workers=$3
  shift 3
  # Each failure's reason goes to NAME.failures as it happens (a run cut by
  # its box prints no summary); the slowest tests close the log.
  # The float64 references are numpy BLAS calls: each worker gets its share
  # of the cores (16 threads in each of 6 workers thrash).
  local threads=$(( $(nproc) / (workers > 0 ? workers : 1) ))
  [ "$threads" -lt 1 ] && threads=1
  OPENBLAS_NUM_THREADS=$threads OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads \
  INFCL_FAILURES="$out/$name.failures" XLA_PYTHON_CLIENT_PREALLOCATE=false \
    job "$name" "$box" "$py" -m pytest -m "${mark:-gpu}" \
    -v -rfE -p no:cacheprovider --tb=short --durations=15 -n "$workers" "$@"
}
bench() { job "$1" "$2" env PYTHONUNBUFFERED=1 "$py" "${@:3}"; }

# ------------------------------------------------------------------ suites
# Every command below is the one behind a BENCHMARKS.md row ("bash
# scripts/gpu.sh SUITE PART").

tests_kernels() {
  # Three pytest processes side by side (nothing is timed): the Mosaic
  # kernels and backend, the Pallas ones and the groups, the triton backend
  # (two workers: on one, its Triton compiles took 57 of its 64 tests to
  # the box).
  # The > 2^31-element cases need the GPU's memory alone: part "large".
  local k="not past_2_to_the_31" bg="&"
  [ "$dry" = 1 ] && bg=""
  eval "gpu_pytest tests-mosaic \"\$1\" 2 -k \"\$k\" tests/test_mosaic_kernels.py \
    tests/test_mosaic_backend.py tests/test_groups_mosaic.py tests/test_confident.py $bg"
  eval "gpu_pytest tests-pallas \"\$1\" 2 -k \"\$k\" tests/test_pallas.py tests/test_pallas_sigmoid.py \
    tests/test_groups.py tests/test_groups_kernels.py tests/test_auto.py tests/test_x64.py $bg"
  eval "gpu_pytest tests-triton \"\$1\" 2 -k \"\$k\" tests/test_native_triton.py \
    tests/test_triton_aot.py tests/test_triton_backend_host.py $bg"
  wait
}
tests_large() {
  gpu_pytest tests-large "$1" 0 -k past_2_to_the_31 tests/test_mosaic_backend.py \
    tests/test_native_triton.py tests/test_pallas.py tests/test_pallas_sigmoid.py
}
tests_precision() {
  # float32 inputs against float64 on every backend (72 cases, each a
  # 2-3k square loss and its gradients); apart from "kernels", whose box
  # it does not fit beside.
  gpu_pytest tests-precision "$1" 2 tests/test_precision.py
}
tests_decode() {
  # nvImageCodec on the device against the host decoder (needs the
  # [train] and [gpu-decode] wheels the image lacks in .whl/): pixels, bad
  # members, resume, the loss.
  gpu_pytest tests-decode "$1" 0 tests/test_gpu_decode.py tests/test_gpu_decode_resize.py
}
tests_interpret() {
  # The interpreter cases that CPU runs deselect (tests/interpret_tests.txt:
  # beyond one per kernel and shape class); CPU-bound, so many workers.
  mark=interpret gpu_pytest tests-interpret "$1" 12 \
    $(grep -v '^#' tests/interpret_tests.txt | cut -d: -f1 | sort -u)
}

loss_table() {
  # bench_loss: one process per case, resumed across calls under one bf16
  # matmul ceiling. The kernel backends at 65,536, the dtypes, then Mosaic
  # and triton at 16,384 and 50,000, and Mosaic at 1M.
  local b=(bench_loss.py --out "$out/loss" --budget-s 2 --timeout-s 100 --resume)
  local box=$1
  bench loss-table-65k $((box * 25 / 100)) benchmarks/"${b[@]}" --loss softmax,sigmoid \
    --backends mosaic,triton,pallas --dtypes bfloat16 --batches 65536
  bench loss-table-dtypes $((box * 15 / 100)) benchmarks/"${b[@]}" --loss softmax \
    --backends mosaic,triton --dtypes float32,float16 --batches 65536
  # 50,000: an odd B (not a tile multiple) against the aligned rate.
  bench loss-table-sizes $((box * 25 / 100)) benchmarks/"${b[@]}" --loss softmax,sigmoid \
    --backends mosaic,triton --dtypes bfloat16 --batches 16384,50000
  bench loss-table-1m $((box * 35 / 100)) benchmarks/"${b[@]}" --loss softmax \
    --backends mosaic --dtypes bfloat16 --batches 1048576
}
loss_stages() {
  bench loss-stages-bf16 $(($1 / 2)) benchmarks/bench_mosaic.py --b 65536 --r_list 4096
  bench loss-stages-f32 $(($1 / 2)) benchmarks/bench_mosaic.py --b 65536 --dtype float32 \
    --r_list 4096
}
loss_compare() {
  # Whole steps in one process: bf16, and float32's float16 panels beside
  # float32 ones.
  bench loss-compare "$1" benchmarks/bench_mosaic.py --compare --b 65536
}
loss_profile() {
  bench loss-profile "$1" benchmarks/bench_mosaic.py --profile --b 65536
}
loss_groups() {
  # One GEMM autotuning shared by every variant: they then differ by their
  # groups work only ("none again", the plain loss compiled twice, is the
  # noise floor).
  XLA_FLAGS="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune_groups" \
    bench loss-groups "$1" benchmarks/bench_groups.py --backends mosaic,triton,pallas --rounds 5
}
loss_configs() {
  bench loss-configs "$1" benchmarks/bench_configs.py --smem_probe --out "$out/configs"
}
loss_f32() {
  bench loss-f32 "$1" benchmarks/bench_f32.py
}
loss_sweep() {
  # Time and memory against B: the full-matrix definition, the XLA tiles and
  # the Pallas kernels, 16k to 1M.
  bench loss-sweep "$1" benchmarks/bench_loss.py --out "$out/sweep" --loss softmax,sigmoid \
    --backends reference,xla,pallas --dtypes bfloat16 --batches 16384,65536,262144,1048576 \
    --budget-s 2 --timeout-s 150
}

towers_vit() {
  bench towers-vit "$1" benchmarks/bench_towers.py --out "$out/towers-vit" --cases vit,vit_torch,vit_p16 \
    --budget_s $(($1 - 10))
}
towers_text() {
  bench towers-text "$1" benchmarks/bench_towers.py --out "$out/towers-text" \
    --cases text_jax_eos,text_torch --budget_s $(($1 - 10))
}
towers_lit() {
  bench towers-lit "$1" benchmarks/bench_towers.py --out "$out/towers-lit" \
    --cases lit_hf_precomputed,lit_hf_on_the_fly --budget_s $(($1 - 10))
}

train_step() {
  # The step at 65,536 (precomputed, tower on the fly) and 262,144.
  bench train-step "$1" benchmarks/bench_train.py --out "$out/train-step" --ladder 262144 \
    --timeout_s 200 --budget_s $(($1 - 10))
}
train_ladder() {
  bench train-ladder "$1" benchmarks/bench_train.py --out "$out/train-ladder" --step_batches "" \
    --ladder 1048576,4194304 --timeout_s 470 --budget_s $(($1 - 10))
}
train_stream() {
  # The streamed step with the JPEG decoder as a column (host: pixels from
  # the worker processes; gpu: their JPEG bytes, nvImageCodec on the
  # device), at 65,536 ...
  bench train-stream "$1" benchmarks/bench_train.py --out "$out/train-stream" --step_batches "" \
    --ladder "" --stream_batches 65536 --stream_steps 1 --decode_size 256 --workers 12 \
    --decoders gpu,host --timeout_s 140 --budget_s $(($1 - 10))
}
train_knobs() {
  # The GPU decoder's settings at 65,536, one case each (bench_train.py
  # --gpu_variants): fewer workers leave cores to nvImageCodec, whose CUDA
  # decoder does small JPEGs' Huffman stage on CPU threads unless the
  # threshold moves it to the GPU; "hw" uses the JPEG engines alone.
  bench train-knobs "$1" benchmarks/bench_train.py --out "$out/train-knobs" --step_batches "" \
    --ladder "" --stream_batches 65536 --stream_steps 1 --decode_size 256 --workers 12 \
    --decoders gpu --gpu_variants "${GPU_VARIANTS:-workers=4;workers=4 option=nvjpeg_cuda_decoder:hybrid_huffman_threshold=0;workers=4 backend=hw;workers=8 cpu_threads=6}" \
    --timeout_s 140 --budget_s $(($1 - 10))
}
train_stream1m() {
  # ... and at 1,048,576 (~75 s of set-up beside the step), one decoder a
  # part: the host's took 276 s in all on 2026-12-04, the gpu's > 330. A
  # line every 10 s of the step says how far it got; --resume: a rerun of
  # a part that was cut runs only what is missing. MICROBATCH (default
  # auto: train/memory.py sizes it), REMAT and LOSS_DTYPE (bench_train.py
  # --remat, --loss_dtype) pick the text tower's settings.
  bench train-stream-1m "$1" benchmarks/bench_train.py --out "$out/train-stream-1m" --step_batches "" \
    --ladder "" --stream_batches 1048576 --stream_steps 1 --decode_size 256 --workers 12 \
    --decoders host --microbatch "${MICROBATCH:-auto}" --remat "${REMAT:-none}" \
    --loss_dtype "${LOSS_DTYPE:-}" --resume --timeout_s $(($1 - 10))
}
train_stream1m_gpu() {
  bench train-stream-1m-gpu "$1" benchmarks/bench_train.py --out "$out/train-stream-1m-gpu" --step_batches "" \
    --ladder "" --stream_batches 1048576 --stream_steps 1 --decode_size 256 --workers 12 \
    --decoders gpu --gpu_variants "${GPU_VARIANTS:-}" --microbatch "${MICROBATCH:-auto}" \
    --remat "${REMAT:-none}" --loss_dtype "${LOSS_DTYPE:-}" --resume --timeout_s $(($1 - 10))
}
train_l14() {
  bench train-l14 "$1" benchmarks/bench_train.py --out "$out/train-l14" --step_batches "" --ladder "" \
    --stream_batches 65536 --microbatch 4096 --stream_steps 1 --decode_size 256 --workers 12 \
    --image_model l14 --timeout_s $(($1 - 10))
}

train_b32() {
  # ViT-B/32 (~4x B/16's rate: more than the host path can feed) streamed
  # at 65,536: the host path with 12 workers (first) against the GPU
  # decoder's variants, 4 workers each (its host side only reads), one each:
  # nvImageCodec decoders per GPU on their threads (threads=N), the chunks
  # taken out of the workers on a thread of their own (read_ahead=N), fewer
  # of nvImageCodec's own CPU threads per decoder (~90-110 s a case).
  bench train-b32 "$1" benchmarks/bench_train.py --out "$out/train-b32" --step_batches "" \
    --ladder "" --stream_batches 65536 --stream_steps 1 --decode_size 256 --workers 12 \
    --image_model b32 --decoders host,gpu \
    --gpu_variants "${GPU_VARIANTS:-workers=4;workers=4 threads=4;workers=4 threads=4 read_ahead=32;workers=4 threads=8 read_ahead=32 cpu_threads=2}" \
    --timeout_s 120 --budget_s $(($1 - 10))
}
train_b32_1m() {
  # ViT-B/32 streamed at 1,048,576, the host path (12 workers) ... (the
  # settings of part stream1m: MICROBATCH, REMAT, LOSS_DTYPE; --resume)
  bench train-b32-1m "$1" benchmarks/bench_train.py --out "$out/train-b32-1m" --step_batches "" \
    --ladder "" --stream_batches 1048576 --stream_steps 1 --decode_size 256 --workers 12 \
    --image_model b32 --decoders host --microbatch "${MICROBATCH:-auto}" --remat "${REMAT:-none}" \
    --loss_dtype "${LOSS_DTYPE:-}" --resume --timeout_s $(($1 - 10))
}
train_b32_1m_gpu() {
  # ... and the GPU decoder (GPU_VARIANTS: the best of part b32).
  bench train-b32-1m-gpu "$1" benchmarks/bench_train.py --out "$out/train-b32-1m-gpu" \
    --step_batches "" --ladder "" --stream_batches 1048576 --stream_steps 1 --decode_size 256 \
    --workers 12 --image_model b32 --decoders gpu \
    --gpu_variants "${GPU_VARIANTS:-workers=4 threads=4 read_ahead=32}" \
    --microbatch "${MICROBATCH:-auto}" --remat "${REMAT:-none}" --loss_dtype "${LOSS_DTYPE:-}" \
    --resume --timeout_s $(($1 - 10))
}
train_precompute() {
  # train.precompute (a shard set embedded once) with ViT-B/32: 65,536
  # JPEGs, 8192 a call; the host decoder in 12 reader threads against the
  # GPU decoder (its threads only read).
  bench train-precompute "$1" benchmarks/bench_train.py --out "$out/train-precompute" \
    --step_batches "" --ladder "" --precompute_images 65536 --decode_size 256 --workers 12 \
    --image_model b32 --decoders host,gpu --gpu_variants "${GPU_VARIANTS:-workers=4 threads=4}" \
    --timeout_s 180 --budget_s $(($1 - 10))
}
train_b16_few() {
  # ViT-B/16 at 65,536 with at most 4 host workers (few cores per GPU): the
  # GPU decoder against the host path with the same 4. JAX grows its
  # memory on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false, as a shared GPU
  # and the -m gpu tests run; at micro-batch 8192 the step ran out of
  # memory there on an 80 GB H100): the micro-batch is "auto" (MICROBATCH,
  # REMAT: see part stream1m; DECODERS=gpu for the GPU decoder alone).
  job train-b16-few "$1" env XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 "$py" \
    benchmarks/bench_train.py --out "$out/train-b16-few" --step_batches "" \
    --ladder "" --stream_batches 65536 --stream_steps 1 --decode_size 256 --workers 4 \
    --decoders "${DECODERS:-host,gpu}" --gpu_variants "${GPU_VARIANTS:-threads=4 read_ahead=32}" \
    --microbatch "${MICROBATCH:-auto}" --remat "${REMAT:-none}" --resume \
    --timeout_s 250 --budget_s $(($1 - 10))
}
train_remat() {
  # The text tower's memory against its time, at 65,536 on precomputed
  # embeddings (the streamed step's text tower and loss, without the
  # images), memory grown on demand: micro-batch 8192 with each text
  # block's activations kept (none), recomputed in the backward (block) or
  # only its matmul outputs kept (dots); then 4096 and 2048 keeping them.
  # The rows' step_s and xla_total_gb choose config.model.text.remat and
  # the micro-batch.
  local b=(env XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 "$py"
    benchmarks/bench_train.py --out "$out/train-remat" --step_batches 65536 --ladder ""
    --modes precomputed --reps 3 --timeout_s 150 --resume)
  job train-remat-8192 $(($1 * 55 / 100)) "${b[@]}" --microbatch 8192 --remat none,block,dots \
    --budget_s $(($1 * 55 / 100 - 10))
  job train-remat-smaller $(($1 * 45 / 100)) "${b[@]}" --microbatch 4096,2048 --remat none \
    --budget_s $(($1 * 45 / 100 - 10))
}
train_stages() {
  # Where the device-alone embedding of a streamed micro-batch goes (8192
  # uint8 images at 256 px): the transfer, the resize to 224, the
  # normalisation and the tower each alone, the fused embedding on the
  # device, from the host, two in flight, and at 224 px (no resize);
  # ViT-B/32, then ViT-B/16.
  bench train-stages-b32 $(($1 / 2)) benchmarks/bench_train.py --out "$out/train-stages" --step_batches "" \
    --ladder "" --stages --microbatch 8192 --decode_size 256 --image_model b32 --reps 5 \
    --resume --timeout_s $(($1 / 2 - 10))
  bench train-stages-b16 $(($1 / 2)) benchmarks/bench_train.py --out "$out/train-stages" --step_batches "" \
    --ladder "" --stages --microbatch 8192 --decode_size 256 --image_model b16 --reps 5 \
    --resume --timeout_s $(($1 / 2 - 10))
}

data_pipeline() {
  bench data-pipeline "$1" benchmarks/bench_data.py --out "$out/data" --threads 8 \
    --workers 12,16 --measure_s 8 --timeout_s 40
}
data_bytes() {
  # decoder="gpu"'s host side alone: reading, the JPEG check, tokens.
  bench data-bytes "$1" benchmarks/bench_data.py --out "$out/data_bytes" --bytes_only \
    --threads 1,4 --workers 4,8,12 --measure_s 8 --timeout_s 40
}

ring_schedule() {
  gpu_pytest ring-schedule "$1" 0 tests/test_ring_hlo.py tests/test_bench_ring.py
}
ring_scaling() {
  bench ring-scaling "$1" benchmarks/bench_ring.py --out "$out/ring" --budget-s 2 \
    --strategies ring,gather --sections scaling,overlap,hlo --time-budget-s $(($1 - 20)) \
    --timeout-s 90
}
ring_plain() {
  # The B x B baseline's plan is ~138 GB per GPU: an arena preallocated up
  # front, not grown on demand.
  XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
    bench ring-plain "$1" benchmarks/bench_ring.py --out "$out/ring_plain" --budget-s 2 \
    --strategies plain --b-local 65536 --devices 2 --sections scaling \
    --time-budget-s $(($1 - 10)) --timeout-s 100
}
ring_maxbatch() {
  bench ring-maxbatch "$1" benchmarks/bench_ring.py --out "$out/ring" --resume --sections maxbatch \
    --max-b-start 2097152 --max-b-local 2097152 --max-step-s 0 --max-once-s 300
}

verify_exact() {
  # Every backend x dtype x mode at the GPU's default tiles, confident
  # inputs included (tests/test_gpu_verify.py).
  # With labels= or a pair of id arrays, tests/test_exact_groups.py's
  # kernel cases (triton's in test_native_triton.py).
  gpu_pytest verify-exact "$1" 6 tests/test_gpu_verify.py tests/test_exact_groups.py \
    tests/test_native_triton.py::TestTritonExactGroups
}
verify_step() {
  # One trainer step end to end with decoder="gpu" (nvImageCodec, in
  # .whl/), its loss against the host decoder's.
  gpu_pytest verify-step "$1" 0 tests/test_gpu_decode.py \
    -k test_step_one_loss_is_the_host_paths_within_bf16
}
verify_speed() {
  # The headline loss rows at 64k, A (this checkout) against B (the
  # reference), interleaved A B A B in one job; > 3% slower fails.
  local ref sha
  ref=$(verify_ref)
  sha=$(cat "$ref_dir/REF" 2>/dev/null)
  if [ "$dry" = 1 ]; then
    echo "verify-speed A/B: A = this checkout ($(git rev-parse --short HEAD 2>/dev/null || echo '?')$( \
      [ -n "$(git status --porcelain -- infcl_jax 2>/dev/null)" ] && echo ' + uncommitted infcl_jax/')), B = $ref ($( \
      [ -n "$sha" ] && echo "$ref_dir/ holds ${sha:0:12}" || echo "$ref_dir/ missing: bash scripts/gpu.sh --prepare-ref $ref")); order A B A B, ${VERIFY_ROUNDS:-2} rounds x 5 calls a side, medians, > 3% slower fails"
  elif [ -z "$sha" ] || [ "${sha:0:7}" != "${ref:0:7}" ]; then
    prepare_ref "$ref" > /dev/null 2>&1 || {
      echo "verify-speed 2" >> "$rcs"
      echo "== verify-speed: exit 2: no reference tree for $ref ($ref_dir/REF: ${sha:-none}); run bash scripts/gpu.sh --prepare-ref $ref here and carry $ref_dir"
      return
    }
  fi
  bench verify-speed "$1" benchmarks/bench_ab.py --ref-tree "$ref_dir" --ref-name "$ref" \
    --rounds "${VERIFY_ROUNDS:-2}" --calls 5 --out "$out/verify" \
    --cases "${VERIFY_CASES:-softmax:bfloat16:65536,sigmoid:bfloat16:65536,softmax:float32:65536,sigmoid:float32:65536}"
}
# verify's parts: exact and step side by side, then speed alone.
run_verify() {
  local bg="&"
  [ "$dry" = 1 ] && bg=""
  eval "verify_exact $(box_of verify exact) $bg"
  eval "verify_step $(box_of verify step) $bg"
  wait
  verify_speed "$(box_of verify speed)"
  [ "$dry" = 1 ] && return
  echo
  echo "== verify: $(cat "$ref_dir/REF" 2>/dev/null | cut -c1-12) as the A/B reference"
  printf '%-14s %-6s %s\n' part result "details"
  local name rc detail
  while read -r name rc; do
    detail=$(grep -m1 -E '^=+ .* in [0-9.]+s' "$out/$name.log" 2>/dev/null | tr -d '=' | sed 's/^ *//')
    [ "$name" = verify-speed ] && detail=$(grep -cE ' (ok|SLOWER)$' "$out/$name.log" 2>/dev/null | sed 's/$/ A\/B rows/')
    printf '%-14s %-6s %s\n' "$name" "$([ "$rc" = 0 ] && echo pass || echo FAIL)" "$detail"
  done < "$rcs"
  [ -f "$out/verify-speed.log" ] && sed -n '/^case /,$p' "$out/verify-speed.log"
}

# ------------------------------------------------------------------- main

if [ "$dry" = 1 ]; then
  echo "plan (dry run): logs under $out"
else
  mkdir -p "$out"
  : > "$rcs"
  # Installed once per machine: a second gpu.sh beside a running one (two
  # suites side by side) must not rewrite the modules the first imports.
  if compgen -G ".whl/*.whl" > /dev/null; then
    stamp=$(cd .whl && ls -l -- *.whl | md5sum)
    if [ "$(cat /tmp/site/.whl-stamp 2>/dev/null)" != "$stamp" ]; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
      echo "$stamp" > /tmp/site/.whl-stamp
    fi
  fi
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  [ "$dry" = 1 ] && echo "install [.whl]: $(ls .whl/*.whl | wc -l) wheels to /tmp/site"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
[ "$dry" = 1 ] || "$py" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1

run_suite() {  # run_suite SUITE [PART...]
  local s=$1 p
  shift
  if [ "$s" = verify ] && [ $# -eq 0 ]; then
    run_verify
    return
  fi
  local parts=("$@")
  if [ ${#parts[@]} -eq 0 ]; then
    for p in $(suite_parts "$s"); do parts+=("${p%%:*}"); done
  fi
  # PART:SECONDS runs a part in a smaller box than its own (to fit what is
  # left of a device call); the box never grows.
  local box
  for p in "${parts[@]}"; do
    box=$(box_of "$s" "${p%%:*}")
    [ "$p" != "${p%%:*}" ] && [ "${p##*:}" -lt "$box" ] && box=${p##*:}
    "${s}_${p%%:*}" "$box"
  done
}
if [ "$suite" = all ]; then
  for s in $SUITES; do run_suite "$s"; done
else
  run_suite "$suite" "$@"
fi
[ "$dry" = 1 ] && exit 0
echo "== gpu.sh $suite: $(awk '$2 != 0' "$rcs" | wc -l) of $(wc -l < "$rcs") jobs failed or were cut"
! awk '$2 != 0 {bad = 1} END {exit !bad}' "$rcs"
