#!/usr/bin/env bash
# The trainer's end-to-end check on a GPU machine: the same small
# configuration trained on the CPU and on CUDA, first steps' losses compared
# (within bf16 tolerance), the CUDA run repeated for bit-identical losses, a
# forced over-budget step on CUDA, --check-policies on CUDA, the same with
# cuDNN's attention (--attention cudnn, head dim 64), then the GPU
# default configuration under keep and under stash (1F1B, 2 microbatches)
# with their memory tables. Logs and JSON under $OUT (or out/).
# usage: scripts/train-check.sh [build dir]   (default build-gpu, built if missing)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
build=${1:-build-gpu}
if [ ! -x "$build/moestash" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$out/train-configure.log" 2>&1 &&
    cmake --build "$build" -j"$(nproc)" --target moestash_cli >"$out/train-build.log" 2>&1 ||
    { tail -20 "$out/train-build.log"; exit 1; }
fi
bin=$build/moestash
small="--steps 12 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --head-dim 16 --seq 64 --batch 8 --layers 2 --experts 8 --top-k 2 --ep 2 --lr 3e-3 --warmup 4"
rc=0
"$bin" train --backend cpu $small --quiet --json "$out/train-cpu.json" >"$out/train-cpu.log" 2>&1 || rc=1
"$bin" train --backend cuda $small --json "$out/train-cuda.json" >"$out/train-cuda.log" 2>&1 || rc=1
"$bin" train --backend cuda $small --quiet --json "$out/train-cuda2.json" >"$out/train-cuda2.log" 2>&1 || rc=1
"$bin" train --backend cuda $small --quiet --force-over-budget 3 --json "$out/train-cuda-forced.json" \
  >"$out/train-cuda-forced.log" 2>&1 || rc=1
[ $rc = 0 ] || { tail -5 "$out"/train-*.log; exit 1; }
python3 - "$out" <<'PY' || rc=1
import json, sys
d = sys.argv[1]
cpu, gpu, gpu2, forced = (json.load(open(f"{d}/train-{n}.json")) for n in ("cpu", "cuda", "cuda2", "cuda-forced"))
ok = True
print("step   cpu loss   cuda loss   rel diff   (mtp: cpu / cuda)")
for i in range(5):
    a, b = cpu["loss"][i], gpu["loss"][i]
    rel = abs(a - b) / abs(a)
    good = rel < 1e-2 and abs(cpu["mtp_loss"][i] - gpu["mtp_loss"][i]) / abs(cpu["mtp_loss"][i]) < 1e-2
    ok &= good
    print(f"{i+1:4d}  {a:9.5f}  {b:10.5f}   {rel:8.2e}   {cpu['mtp_loss'][i]:.5f} / {gpu['mtp_loss'][i]:.5f}  {'ok' if good else 'FAIL'}")
same = gpu["loss"] == gpu2["loss"] and gpu["mtp_loss"] == gpu2["mtp_loss"]
print(f"cuda run twice: losses bit-identical: {same}")
fsame = forced["loss"] == gpu["loss"] and forced["reruns"] == 1
print(f"cuda forced over budget at step 3: reruns {forced['reruns']}, losses identical: {forced['loss'] == gpu['loss']}")
fell = gpu["loss"][-1] < gpu["loss"][0]
print(f"cuda loss {gpu['loss'][0]:.4f} -> {gpu['loss'][-1]:.4f}")
sys.exit(0 if ok and same and fsame and fell else 1)
PY
"$bin" train --backend cuda $small --steps 6 --check-policies >"$out/train-cuda-policies.log" 2>&1 || rc=1
grep check-policies "$out/train-cuda-policies.log"
# cuDNN's attention (--attention cudnn) at head dim 64: the first losses
# against the CPU's (whose attention is the reference), bit-identical when
# run twice, and --check-policies (every policy the same bits)
d64=${small/--head-dim 16/--head-dim 64}
rc_cudnn=0
"$bin" train --backend cpu $d64 --quiet --json "$out/train-cpu-d64.json" >"$out/train-cpu-d64.log" 2>&1 || rc_cudnn=1
"$bin" train --backend cuda $d64 --attention cudnn --json "$out/train-cudnn.json" >"$out/train-cudnn.log" 2>&1 || rc_cudnn=1
"$bin" train --backend cuda $d64 --attention cudnn --quiet --json "$out/train-cudnn2.json" >"$out/train-cudnn2.log" 2>&1 ||
  rc_cudnn=1
[ $rc_cudnn = 0 ] || tail -3 "$out/train-cpu-d64.log" "$out/train-cudnn.log" "$out/train-cudnn2.log"
[ $rc_cudnn = 0 ] && { python3 - "$out" <<'PY' || rc_cudnn=1
import json, sys
d = sys.argv[1]
cpu, a, b = (json.load(open(f"{d}/train-{n}.json")) for n in ("cpu-d64", "cudnn", "cudnn2"))
rel = [abs(x - y) / abs(x) for x, y in zip(cpu["loss"][:5], a["loss"][:5])]
print("cudnn: first 5 losses vs cpu, rel diff " + " ".join(f"{r:.1e}" for r in rel) +
      f"; run twice bit-identical: {a['loss'] == b['loss'] and a['mtp_loss'] == b['mtp_loss']}")
sys.exit(0 if max(rel) < 1e-2 and a["loss"] == b["loss"] and a["mtp_loss"] == b["mtp_loss"] else 1)
PY
}
"$bin" train --backend cuda $d64 --attention cudnn --steps 6 --check-policies >"$out/train-cudnn-policies.log" 2>&1 ||
  rc_cudnn=1
grep check-policies "$out/train-cudnn-policies.log"
echo "train-check cudnn: $([ $rc_cudnn = 0 ] && echo ok || echo FAILED)"
[ $rc_cudnn = 0 ] || rc=1
"$bin" train --backend cuda --steps ${TRAIN_STEPS:-60} --json "$out/train-cuda-default.json" >"$out/train-cuda-default.log" 2>&1 || rc=1
tail -17 "$out/train-cuda-default.log"
"$bin" train --backend cuda --steps ${TRAIN_STEPS:-60} --policy stash --microbatches 2 --schedule 1f1b \
  --json "$out/train-cuda-stash.json" >"$out/train-cuda-stash.log" 2>&1 || rc=1
tail -17 "$out/train-cuda-stash.log"
echo "train-check: $([ $rc = 0 ] && echo ok || echo FAILED)"
exit $rc
