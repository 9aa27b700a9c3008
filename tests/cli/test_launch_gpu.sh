#!/usr/bin/env bash
# The launcher on GPUs (CTest `launch_gpu`, label gpu; needs >= 2 GPUs, exit
# 77 below): one process per GPU, by this program's --gpus N and by torchrun
# (when it is installed).
#   - ep-hello: rendezvous, NCCL communicator and checked dispatch + combine
#     rounds on every GPU;
#   - a rank that aborts mid-run, or is killed from outside, while the others
#     wait for it inside NCCL: the launcher exits 1 within 30 s naming it, and
#     no rank process is left;
#   - train --gpus N (all GPUs) against one GPU with the same global batch
#     and --ep N:
#     the losses of 10 steps agree within 1e-3 relative (the contract of
#     test_train_ep: the replicated gradients are summed in another order,
#     so the runs drift apart by rounding);
#   - train --pp 2 (the pipeline grid) by --gpus and by torchrun against one
#     stage on one GPU.
# usage: test_launch_gpu.sh MOESTASH
set -uo pipefail
bin=$1
n=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$n" -ge 2 ] || { echo "skipped: $n GPUs, the launcher test needs 2"; exit 77; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT MOESTASH_FAIL_RANK MOESTASH_FAIL_AT MOESTASH_RDZV_PORT
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0 passed=0
ok() { passed=$((passed + 1)); }
no() { failed=$((failed + 1)); echo "FAIL: $*"; sed 's/^/  stderr: /' "$tmp/err" | tail -8; sed 's/^/  stdout: /' "$tmp/out" | tail -4; }
gone() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 1; done; return 0; }
rank_pids() { grep -oE '^rank [0-9]+ of [0-9]+: local rank [0-9]+, pid [0-9]+' "$tmp/out" | awk '{print $NF}'; }

timeout 180 "$bin" ep-hello --backend cuda --gpus "$n" --rounds 50 >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc = 0 ] && grep -qE "^ep-hello: $n ranks, .*: 50 dispatch \+ combine" "$tmp/out"; then ok
else no "ep-hello --gpus $n -> exit $rc (want 0 and rank 0's line)"; fi

if command -v torchrun >/dev/null; then
  timeout 180 torchrun --no-python --nproc-per-node "$n" "$bin" ep-hello --backend cuda --rounds 50 >"$tmp/out" 2>"$tmp/err"
  rc=$?
  if [ $rc = 0 ] && grep -qE "^ep-hello: $n ranks, .*: 50 dispatch \+ combine" "$tmp/out"; then ok
  else no "torchrun --nproc-per-node $n ep-hello -> exit $rc (want 0 and rank 0's line)"; fi
fi

t0=$SECONDS
MOESTASH_FAIL_RANK=1 MOESTASH_FAIL_AT=run timeout 180 "$bin" ep-hello --backend cuda --gpus "$n" --rounds 100000000 \
  >"$tmp/out" 2>"$tmp/err"
rc=$?
dt=$((SECONDS - t0))
if [ $rc = 1 ] && [ $dt -le 30 ] && grep -qF "rank 1 of $n failed (killed by signal 6" "$tmp/err" && gone $(rank_pids); then ok
else no "rank 1 aborting mid-run -> exit $rc after $dt s (want 1 within 30 s naming rank 1, no rank left)"; fi

"$bin" ep-hello --backend cuda --gpus "$n" --rounds 100000000 >"$tmp/out" 2>"$tmp/err" &
launcher=$!
for i in $(seq 600); do [ "$(grep -c '^rank [0-9]* of ' "$tmp/out")" = "$n" ] && break; sleep 0.1; done
sleep 10 # past NCCL's set-up: the ranks are in their rounds
victim=$(grep -E "^rank 1 of $n:" "$tmp/out" | awk '{print $NF}')
t0=$SECONDS
kill -9 "$victim"
( sleep 60; kill -9 "$launcher" 2>/dev/null ) &
guard=$!
wait "$launcher"; rc=$?; dt=$((SECONDS - t0))
kill "$guard" 2>/dev/null
if [ $rc = 1 ] && [ $dt -le 30 ] && grep -qF "rank 1 of $n failed (killed by signal 9" "$tmp/err" && gone $(rank_pids); then ok
else no "kill -9 of rank 1 mid-run -> launcher exit $rc after $dt s (want 1 within 30 s, no rank left)"; fi

# train on N GPUs against one GPU with the same global batch and --ep N
common=(train --backend cuda --steps 10 --log-every 10 --layers 2 --hidden 256 --ffn 512 --heads 4 --seq 128)
timeout 300 "$bin" "${common[@]}" --gpus "$n" --batch 4 --json "$tmp/two.json" >"$tmp/out" 2>"$tmp/err"
rc2=$?
timeout 300 "$bin" "${common[@]}" --ep "$n" --batch $((4 * n)) --json "$tmp/one.json" >>"$tmp/out" 2>>"$tmp/err"
rc1=$?
losses() { tr -d '\n ' <"$1" | grep -oE '"loss":\[[^]]*\]' | head -1 | sed 's/.*\[//; s/\]//' | tr ',' '\n'; }
if [ $rc2 = 0 ] && [ $rc1 = 0 ] && [ "$(losses "$tmp/two.json" | wc -l)" = 10 ] &&
  paste <(losses "$tmp/two.json") <(losses "$tmp/one.json") |
  awk '{ d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > m) m = r } END { print "  max relative loss difference " m; exit !(m <= 1e-3) }'; then ok
else no "train --gpus $n (exit $rc2) vs --ep $n on one GPU (exit $rc1): 10 losses within 1e-3 relative"; fi

# the pipeline grid through the launcher (processes, and torchrun): --pp 2 on 2 GPUs against one stage on
# one GPU, untied embeddings, 1F1B over 4 microbatches (test_train_pp's contract: step 1's loss the same
# bits; later steps within 1e-3: the gradient norm is summed per stage, another order), then --pp 2 on all
# N GPUs (N / 2 data-parallel ranks a stage) trains
pp=(train --backend cuda --steps 6 --log-every 6 --layers 2 --hidden 256 --ffn 512 --heads 4 --seq 128 --batch 4
    --microbatches 4 --schedule 1f1b --tie-embeddings off)
timeout 300 "$bin" "${pp[@]}" --pp 2 --gpus 2 --json "$tmp/pp2.json" >"$tmp/out" 2>"$tmp/err"
rc2=$?
timeout 300 "$bin" "${pp[@]}" --json "$tmp/pp1.json" >>"$tmp/out" 2>>"$tmp/err"
rc1=$?
if [ $rc2 = 0 ] && [ $rc1 = 0 ] && [ "$(losses "$tmp/pp2.json" | head -1)" = "$(losses "$tmp/pp1.json" | head -1)" ] &&
  paste <(losses "$tmp/pp2.json") <(losses "$tmp/pp1.json") |
  awk '{ d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); if (r > m) m = r } END { print "  --pp 2: max relative loss difference " m; exit !(m <= 1e-3) }'; then ok
else no "train --pp 2 --gpus 2 (exit $rc2) vs --pp 1 on one GPU (exit $rc1): step 1's loss the same, 6 within 1e-3"; fi
if command -v torchrun >/dev/null; then
  timeout 300 torchrun --no-python --nproc-per-node 2 "$bin" "${pp[@]}" --pp 2 --json "$tmp/pp2t.json" >"$tmp/out" 2>"$tmp/err"
  rc=$?
  if [ $rc = 0 ] && [ "$(losses "$tmp/pp2t.json")" = "$(losses "$tmp/pp2.json")" ]; then ok
  else no "torchrun --nproc-per-node 2 train --pp 2 -> exit $rc (want 0 and the losses of --pp 2 --gpus 2)"; fi
fi
if [ $((n % 2)) = 0 ] && [ "$n" -ge 4 ]; then
  timeout 300 "$bin" "${pp[@]}" --pp 2 --gpus "$n" --experts 16 >"$tmp/out" 2>"$tmp/err"
  rc=$?
  if [ $rc = 0 ] && grep -qF "memory by pipeline stage" "$tmp/out"; then ok
  else no "train --pp 2 --gpus $n -> exit $rc (want 0 and the table by stage)"; fi
fi

echo "launch_gpu: $passed passed, $failed failed"
[ $failed = 0 ]
