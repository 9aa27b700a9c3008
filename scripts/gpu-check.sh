#!/usr/bin/env bash
# Everything the GPU machine does in one call: configure, build (sm_90a), run
# the GPU tests (ctest -L gpu), the benchmarks and the PyTorch baselines; logs
# and JSON go under $OUT (or out/ when unset), packed into one
# gpu-check-<what>.tar.gz when $OUT is set (the device tool returns at most 8
# files); a short table is printed last.
# usage: scripts/gpu-check.sh [tests|bench|python|all|ep] [bench names...]   (default: all)
#        scripts/gpu-check.sh run COMMAND...   the build and environment above, then COMMAND
#   (its output in run.log too), e.g. the multi-GPU scripts one at a time
#   ep: expert parallelism on this machine's GPUs (needs >= 2): the EP tests
#   over NCCL, the trainer on all GPUs (scripts/ep-train-check.sh), the
#   pipeline grid (scripts/pp-train-check.sh) and
#   `bench ep`, scripts/pp-fit-check.sh and scripts/scale-check.sh (see the
#   ep section below).
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

# NVLink multicast stays off in every environment this script starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NCCL: the toolkit's when it has one, else PyTorch's nvidia-nccl-cu13 package
# (built against and loaded from the same directory).
nccl_root=
if [ ! -e /usr/local/cuda/include/nccl.h ]; then
  nccl_root=$(python3 -m pip show -f nvidia-nccl-cu13 2>/dev/null | awk '
    /^Location: / { loc = $2 } /\/include\/nccl\.h$/ { sub("/include/nccl.h", "", $1); print loc "/" $1 }')
fi
# cuDNN (--attention cudnn, loaded at run time by dlopen("libcudnn.so.9")):
# PyTorch's nvidia-cudnn-cu13 package's lib/ first on the loader's path, the
# same cuDNN whose headers CMake finds first; its runtime-compiled engines
# load NVRTC: the nvidia-cuda-nvrtc-cu13 package's lib/ after it (the
# toolkit's otherwise).
pip_lib() { # $1 package, $2 library file name: the package's folder holding it
  python3 -m pip show -f "$1" 2>/dev/null | awk -v f="$2" '
    /^Location: / { loc = $2 } index($1, "/lib/" f) && substr($1, length($1) - length(f) + 1) == f {
      sub("/" f "$", "", $1); print loc "/" $1; exit }'
}
cudnn_lib=$(pip_lib nvidia-cudnn-cu13 libcudnn.so.9)
nvrtc_lib=$(pip_lib nvidia-cuda-nvrtc-cu13 libnvrtc.so.13)
[ -n "$nvrtc_lib" ] || nvrtc_lib=$(pip_lib nvidia-cuda-nvrtc libnvrtc.so.13)
for d in "$nvrtc_lib" "$cudnn_lib"; do
  [ -n "$d" ] && export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
summary+=("cudnn library: ${cudnn_lib:-default loader path}; nvrtc: ${nvrtc_lib:-default loader path}")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release ${nccl_root:+-DMST_NCCL_ROOT="$nccl_root"} -G Ninja >"$out/configure.log" 2>&1 \
  || cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release ${nccl_root:+-DMST_NCCL_ROOT="$nccl_root"} >"$out/configure.log" 2>&1 \
  || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" >"$out/build.log" 2>&1 || { grep -E 'error' "$out/build.log" | head -30; tail -20 "$out/build.log"; exit 1; }
summary+=("build: ok")
summary+=("nccl: $(grep -oE 'NCCL [0-9.]+: [^ ]+|NCCL not found' "$out/configure.log" | head -1)")

if [ "$what" = all ] || [ "$what" = tests ]; then
  (cd build-gpu && MST_TEST_REQUIRE_GPU=1 ctest -L gpu --output-on-failure --timeout 300) >"$out/gpu-tests.log" 2>&1
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

# ---- Python package (python/): pytest, the example and its benchmark ---------
# Installs ./python without dependencies into this machine's PyTorch env,
# against build-gpu/libmoestash.so. The bench reads bench-mlp.json of the
# C benchmark when `all` ran it; else it runs `moestash bench mlp --shape 0`.
if [ "$what" = all ] || [ "$what" = python ]; then
  export MOESTASH_LIB=$PWD/build-gpu/libmoestash.so
  if python3 -m pip install --no-deps --no-build-isolation --force-reinstall ./python >"$out/py-install.log" 2>&1; then
    summary+=("python install: ok")
  else  # still run everything, from the tree
    summary+=("python install: FAILED (see py-install.log; ran from python/ instead)")
    export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' \
    >"$out/py-torch.txt" 2>&1
  python3 -m pytest -q -p no:cacheprovider python/tests >"$out/py-tests.log" 2>&1
  summary+=("python tests: $(tail -n 1 "$out/py-tests.log")")
  grep -E '^(FAILED|ERROR)' "$out/py-tests.log" | head -20
  python3 examples/torch_moe_layer.py --json "$out/py-example.json" >"$out/py-example.log" 2>&1 \
    && summary+=("python example: ok") || summary+=("python example: FAILED (see py-example.log)")
  tail -20 "$out/py-example.log"
  [ -f "$out/bench-mlp.json" ] || ./build-gpu/moestash bench mlp --shape 0 --json "$out/bench-mlp.json" >"$out/bench-mlp.log" 2>&1
  python3 python/bench/bench_mlp.py --c-json "$out/bench-mlp.json" --example-json "$out/py-example.json" \
    --json "$out/py-bench.json" >"$out/py-bench.log" 2>&1 \
    && summary+=("python bench: ok") || summary+=("python bench: FAILED (see py-bench.log)")
  tail -20 "$out/py-bench.log"
fi
# ---- end of the Python package section -----------------------------------------

# ---- expert parallelism (several GPUs of one host) -------------------------
# test_ep --backend cuda runs one thread per GPU over NCCL, each scenario on
# both paths (send/recv of fixed blocks; device API stores into symmetric
# windows), against the single-process reference (skips scenarios of more ranks than
# GPUs, exits 77 below 2 GPUs); then compute-sanitizer memcheck over it, the
# launch path (ep-hello: --gpus N, torchrun, a rank crashing) and `bench ep`
# when the program has it.
if [ "$what" = ep ]; then
  n_gpu=$(nvidia-smi -L | wc -l)
  summary+=("gpus: $n_gpu")
  # bounded: a device-side barrier that never meets its peers must not hang the run
  NCCL_DEBUG=WARN timeout 600 ./build-gpu/test_ep --backend cuda >"$out/ep-test.log" 2>&1
  rc=$?
  tail -14 "$out/ep-test.log"
  summary+=("test_ep cuda: $(case $rc in 0) echo ok;; 77) echo "SKIPPED (fewer than 2 GPUs)";; *) echo "FAILED rc $rc (see ep-test.log)";; esac) $(tail -1 "$out/ep-test.log")")
  if [ $rc = 0 ] && [ "${MST_EP_MEMCHECK:-1}" = 1 ]; then  # MST_EP_MEMCHECK=0 skips it
    timeout 900 compute-sanitizer --tool memcheck --error-exitcode 1 ./build-gpu/test_ep --backend cuda >"$out/ep-memcheck.log" 2>&1
    summary+=("test_ep memcheck: $([ $? = 0 ] && echo clean || echo "ERRORS (see ep-memcheck.log)")")
  fi
  # the launch path (tests/cli/test_launch_gpu.sh): ep-hello by --gpus N and
  # torchrun, a rank crashing or killed mid-run, train --gpus 2 vs --ep 2
  timeout 900 bash tests/cli/test_launch_gpu.sh ./build-gpu/moestash >"$out/launch-gpu.log" 2>&1
  summary+=("launch_gpu: $(tail -1 "$out/launch-gpu.log")")
  # the trainer on all GPUs: loss against one GPU, STASH vs KEEP, resume, torchrun
  scripts/ep-train-check.sh ./build-gpu/moestash >"$out/ep-train-check.log" 2>&1
  summary+=("ep-train-check: $([ $? = 0 ] && echo ok || echo 'FAILED (see ep-train-check.log)')")
  cat "$out/ep-train-check.log"
  # the pipeline grid (--pp): loss against one stage, STASH vs KEEP at --pp 4, the bubble
  scripts/pp-train-check.sh ./build-gpu/moestash >"$out/pp-train-check.log" 2>&1
  summary+=("pp-train-check: $([ $? = 0 ] && echo ok || echo 'FAILED (see pp-train-check.log)')")
  cat "$out/pp-train-check.log"
  # issue 29's model that does not fit DP + EP alone, and issue 28's h100 preset on N GPUs against one
  for s in pp-fit-check scale-check; do
    scripts/$s.sh ./build-gpu/moestash >"$out/$s.log" 2>&1
    summary+=("$s: $(case $? in 0) echo ok;; 77) echo skipped;; *) echo "FAILED (see $s.log)";; esac)")
    cat "$out/$s.log"
  done
  # PyTorch: moestash.torch.ExpertParallel over NCCL under torchrun, on every GPU
  # (python/tests/ep_gpu_worker.py: layers against the float64 reference,
  # graph capture, Qwen3-MoE patched with ep= against transformers)
  MOESTASH_LIB=$PWD/build-gpu/libmoestash.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} MST_EP_GPUS=$n_gpu \
    timeout 900 python3 -m pytest -q -s -p no:cacheprovider python/tests/test_ep_gpu.py >"$out/py-ep-gpu.log" 2>&1
  summary+=("python ep (torchrun, $n_gpu GPUs): $(tail -n 1 "$out/py-ep-gpu.log")")
  grep -E '^\[rank' "$out/py-ep-gpu.log" | head -40
  if ./build-gpu/moestash bench ep --help >/dev/null 2>&1; then
    timeout 900 ./build-gpu/moestash bench ep --json "$out/bench-ep.json" >"$out/bench-ep.log" 2>&1
    summary+=("bench ep: $([ $? = 0 ] && echo ok || echo 'FAILED (see bench-ep.log)')")
    tail -25 "$out/bench-ep.log"
  fi
fi
# ---- end of the expert parallelism section ---------------------------------

if [ "$what" = run ]; then
  "$@" 2>&1 | tee "$out/run.log"
  summary+=("run $*: exit ${PIPESTATUS[0]}")
fi

echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu-check-$what.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi
