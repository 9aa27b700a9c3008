#!/usr/bin/env bash
# Issue 28's N-GPU target on this machine: `train --preset h100` on one GPU
# against `--gpus N` at the same tokens per GPU (the preset's batch and
# microbatches a rank; EP N, dropless), the replicated gradients' sums
# overlapped with the backward (--overlap on) and after it (off): tokens/s,
# the ratio to one GPU (target >= 3.6 at N = 4), and the model TFLOP/s a GPU
# over the dense bf16 datasheet peak (989 TFLOP/s, H100 and H200 SXM;
# target MFU >= 35 %) from the JSON's model_flops_per_token. Medians of
# steps 6-STEPS. A measurement, not a CTest.
# usage: scripts/scale-check.sh MOESTASH [train flags...]
set -uo pipefail
bin=$1
shift
run_timeout=400
. "$(dirname "$0")/lib/train-runs.sh"
steps=16
common=(--preset h100 --steps $steps --log-every $steps "$@")
CUDA_VISIBLE_DEVICES=0 run one "${common[@]}"
for o in off on; do run "n_$o" --gpus "$n" --overlap "$o" "${common[@]}"; done
python3 - "$tmp" "$n" <<'PY'
import json, os, statistics, sys
tmp, n = sys.argv[1], int(sys.argv[2])
def load(k):
    p = os.path.join(tmp, k + ".json")
    return json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
runs = {k: load(k) for k in ("one", "n_off", "n_on")}
tps = {k: statistics.median(d["tokens_per_s"][5:]) for k, d in runs.items() if d}
for k, label in (("one", "1 GPU"), ("n_off", f"{n} GPUs, --overlap off"), ("n_on", f"{n} GPUs, --overlap on")):
    d = runs[k]
    if not d:
        print(f"{label}: no result")
        continue
    tf = tps[k] * d["model_flops_per_token"] / (1 if k == "one" else n) / 1e12
    ratio = f", {tps[k] / tps['one']:.2f}x one GPU" if k != "one" and "one" in tps else ""
    same = f", losses {'bit-identical to' if d['loss'] == runs['n_off']['loss'] else 'DIFFER from'} overlap off" \
        if k == "n_on" and runs["n_off"] else ""
    print(f"{label}: {tps[k]:,.0f} tokens/s{ratio}; {tf:.1f} model TFLOP/s a GPU, MFU {tf / 989 * 100:.1f} % of 989{same}")
PY
exit $bad
