#!/usr/bin/env bash
# Everything the GPU machine does in one call: configure, build (sm_90a), run
# the GPU tests (ctest -L gpu), the benchmarks and the PyTorch baselines; logs
# and JSON go under $OUT (or out/ when unset); a short table is printed last.
# usage: scripts/gpu-check.sh [tests|bench|all] [bench names...]   (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
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
  summary+=("gpu tests: $(grep -oE '[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$out/gpu-tests.log" || echo 'no result')")
  if [ "${MST_SANITIZE_GPU:-0}" = 1 ]; then
    for t in build-gpu/test_*; do
      compute-sanitizer --tool memcheck --error-exitcode 1 "$t" --backend cuda >"$out/memcheck-$(basename "$t").log" 2>&1
      summary+=("memcheck $(basename "$t"): $([ $? = 0 ] && echo clean || echo ERRORS)")
    done
  fi
  # trainer end to end: CUDA vs CPU first losses, determinism, over-budget rerun, GPU default
  scripts/train-check.sh build-gpu >"$out/train-check.log" 2>&1
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
printf '%s\n' "${summary[@]}"
