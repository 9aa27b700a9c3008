#!/usr/bin/env bash
# Issue 29's first target on 4 GPUs: a model that does not fit with data
# parallelism and EP alone trains with pipeline stages and the sharded
# optimizer. A measurement, not a CTest (test_train_pp is the test):
#   refused: `train --gpus 4` (DP 4, EP 4) of a model with many replicated
#            (attention) parameters, its layers chosen from this card's
#            memory, exits 2 before any work with the trainer's own "needs
#            at least ... GiB" line;
#   trains:  the same model with `--pp 2 --gpus 4 --optimizer-shard on`
#            (2 stages of DP 2, EP 2) and with `--pp 4 --gpus 4` (run
#            last), the same sequences a step (--microbatches 8 x 4 / DP),
#            20 steps each: step 1 bit-identical between them, the loss
#            drift, each stage's backend peak;
#   matches: a smaller model of the same shape that fits both ways,
#            `--gpus 4` against `--pp 2 --gpus 4 --optimizer-shard on`, 20
#            steps: step 1 bit-identical, the max relative loss difference.
# usage: scripts/pp-fit-check.sh MOESTASH
set -uo pipefail
bin=$1
run_timeout=600
. "$(dirname "$0")/lib/train-runs.sh"
[ "$n" -ge 4 ] || { echo "skipped: $n GPUs (needs 4)"; exit 77; }
shape=(--preset h100 --hidden 6144 --heads 48 --kv-heads 8 --head-dim 128 --ffn 1024 --experts 8 --top-k 2
       --batch 1 --seq 1024 --steps 20 --log-every 20)
# the same GEMM shapes on every grid (--batch 1 a rank: cuBLAS picks by shape)
# and the same sequences a step: --microbatches 8 x 4 / DP
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
# A first guess of the layers whose parameters, gradients and AdamW state
# (18 bytes each) outgrow a card at DP 4, EP 4: a layer's replicated
# attention and router (88.3 M) plus a quarter of its 8 experts (37.7 M),
# and the MTP layer; the trainer's refusal is the verdict, not this guess.
L=$(python3 -c "import math; print(4 * math.ceil($mib * 2**20 / (18 * 126.0e6) / 4))")  # P divides L
for try in 1 2 3; do
  timeout 300 "$bin" train --backend cuda --gpus 4 "${shape[@]}" --microbatches 8 --layers "$L" >"$tmp/dp.out" 2>"$tmp/dp.err"
  rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "refused: no: --gpus 4 --layers $L trained; trying more layers"
    L=$((L + 4))
    continue
  fi
  echo "refused: train --gpus 4 (DP 4, EP 4) --layers $L on $mib MiB cards: exit $rc: $(grep -m1 'needs at least' "$tmp/dp.err" || tail -1 "$tmp/dp.err")"
  [ "$rc" -eq 2 ] || bad=1
  break
done
run pp2 --gpus 4 --pp 2 --microbatches 16 --optimizer-shard on "${shape[@]}" --layers "$L"
small=("${shape[@]}" --layers 8)
run dp4 --gpus 4 --microbatches 8 "${small[@]}" && run pp2s --gpus 4 --pp 2 --microbatches 16 --optimizer-shard on "${small[@]}"
run pp4 --gpus 4 --pp 4 --microbatches 32 "${shape[@]}" --layers "$L"
python3 - "$tmp" "$L" <<'PY'
import json, os, statistics, sys
tmp, L = sys.argv[1], sys.argv[2]
def load(n):
    p = os.path.join(tmp, n + ".json")
    return json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
def cmp(a, b, what):
    rel = [abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"])]
    print(f"{what}: step 1 {'bit-identical' if a['loss'][0] == b['loss'][0] else 'DIFFERS'} "
          f"({a['loss'][0]!r} vs {b['loss'][0]!r}), max relative loss difference {max(rel):.2e} (step {rel.index(max(rel)) + 1}), "
          f"loss {a['loss'][0]:.4f} -> {a['loss'][-1]:.4f}")
def peaks(d):
    return ", ".join(f"stage {t['stage']} {t['backend_peak'] / 2**30:.1f} GiB" for t in d.get("stages", []))
pp2, pp4, dp4, pp2s = (load(n) for n in ("pp2", "pp4", "dp4", "pp2s"))
for d, n in ((pp2, "--pp 2 --optimizer-shard on"), (pp4, "--pp 4")):
    if d:
        print(f"trains: --layers {L} {n}: median {statistics.median(d['tokens_per_s'][5:]):,.0f} tokens/s (steps 6-20); peaks {peaks(d)}")
if pp2 and pp4:
    cmp(pp2, pp4, f"--layers {L}: --pp 2 x DP 2 (sharded) against --pp 4 x DP 1")
if dp4 and pp2s:
    cmp(pp2s, dp4, "--layers 8 (fits both ways): --pp 2 --optimizer-shard on against --gpus 4 (DP 4, EP 4)")
PY
exit $bad
