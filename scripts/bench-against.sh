#!/usr/bin/env bash
# Times this tree's benchmarks beside another source tree's (e.g. the commit
# before a refactor) on the same GPU in one call, so the two builds share the
# card, clocks and temperature: both are built at once, then each benchmark
# runs on the old build and the new one back to back.
# usage: scripts/bench-against.sh OLD_SRC_DIR   (logs under $OUT or out/)
set -uo pipefail
cd "$(dirname "$0")/.."
old=$1
out=${OUT:-out}/against
mkdir -p "$out"
build() { cmake -S "$1" -B "$2" -DCMAKE_BUILD_TYPE=Release -G Ninja >"$3.configure.log" 2>&1 && cmake --build "$2" -j8 >"$3.build.log" 2>&1; }
build "$old" build-old "$out/old" & pid=$!
build . build-gpu "$out/new" || { tail -20 "$out/new.build.log"; exit 1; }
wait $pid || { tail -20 "$out/old.build.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
run() { # name args...: old then new
  local name=$1; shift
  for b in old gpu; do
    ./build-$b/moestash bench "$@" >"$out/$name-$b.log" 2>&1 || echo "bench $name ($b) failed"
  done
}
run mlp0 mlp --shape 0
run step step --only stash
run gemm-wgrad gemm --op wgrad
echo "== old vs new (same call)"
grep -h -A3 "^rows\|^#  *rows\|^# rows" "$out"/mlp0-*.log | head -12
for b in old gpu; do echo "-- step $b"; tail -6 "$out/step-$b.log"; done
for b in old gpu; do echo "-- gemm wgrad $b"; grep -E "ours/roof" "$out/gemm-wgrad-$b.log" | sed -E 's/.*(E= *[0-9]+) (\w+) .* ours ([ 0-9.]+) .*ours\/roof ([0-9.]+).*/\1 \2 ours \3 roof-ratio \4/'; done
