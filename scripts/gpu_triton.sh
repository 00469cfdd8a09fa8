#!/usr/bin/env bash
# One GPU job for the triton backend (one H200, < 9 min): its -m gpu tests
# (time-boxed), then bench_loss at B = 65,536, D = 768, bf16, fwd+bwd, both
# families, triton beside pallas and mosaic. Writes under ${OUT:-/tmp/out}:
#   tests.log       the full pytest output
#   failures.txt    the first failure of each test class in full, the rest
#                   one line each (printed too)
#   bench/          bench_loss.csv / _meta.json (the table is printed)
#
#   bash scripts/gpu_triton.sh [TEST_TIMEOUT_S] [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
py=${PYTHON:-python}
test_s=${1:-300}
shift || true
if ! "$py" -c "import jax_triton" 2>/dev/null; then
  "$py" -m pip install -q --no-deps .whl/jax_triton-*.whl || true
fi
"$py" -c "import jax, jaxlib, triton, jax_triton; print('jax', jax.__version__, 'triton', triton.__version__, 'jax_triton', jax_triton.__version__, jax.devices())"

# The module-level cases first (labels, vmap, the ring on this GPU, auto,
# no pallas.triton), then the contract classes (float64 agreement at
# B = 4096, odd 3001 x 2777 x 1000, one-way, +-100, NaN, B = 65536 vs xla).
: > "$out/tests.log"
run_part() {  # run_part SECONDS PYTEST_ARGS...
  local secs=$1 start=$SECONDS
  shift
  timeout -k 10 "$secs" "$py" -m pytest -q -p no:cacheprovider --tb=short \
    -rfE "$@" tests/test_native_triton.py >> "$out/tests.log" 2>&1
  echo "tests [$*]: exit $? in $((SECONDS - start)) s (box $secs s)" | tee -a "$out/tests.log"
}
# Unmarked: they run in the interpreter leg too, here compiled.
run_part $((test_s / 3)) -k "not TestTriton" "$@"
run_part $((test_s * 2 / 3)) -m gpu -k "TestTriton and not past_2_to_the_31" "$@"
"$py" - "$out/tests.log" "$out/failures.txt" <<'PY'
"""First failure of each test class in full, the others in one line."""
import re, sys
log = open(sys.argv[1]).read()
sections = re.split(r"\n_{3,} (\S+) _{3,}\n", log)
out, seen = [], set()
for name, body in zip(sections[1::2], sections[2::2]):
  cls = name.split(".")[0].split("[")[0]
  body = body.split("\n=====")[0]
  if cls in seen:
    last = [l for l in body.splitlines() if l.startswith("E ")][:2]
    out.append(f"--- {name}: " + " | ".join(l[2:].strip()[:300] for l in last))
  else:
    seen.add(cls)
    out.append(f"=== {name}\n{body[-6000:]}")
tail = [l for l in log.splitlines() if l.startswith(("tests [", "FAILED", "ERROR"))
        or re.match(r"\d+ (passed|failed)", l)]
text = "\n".join(out + ["", *tail])
open(sys.argv[2], "w").write(text)
print(text[-20000:])
PY

# BENCH_S=0: the tests only (a caller that times the backends itself).
if [ "${BENCH_S:-230}" -gt 0 ]; then
  start=$SECONDS
  timeout -k 10 "${BENCH_S:-230}" "$py" benchmarks/bench_loss.py \
    --out "$out/bench" --loss softmax,sigmoid --backends triton,pallas,mosaic \
    --dtypes bfloat16 --batches 65536 --budget-s 3 --timeout-s 110
  echo "bench: exit $? in $((SECONDS - start)) s"
fi
