#!/usr/bin/env bash
# The trainer on this machine's GPUs (N = all of them, >= 2), one process per
# GPU; a measurement, not a CTest (tests/cli/test_launch_gpu.sh is the test):
#   loss:    train --gpus N against one GPU with the same global batch and
#            --ep N, 20 steps at the CUDA default size, graphs on: the max
#            relative loss difference (bf16 weights: the replicated gradients
#            are summed in another order, so the runs drift by rounding);
#   policy:  keep and stash on N GPUs, 30 steps, graphs on, at the CUDA
#            default size and a larger one: median tokens/s of steps 11-30,
#            STASH/KEEP step time and the memory over the ranks;
#   resume:  --save at step 2 of 4, --resume: steps 3-4 and the weights hash
#            against the run that went straight through;
#   shard:   --optimizer-shard on against off on N GPUs, 30 steps, graphs
#            on, at two sizes: step time on/off, the replicated parameters'
#            optimizer bytes a rank, the backend peak; the losses and the
#            weights hash bit-identical (a reduce-scatter's block holds the
#            all-reduce's bits), or exit 1;
#   overlap: --overlap on (the replicated gradients summed a layer at a
#            time during the backward, on a stream of their own) against
#            off on N GPUs, 30 steps, graphs on, at two sizes: median
#            tokens/s of steps 11-30 and step time on/off; the losses and
#            the weights hash bit-identical, or exit 1;
#   torchrun: the same binary under torchrun --no-python (when installed);
#   network: the loss run of N GPUs again with NCCL kept off NVLink and
#            shared memory (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: its
#            network transport over loopback, the stand-in for N hosts;
#            the exchange then takes the p2p path by itself): the losses
#            against the NVLink run of the same grid and both step times:
#            bit-identical, or exit 1 (the float sums are the library's, in
#            rank order, NCCL moving bytes only: DESIGN 12; with NCCL's own
#            all-reduce, 4 x H200 gave the same bits for 2 steps only).
# Prints one line per check and exits 1 when a run failed.
# usage: scripts/ep-train-check.sh MOESTASH
set -uo pipefail
bin=$1
run_timeout=600
. "$(dirname "$0")/lib/train-runs.sh"

# ---- loss: N GPUs vs one GPU with --ep N ----
# (NCCL_ALGO=Ring: this run is also the NVLink side of the network check)
grid=(--gpus "$n" --batch 4 --steps 20 --log-every 20)
if NCCL_ALGO=Ring run gpus "${grid[@]}" && run one --ep "$n" --batch $((4 * n)) --steps 20 --log-every 20; then
  python3 - "$tmp/gpus.json" "$tmp/one.json" "$n" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
rel = [abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"])]
print(f"loss: train --gpus {sys.argv[3]} vs one GPU --ep {sys.argv[3]}, 20 steps: step 1 "
      f"{'bit-identical' if a['loss'][0] == b['loss'][0] else 'differs'}, max relative loss difference "
      f"{max(rel):.2e} (step {rel.index(max(rel)) + 1}); loss {b['loss'][0]:.4f} -> {b['loss'][-1]:.4f} (one GPU), "
      f"{a['loss'][-1]:.4f} ({a['ranks']} GPUs); captures {a['captures']}, replays {a['replays']}, reruns {a['reruns']}")
EOF
fi

# ---- network: the same grid with NCCL on its network transport ----
if [ -s "$tmp/gpus.json" ] && NCCL_ALGO=Ring NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run net "${grid[@]}"; then
  python3 - "$tmp/gpus.json" "$tmp/net.json" "$n" "$(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 120 "$bin" ep-hello --backend cuda --gpus "$n" 2>&1 | grep -m1 -iE 'path' || true)" <<'EOF'
import json, statistics, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta, tb = (statistics.median(d["tokens_per_s"][5:]) for d in (a, b))
same = a["loss"] == b["loss"] and a["weights_hash"] == b["weights_hash"]
print(f"network on {sys.argv[3]} GPUs (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1, NCCL_ALGO=Ring both): 20 steps' losses and "
      f"weights hash {'bit-identical to' if same else 'DIFFER from'} the NVLink run; median tokens/s of steps 6-20: "
      f"NVLink {ta:,.0f}, loopback network {tb:,.0f} (step time {ta / tb:.2f}x); ep-hello on the network transport: {sys.argv[4] or 'no path printed'}")
sys.exit(0 if same else 1)
EOF
  [ $? = 0 ] || bad=1
fi

# ---- policy: STASH against KEEP on N GPUs, at two sizes ----
policy() { # label, flags...
  local label=$1
  shift
  for p in keep stash; do run "$p" --gpus "$n" --steps 30 --log-every 30 --policy "$p" "$@"; done
  [ -f "$tmp/keep.json" ] && [ -f "$tmp/stash.json" ] || return
  python3 - "$tmp/keep.json" "$tmp/stash.json" "$n" "$label" <<'EOF'
import json, statistics, sys
k, s = (json.load(open(p)) for p in sys.argv[1:3])
tk, ts = (statistics.median(d["tokens_per_s"][10:]) for d in (k, s))
def peak(d): return d["memory_bytes"]["backend_peak_max_over_ranks"] / 2**30
def mlp(d): return sum(v for r, v in d["memory_bytes"]["run_max_over_ranks"].items() if "grouped MLP" in r) / 2**20
def total(d): return sum(d["memory_bytes"]["run_max_over_ranks"].values()) / 2**30
print(f"policy on {sys.argv[3]} GPUs, {sys.argv[4]}, graphs on, median of steps 11-30: "
      f"keep {tk:,.0f} tok/s, stash {ts:,.0f} tok/s, STASH/KEEP step time {tk / ts:.3f}; backend peak, max over ranks: "
      f"keep {peak(k):.2f} GiB, stash {peak(s):.2f} GiB; memory table total (sized steps), max over ranks: keep "
      f"{total(k):.2f} GiB, stash {total(s):.2f} GiB; grouped-MLP saved keep {mlp(k):.1f} MiB, stash {mlp(s):.1f} MiB; "
      f"losses {'bit-identical' if k['loss'] == s['loss'] else 'DIFFER'}; weights hash "
      f"{'same' if k['weights_hash'] == s['weights_hash'] else 'DIFFERS'}; captures {k['captures']}/{s['captures']}, "
      f"reruns {k['reruns']}/{s['reruns']}")
c, a = k["config"], k["allreduce"]
step_ms = 1e3 * c["batch"] * c["seq"] * c["microbatches"] * k["ranks"] / tk
print(f"  all-reduce of the replicated gradients ({a['bytes'] / 2**20:.1f} MiB fp32, "
      f"{'a layer at a time during the backward' if a.get('overlap') else 'after the backward'}): {a['ms']:.3f} ms "
      f"alone, {100 * a['ms'] / step_ms:.1f} % of a KEEP step ({step_ms:.2f} ms)")
EOF
  rm -f "$tmp/keep.json" "$tmp/stash.json"
}
policy "CUDA default size (batch 16 per rank)"
policy "H 1024, F 2048, T 1024, batch 8 per rank" --hidden 1024 --ffn 2048 --seq 1024 --batch 8

# ---- resume: checkpoints of N ranks ----
small=(--gpus "$n" --batch 4 --layers 2 --log-every 4)
if run straight "${small[@]}" --steps 4 && run first "${small[@]}" --steps 4 --save "$tmp/ck" --save-every 2 &&
  run second --resume "$tmp/ck/step-2" --steps 4 --log-every 4 --gpus "$n"; then
  python3 - "$tmp/straight.json" "$tmp/second.json" "$n" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
same = a["loss"][2:] == b["loss"][-2:] and a["weights_hash"] == b["weights_hash"]
print(f"resume on {sys.argv[3]} GPUs: saved at step 2, resumed to 4: losses of steps 3-4 and the weights hash "
      f"{'bit-identical to' if same else 'DIFFER from'} the run straight through "
      f"({a['loss'][2:]} vs {b['loss'][-2:]}, {a['weights_hash']} vs {b['weights_hash']})")
sys.exit(0 if same else 1)
EOF
  [ $? = 0 ] || bad=1
fi

# ---- shard: the distributed optimizer (ZeRO-1) against unsharded ----
shard() { # label, flags...
  local label=$1
  shift
  for o in off on; do run "shard_$o" --gpus "$n" --steps 30 --log-every 30 --optimizer-shard "$o" "$@"; done
  [ -f "$tmp/shard_off.json" ] && [ -f "$tmp/shard_on.json" ] || return
  python3 - "$tmp/shard_off.json" "$tmp/shard_on.json" "$n" "$label" <<'EOF'
import json, statistics, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta, tb = (statistics.median(d["tokens_per_s"][10:]) for d in (a, b))
oa, ob = a["optimizer"], b["optimizer"]
def peak(d): return d["memory_bytes"]["backend_peak_max_over_ranks"] / 2**30
same = a["loss"] == b["loss"] and a["weights_hash"] == b["weights_hash"]
print(f"shard on {sys.argv[3]} GPUs, {sys.argv[4]}, graphs on, median of steps 11-30: off {ta:,.0f} tok/s, on {tb:,.0f} "
      f"tok/s, step time on/off {ta / tb:.3f}; optimizer state of the replicated parameters a rank: off "
      f"{oa['replicated_bytes'] / 2**20:.1f} MiB, on {ob['replicated_bytes'] / 2**20:.1f} MiB "
      f"({ob['replicated_bytes'] / oa['replicated_bytes']:.3f}x); backend peak, max over ranks: off {peak(a):.2f} GiB, "
      f"on {peak(b):.2f} GiB; 30 steps' losses and weights hash {'bit-identical' if same else 'DIFFER'}")
# the reduce-scatter's block holds the all-reduce's bits (the float sums in rank order): no drift
sys.exit(0 if same else 1)
EOF
  [ $? = 0 ] || bad=1
  rm -f "$tmp/shard_off.json" "$tmp/shard_on.json"
}
shard "CUDA default size (batch 16 per rank)"
shard "H 1024, F 2048, T 1024, batch 8 per rank" --hidden 1024 --ffn 2048 --seq 1024 --batch 8

# ---- overlap: the replicated gradients' sums during the backward against after it ----
overlap() { # label, flags...
  local label=$1
  shift
  for o in off on; do run "overlap_$o" --gpus "$n" --steps 30 --log-every 30 --overlap "$o" "$@"; done
  [ -f "$tmp/overlap_off.json" ] && [ -f "$tmp/overlap_on.json" ] || return
  python3 - "$tmp/overlap_off.json" "$tmp/overlap_on.json" "$n" "$label" <<'EOF'
import json, statistics, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
ta, tb = (statistics.median(d["tokens_per_s"][10:]) for d in (a, b))
same = a["loss"] == b["loss"] and a["weights_hash"] == b["weights_hash"]
took = b["allreduce"].get("overlap"), a["allreduce"].get("overlap")
print(f"overlap on {sys.argv[3]} GPUs, {sys.argv[4]}, graphs on, median of steps 11-30: off {ta:,.0f} tok/s, on {tb:,.0f} "
      f"tok/s, step time on/off {ta / tb:.3f} (the replicated gradients' all-reduce alone: {a['allreduce']['ms']:.3f} ms, "
      f"{a['allreduce']['bytes'] / 2**20:.1f} MiB); overlap flag on/off {took[0]}/{took[1]}; 30 steps' losses and weights "
      f"hash {'bit-identical' if same else 'DIFFER'}")
# the sums add in rank order whatever the buckets: on and off must give the same bits
sys.exit(0 if same and took == (1, 0) else 1)
EOF
  [ $? = 0 ] || bad=1
  rm -f "$tmp/overlap_off.json" "$tmp/overlap_on.json"
}
overlap "CUDA default size (batch 16 per rank)"
overlap "H 1024, F 2048, T 1024, batch 8 per rank" --hidden 1024 --ffn 2048 --seq 1024 --batch 8

# ---- torchrun ----
if command -v torchrun >/dev/null; then
  if timeout 300 torchrun --no-python --nproc-per-node "$n" "$bin" train --backend cuda --batch 4 --steps 5 \
    --log-every 5 >"$tmp/tr.out" 2>"$tmp/tr.err"; then
    echo "torchrun --nproc-per-node $n: ok, $(grep -E '^loss ' "$tmp/tr.out" | tail -1)"
  else
    echo "FAILED: torchrun --nproc-per-node $n moestash train (exit $?)"
    tail -5 "$tmp/tr.err"
    bad=1
  fi
fi
exit $bad
