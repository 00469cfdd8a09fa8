# Sourced by the CPU test legs (scripts/test.sh, scripts/triton_interpret.sh)
# with the venv's python as $1: how XLA compiles for the CPU tests.
# XLA's CPU code at LLVM's optimisation level 0: the tests' programs are
# small and compiling them is most of the suite's time; at level 0 a test
# file took 22-33% less CPU time (interpreter kernels, ring, trainer runs).
# XLA's own passes are unchanged. INFCL_XLA_OPT_LEVEL picks another level.
export XLA_FLAGS="--xla_backend_optimization_level=${INFCL_XLA_OPT_LEVEL:-0}${XLA_FLAGS:+ $XLA_FLAGS}"
# XLA's compiled programs go to a persistent cache in .pytest_cache/jax
# (git-ignored; a fresh clone starts without it): the trainer tests start
# train.main many times on the same programs and both workers compile many of
# the same ones. jax keys an entry by its version, the XLA flags and the
# program, so a hit is the program a compile would have made. Only with a
# size limit does jax lock the cache's files (with filelock), and unlocked
# a process can read an entry another is still writing: without filelock in
# the venv ($1, its python), no cache. With a limit every write lists and
# stats the whole folder, so only compiles of 0.5 s or more are kept (a few
# hundred, not the tens of thousands of eager ops: at 3,000 entries the
# tower tests ran 3.5x slower). INFCL_JAX_CACHE picks the folder; set empty,
# no cache.
cache=${INFCL_JAX_CACHE-$PWD/.pytest_cache/jax}
if [ -n "$cache" ] && "$1" -c "import filelock" 2>/dev/null; then
  mkdir -p "$cache"
  export JAX_COMPILATION_CACHE_DIR="$cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5 \
         JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 JAX_COMPILATION_CACHE_MAX_SIZE=$((2 << 30))
fi
