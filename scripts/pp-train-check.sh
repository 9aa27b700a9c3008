#!/usr/bin/env bash
# The pipeline grid on this machine's GPUs (>= 2; the --pp 4 checks need 4),
# one process per GPU; a measurement, not a CTest (tests/cli/test_launch_gpu.sh
# and test_train_pp --backend cuda are the tests):
#   loss:    --pp 2 --gpus 2 against one stage on one GPU (untied embeddings,
#            1F1B over 4 microbatches, graphs on), 20 steps: step 1's loss
#            bits and the max relative loss difference (the gradient norm is
#            summed per stage, then over the stages: another order);
#   policy:  KEEP and STASH at --pp P (P = 4 on 4+ GPUs, else 2), 8
#            microbatches, dropless (capacity factor = the groups): stage 0's
#            saved grouped-MLP bytes (kept + stash pool) under each, their
#            ratio (target <= 0.5), STASH/KEEP step time (target <= 1.03)
#            and whether the losses are the same bits;
#   bubble:  the --pp P step against one stage's work alone (--pp 1 on one
#            GPU with L / P layers and the same microbatches): measured
#            T_pp / T_stage against the 1F1B ideal (M + P - 1) / M, i.e. the
#            bubble (P - 1) / (M + P - 1) on top of a stage's compute
#            (target: within 10 %). The one-stage run also does the
#            embedding, the head and the MTP module: an upper bound of a
#            stage's compute, so the measured bubble is a lower bound;
#   budget:  --memory-budget at --pp P, M 8, each stage planning its own
#            layers and schedule: a budget halfway between the largest KEEP
#            peak of the later stages and stage 0's (the planner's own
#            predictions at a budget nothing binds, 1 TiB), so stage 0 (P
#            microbatches in flight) should pick stash/offload/recompute and
#            the last stage keep; each stage's plan, predicted and measured
#            peak (max over its ranks) against the budget, the step time and
#            losses against KEEP's.
# usage: scripts/pp-train-check.sh MOESTASH
set -uo pipefail
bin=$1
run_timeout=900
. "$(dirname "$0")/lib/train-runs.sh"
P=2
[ "$n" -ge 4 ] && P=4
size=(--hidden 1024 --ffn 1024 --heads 8 --kv-heads 4 --head-dim 128 --seq 1024 --batch 4 --layers 8 --experts 32 --top-k 4)

# ---- loss: --pp 2 on 2 GPUs vs one stage on one GPU ----
common=(--steps 20 --log-every 20 --microbatches 4 --schedule 1f1b --tie-embeddings off)
if run pp2 --pp 2 --gpus 2 "${common[@]}" && run pp1 "${common[@]}"; then
  python3 - "$tmp/pp2.json" "$tmp/pp1.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
rel = [abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"])]
print(f"loss: train --pp 2 --gpus 2 vs --pp 1 on one GPU, 20 steps, M 4: step 1 "
      f"{'bit-identical' if a['loss'][0] == b['loss'][0] else 'DIFFERS'}, max relative loss difference {max(rel):.2e} "
      f"(step {rel.index(max(rel)) + 1}); loss {b['loss'][0]:.4f} -> {b['loss'][-1]:.4f}; captures {a['captures']}, "
      f"replays {a['replays']}, reruns {a['reruns']}")
PY
fi

# ---- policy: STASH against KEEP at --pp P, 8 microbatches ----
for p in keep stash; do run "$p" --pp "$P" --gpus "$P" --microbatches 8 --steps 30 --log-every 30 --policy "$p" "${size[@]}"; done
if [ -s "$tmp/keep.json" ] && [ -s "$tmp/stash.json" ]; then
  python3 - "$tmp/keep.json" "$tmp/stash.json" "$P" <<'PY'
import json, statistics, sys
k, s = (json.load(open(p)) for p in sys.argv[1:3])
tk, ts = (statistics.median(d["tokens_per_s"][10:]) for d in (k, s))
k0, s0 = k["stages"][0], s["stages"][0]
print(f"policy at --pp {sys.argv[3]}, M 8, graphs on, median of steps 11-30: KEEP {tk:,.0f} tok/s, STASH {ts:,.0f} "
      f"(step time STASH/KEEP {tk / ts:.3f}); stage 0 ({k0['sets']} microbatches in flight): grouped-MLP saved KEEP "
      f"{k0['mlp_saved'] / 2**20:.1f} MiB, STASH {s0['mlp_saved'] / 2**20:.1f} MiB (pages peak in use "
      f"{s0['dev_pages_peak'] / 2**20:.1f} MiB): {s0['mlp_saved'] / k0['mlp_saved']:.3f}x; backend peak stage 0 "
      f"{k0['backend_peak'] / 2**30:.2f} -> {s0['backend_peak'] / 2**30:.2f} GiB; losses "
      f"{'bit-identical' if k['loss'] == s['loss'] else 'DIFFER'}; reruns {k['reruns']} / {s['reruns']}")
for d, name in ((k, "KEEP"), (s, "STASH")):
    print(f"  {name} by stage: " + "; ".join(f"stage {t['stage']}: {t['sets']} in flight, MLP saved {t['mlp_saved'] / 2**20:.1f} MiB, "
          f"peak {t['backend_peak'] / 2**30:.2f} GiB" for t in d["stages"]))
PY
fi

# ---- bubble: the --pp P step against one stage's work alone ----
L=8
if run stage --microbatches 8 --steps 30 --log-every 30 --policy keep "${size[@]}" --layers $((L / P)); then
  python3 - "$tmp/keep.json" "$tmp/stage.json" "$P" 8 <<'PY'
import json, statistics, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
P, M = int(sys.argv[3]), int(sys.argv[4])
ta, tb = (1.0 / statistics.median(d["tokens_per_s"][10:]) for d in (a, b))  # seconds per token of the same batch
ratio, ideal = ta / tb, (M + P - 1) / M
print(f"bubble at --pp {P}, M {M}: step {ratio:.3f}x one stage's work alone (ideal 1F1B {ideal:.3f}x: bubble "
      f"{(P - 1) / (M + P - 1):.3f} of the step); measured/ideal {ratio / ideal:.3f} (target <= 1.10)")
PY
fi
# ---- budget: --memory-budget at --pp P, each stage its own plan ----
if [ -s "$tmp/keep.json" ] && run big --pp "$P" --gpus "$P" --microbatches 8 --steps 3 --log-every 3 --memory-budget 1TiB "${size[@]}"; then
  budget=$(python3 -c "import json,sys; k=[x['plan']['keep_peak'] for x in json.load(open(sys.argv[1]))['stages']]; r=max(k[1:]); print((k[0] + r) // 2 if k[0] > r else 0)" "$tmp/big.json")
  if [ "${budget:-0}" -le 0 ]; then
    echo "budget at --pp $P: stage 0's KEEP peak is not the largest (no budget between the stages): skipped"
  elif run budget --pp "$P" --gpus "$P" --microbatches 8 --steps 30 --log-every 30 --memory-budget "$budget" "${size[@]}"; then
    python3 - "$tmp/keep.json" "$tmp/budget.json" "$P" <<'PY'
import collections, json, statistics, sys
k, d = (json.load(open(p)) for p in sys.argv[1:3])
b = d["plan"]["budget"]
tk, td = (statistics.median(x["tokens_per_s"][10:]) for x in (k, d))
print(f"budget at --pp {sys.argv[3]}, M 8: --memory-budget {b / 2**30:.3f} GiB a rank; step time planned/KEEP {tk / td:.3f}; "
      f"losses {'bit-identical to' if d['loss'] == k['loss'] else 'DIFFER from'} KEEP's; reruns {d['reruns']}")
for t in d["stages"]:
    p = t["plan"]
    c = collections.Counter(v for n in p["policy"].values() for v in n)
    within = "within" if t["backend_peak_max"] <= b else "OVER"
    print(f"  stage {t['stage']} ({t['sets']} in flight, layers {p['layers'][0]}-{p['layers'][-1]}): "
          + ", ".join(f"{v} {n}" for v, n in sorted(c.items())) + f" (granularity {p['granularity']}); peak predicted "
          f"{p['predicted_peak'] / 2**30:.3f} GiB, measured {t['backend_peak_max'] / 2**30:.3f} GiB "
          f"({100 * (p['predicted_peak'] - t['backend_peak_max']) / t['backend_peak_max']:+.1f} %), {within} the budget; "
          f"KEEP predicted {p['keep_peak'] / 2**30:.3f} GiB")
PY
  fi
fi
exit $bad
