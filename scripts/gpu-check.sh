#!/usr/bin/env bash
# Everything the GPU machine does in one call: configure, build (sm_90a), run
# the GPU tests (ctest -L gpu), the benchmarks and the PyTorch baselines; logs
# and JSON go under $OUT (or out/ when unset), packed into one
# gpu-check-<what>.tar.gz when $OUT is set (the device tool returns at most 8
# files); a short table is printed last.
# usage: scripts/gpu-check.sh [tests|bench|all] [bench names...]   (default: all)
# MST_SANITIZE_GPU="test_a test_b" runs compute-sanitizer memcheck over those
# GPU tests (MST_SANITIZE_GPU=1: every one).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}/logs
mkdir -p "$out"
what=${1:-all}
shift || true
benches=${*:-gemm stash mlp step}
summary=()

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -G Ninja >"$out/configure.log" 2>&1 \
  || cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release >"$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" >"$out/build.log" 2>&1 || { grep -E 'error' "$out/build.log" | head -30; tail -20 "$out/build.log"; exit 1; }
summary+=("build: ok")

if [ "$what" = all ] || [ "$what" = tests ]; then
  (cd build-gpu && ctest -L gpu --output-on-failure --timeout 300) >"$out/gpu-tests.log" 2>&1
  rc=$?
  grep -E 'Passed|Failed|\*\*\*' "$out/gpu-tests.log" | tail -40
  [ $rc = 0 ] || grep -E '^FAIL' "$out/gpu-tests.log" | head -30
  summary+=("gpu tests: $(grep -oE '[0-9]+% tests passed.* out of [0-9]+' "$out/gpu-tests.log" || echo 'no result')")
  sanitize=${MST_SANITIZE_GPU:-}
  [ "$sanitize" = 1 ] && sanitize=$(cd build-gpu && ls test_* | grep -v '\.')
  for t in $sanitize; do
    compute-sanitizer --tool memcheck --error-exitcode 1 "build-gpu/$t" --backend cuda >"$out/memcheck-$t.log" 2>&1
    summary+=("memcheck $t: $([ $? = 0 ] && echo clean || echo "ERRORS ($(grep -m1 -E 'Invalid|ERROR' "$out/memcheck-$t.log"))")")
  done
  # trainer end to end: CUDA vs CPU first losses, determinism, over-budget rerun, GPU default
  OUT="$out" scripts/train-check.sh build-gpu >"$out/train-check.log" 2>&1
  summary+=("train-check: $([ $? = 0 ] && echo ok || echo 'FAILED (see train-check.log)')")
  tail -24 "$out/train-check.log"
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  for b in $benches; do
    if ./build-gpu/moestash bench "$b" --json "$out/bench-$b.json" >"$out/bench-$b.log" 2>&1; then
      summary+=("bench $b: ok")
    else
      summary+=("bench $b: FAILED (see bench-$b.log)")
    fi
    tail -25 "$out/bench-$b.log"
    if [ -f "bench/torch/$b.py" ]; then
      python3 "bench/torch/$b.py" --json "$out/torch-$b.json" >"$out/torch-$b.log" 2>&1 \
        && summary+=("torch $b: ok") || summary+=("torch $b: FAILED")
      tail -15 "$out/torch-$b.log"
    fi
  done
fi

echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu-check-$what.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi
