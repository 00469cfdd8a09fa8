#!/usr/bin/env bash
# The GPU check of the refactor (issue 23) in one command on one H200:
#   1. `pytest -m gpu` on the files that exercise the kernels, one summary
#      line per file (passed / failed / errors / skipped / not reached);
#   2. benchmarks/bench_loss.py (softmax and sigmoid) on the pre-refactor
#      library and on this tree's, alternated (base, new, base, new, ...),
#      with a comparison table.
#
#   bash scripts/gpu_check_23.sh BASE_TREE [all|tests|bench]
#
# BASE_TREE: a checkout of the pre-refactor commit (its infcl_jax/ is what
# counts). Both libraries are timed by this tree's bench_loss.py and
# harness.py (copied beside each library under a temporary root), so the
# two runs differ only in infcl_jax/.
#
# Everything is written to $OUT (default ./gpu_check_out): gpu_tests.log,
# gpu_tests_summary.txt, bench/<tree>_<round>/ (bench_loss's CSV, JSON and
# log) and bench_compare.txt. Each part has its own time box; the whole
# stays below TOTAL_S (default 520 s); what was not reached is said.
#
# Knobs (environment): TOTAL_S, BENCH_RESERVE_S (time kept for the bench
# when both parts run, default 170), BENCH_ROUNDS (default 2),
# BENCH_ARGS (default: --quick --backends mosaic --loss softmax,sigmoid
# --budget-s 1.5), TEST_WORKERS (pytest-xdist workers sharing the GPU,
# default 4 when xdist is installed; 0 = one process), TEST_FILES,
# TEST_MARK (default gpu; "not gpu" smoke-tests this script on a CPU), PY.
set -u

BASE=${1:?usage: gpu_check_23.sh BASE_TREE [all|tests|bench]}
PARTS=${2:-all}
PY=${PY:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
TOTAL_S=${TOTAL_S:-520}
BENCH_RESERVE_S=${BENCH_RESERVE_S:-170}
BENCH_ROUNDS=${BENCH_ROUNDS:-2}
BENCH_ARGS=${BENCH_ARGS:---quick --backends mosaic --loss softmax,sigmoid --budget-s 1.5}
TEST_MARK=${TEST_MARK:-gpu}
TEST_FILES=${TEST_FILES:-tests/test_mosaic_kernels.py tests/test_pallas_sigmoid.py tests/test_pallas.py tests/test_mosaic_backend.py tests/test_auto.py}
NEW=$PWD
T0=$(date +%s)

case $PARTS in all|tests|bench) ;; *)
  echo "gpu_check_23.sh: the second argument must be all, tests or bench, got '$PARTS'" >&2
  exit 2 ;;
esac
if [ ! -f "$BASE/infcl_jax/__init__.py" ]; then
  echo "gpu_check_23.sh: BASE_TREE '$BASE' has no infcl_jax/__init__.py" >&2
  exit 2
fi
BASE=$(cd "$BASE" && pwd)
mkdir -p "$OUT"

left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }

lib_hash() {  # The library's sources, to tell the trees apart in the log.
  (cd "$1" && find infcl_jax -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)
}

echo "== gpu_check_23: new tree $NEW (infcl_jax $(lib_hash "$NEW")), base $BASE (infcl_jax $(lib_hash "$BASE"))"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/== GPU: /'
"$PY" -c "import jax; print('== jax', jax.__version__, jax.devices())" 2>&1 | tail -1

# ------------------------------------------------------------------ tests
run_tests() {
  local box=$1 files=$TEST_FILES
  local ngpu
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "${ngpu:-0}" -ge 2 ]; then
    files="$files tests/test_ring_hlo.py"
  else
    echo "== tests/test_ring_hlo.py left out: its GPU tests need 2 GPUs (${ngpu:-0} here)"
  fi
  local workers=${TEST_WORKERS:-}
  if [ -z "$workers" ]; then
    if "$PY" -c "import xdist" 2>/dev/null; then workers=4; else workers=0; fi
  fi
  local par=()
  [ "$workers" -gt 0 ] && par=(-n "$workers" --dist load)
  echo "== tests: $files (time box ${box}s, xdist workers: $workers)"
  # One JAX client per worker on the same GPU: no preallocation.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  local t=$(date +%s)
  timeout 60 "$PY" -m pytest --collect-only -q -m "$TEST_MARK" -p no:cacheprovider $files \
    > "$OUT/gpu_tests_collected.txt" 2>&1
  box=$(( box - ($(date +%s) - t) ))
  [ "$box" -lt 30 ] && box=30
  t=$(date +%s)
  timeout -s INT -k 20 "$box" "$PY" -m pytest -m "$TEST_MARK" -v -rfEs -p no:cacheprovider \
    "${par[@]}" $files > "$OUT/gpu_tests.log" 2>&1
  local rc=$?
  echo "== pytest rc=$rc after $(( $(date +%s) - t ))s$([ $rc -eq 124 ] || [ $rc -eq 130 ] && echo ' (time box reached)')"
  "$PY" - "$OUT/gpu_tests_collected.txt" "$OUT/gpu_tests.log" $files <<'EOF' | tee "$OUT/gpu_tests_summary.txt"
import collections, re, sys
collected_path, log_path, files = sys.argv[1], sys.argv[2], sys.argv[3:]
node = re.compile(r"(tests/[\w/]+\.py)::(\S+)")
word = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
collected = collections.defaultdict(set)
for line in open(collected_path, errors="replace"):
  m = node.match(line.strip())
  if m:
    collected[m.group(1)].add(m.group(0))
status = {}
for line in open(log_path, errors="replace"):
  m, w = node.search(line), word.search(line)
  if m and w:
    old = status.get(m.group(0))
    # A teardown ERROR after PASSED, or a FAILED in the short summary, wins.
    if old is None or w.group(1) in ("FAILED", "ERROR"):
      status[m.group(0)] = w.group(1)
ok_all = True
for f in files:
  got = collections.Counter(s for n, s in status.items() if n.startswith(f + "::"))
  want = len(collected.get(f, ()))
  reached = sum(got.values())
  bad = got["FAILED"] + got["ERROR"]
  missing = max(want - reached, 0)
  verdict = ("FAIL" if bad else "INCOMPLETE" if missing or not want
             else "SKIPPED" if not got["PASSED"] else "PASS")
  ok_all &= verdict == "PASS"
  print(f"{verdict:10s} {f}: {got['PASSED']} passed, {got['FAILED']} failed, "
        f"{got['ERROR']} errors, {got['SKIPPED']} skipped, "
        f"{missing} not reached (of {want} collected)")
  for n, s in sorted(status.items()):
    if n.startswith(f + "::") and s in ("FAILED", "ERROR"):
      print(f"    {s} {n}")
print("TESTS", "PASS" if ok_all else "NOT ALL PASSED", "(log: gpu_tests.log)")
EOF
}

# ------------------------------------------------------------------ bench
# A root per library: its infcl_jax (a link) beside this tree's benchmark
# code, which puts its own root first on sys.path (and its children's).
make_root() {
  local name=$1 lib=$2 root
  root=$(mktemp -d "/tmp/gpu_check_23_${name}.XXXX")
  ln -s "$lib/infcl_jax" "$root/infcl_jax"
  mkdir "$root/benchmarks"
  cp "$NEW/benchmarks/bench_loss.py" "$NEW/benchmarks/harness.py" "$root/benchmarks/"
  echo "$root"
}

run_bench() {
  local base_root new_root
  base_root=$(make_root base "$BASE")
  new_root=$(make_root new "$NEW")
  local r tree root
  echo "== bench: bench_loss.py $BENCH_ARGS, $BENCH_ROUNDS rounds of base then new"
  for (( r = 1; r <= BENCH_ROUNDS; r++ )); do
    for tree in base new; do
      root=$base_root; [ $tree = new ] && root=$new_root
      local l
      l=$(left)
      if [ "$l" -lt 45 ]; then
        echo "== NOT REACHED: bench round $r $tree (${l}s left)"
        continue
      fi
      local d="$OUT/bench/${tree}_$r"
      mkdir -p "$d"
      local imported
      imported=$(cd "$root" && "$PY" -c "import os, infcl_jax; print(os.path.realpath(infcl_jax.__file__))" 2>&1 | tail -1)
      echo "== bench round $r $tree: infcl_jax from $imported (box $(( l - 5 ))s)"
      local t=$(date +%s)
      (cd "$root" && timeout -s INT -k 15 $(( l - 5 )) "$PY" benchmarks/bench_loss.py \
        --out "$d" $BENCH_ARGS > "$d/bench_loss.log" 2>&1)
      echo "   rc=$? in $(( $(date +%s) - t ))s; $(grep -c '"status": "ok"' "$d/bench_loss.log") ok cases"
    done
  done
  "$PY" - "$OUT/bench" <<'EOF' | tee "$OUT/bench_compare.txt"
import collections, csv, glob, json, os, statistics, sys
root = sys.argv[1]
ms = collections.defaultdict(lambda: collections.defaultdict(list))
other = []
for d in sorted(glob.glob(os.path.join(root, "*_*"))):
  tree, rnd = os.path.basename(d).rsplit("_", 1)
  meta = os.path.join(d, "bench_loss_meta.json")
  if os.path.exists(meta):
    c = json.load(open(meta)).get("ceiling", {})
    print(f"{tree} round {rnd}: bf16 matmul ceiling "
          f"{c.get('tflops', float('nan')):.1f} TFLOP/s")
  path = os.path.join(d, "bench_loss.csv")
  if not os.path.exists(path):
    continue
  for r in csv.DictReader(open(path)):
    key = (r["loss"], r["backend"], r["dtype"], int(r["B"]))
    if r["status"] == "ok":
      ms[key][tree].append(float(r["ms"]))
    else:
      other.append(f"{tree} round {rnd} {key}: {r['status'][:80]}")
print(f"\n{'loss':8s} {'backend':8s} {'dtype':9s} {'B':>7s}  {'base ms (runs)':26s} "
      f"{'new ms (runs)':26s} {'change':>7s}")
for key in sorted(ms):
  b, n = ms[key]["base"], ms[key]["new"]
  runs = lambda v: " / ".join(f"{x:.3f}" for x in v) or "-"
  ch = (f"{100 * (statistics.mean(n) / statistics.mean(b) - 1):+.1f}%"
        if b and n else "-")
  print(f"{key[0]:8s} {key[1]:8s} {key[2]:9s} {key[3]:7d}  {runs(b):26s} {runs(n):26s} {ch:>7s}")
print("\nchange: mean of new over mean of base; the spread of a tree's runs is the noise.")
for line in other:
  print("not ok:", line)
EOF
  rm -rf "$base_root" "$new_root"
}

if [ "$PARTS" != bench ]; then
  box=$(left)
  [ "$PARTS" = all ] && box=$(( box - BENCH_RESERVE_S ))
  run_tests "$box"
fi
if [ "$PARTS" != tests ]; then
  run_bench
fi
echo "== gpu_check_23 done in $(( $(date +%s) - T0 ))s; files in $OUT"
