#!/usr/bin/env bash
# The launcher test (CTest `launch`, CPU): one process per rank through the
# hidden `moestash ep-hello --backend cpu` (the launch path of train --gpus N
# without the trainer).
#   - the launcher environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
#     MASTER_PORT): each bad, missing or inconsistent value is exit 2 with one
#     line naming the variable and its value, before any work;
#   - --gpus N starts N ranks that all get rank 0's id; ranks started by hand
#     with the variables set (as torchrun does) do too;
#   - a rank that fails at start, crashes mid-run or is killed from outside
#     takes every other rank down: the launcher exits 1 within a bound, naming
#     the rank and its status, and no rank process is left;
#   - SIGTERM to the launcher stops every rank;
#   - a rendezvous that never completes ends by its timeout, naming the rank;
#   - train reads the same environment (bad values, --gpus against
#     WORLD_SIZE, CPU ranks as processes refused, a world of one trains).
# usage: test_launch.sh MOESTASH
set -uo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0 passed=0
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT MOESTASH_FAIL_RANK MOESTASH_FAIL_AT MOESTASH_FAIL_CODE MOESTASH_RDZV_TIMEOUT \
  MOESTASH_RDZV_PORT TORCHELASTIC_USE_AGENT_STORE
hello=("$bin" ep-hello --backend cpu)

ok() { passed=$((passed + 1)); }
no() { failed=$((failed + 1)); echo "FAIL: $*"; sed 's/^/  stderr: /' "$tmp/err" | head -8; sed 's/^/  stdout: /' "$tmp/out" | head -8; }
port() { echo $((20000 + RANDOM % 40000)); }

# bad_env WANT VAR=VALUE... : exit 2, one stderr line containing WANT, no stdout
bad_env() {
  local want=$1; shift
  env "$@" timeout 20 "${hello[@]}" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines; lines=$(wc -l <"$tmp/err")
  if [ $rc = 2 ] && [ "$lines" = 1 ] && grep -qF -- "$want" "$tmp/err" && [ ! -s "$tmp/out" ]; then ok
  else no "env $* ep-hello -> exit $rc, $lines stderr lines (want 2, one line naming \"$want\", no stdout)"; fi
}
all=(RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500)
with() { # the good environment with one variable replaced (VAR=VALUE) or dropped (VAR)
  local out=() kv
  for kv in "${all[@]}"; do [ "${kv%%=*}" = "${1%%=*}" ] || out+=("$kv"); done
  [[ $1 == *=* ]] && out+=("$1")
  echo "${out[@]}"
}
bad_env "RANK='x': expected an integer" $(with RANK=x)
bad_env "RANK='-1': must be in" $(with RANK=-1)
bad_env "RANK='2': must be below WORLD_SIZE = 2" $(with RANK=2)
bad_env "WORLD_SIZE='0': must be in" $(with WORLD_SIZE=0)
bad_env "WORLD_SIZE='2x': expected an integer" $(with WORLD_SIZE=2x)
bad_env "LOCAL_RANK='1': must be at most RANK = 0" $(with LOCAL_RANK=1)
bad_env "LOCAL_RANK='': expected an integer" $(with LOCAL_RANK=)
bad_env "MASTER_PORT='70000': must be in [1, 65535]" $(with MASTER_PORT=70000)
bad_env "MASTER_PORT='http': expected an integer" $(with MASTER_PORT=http)
bad_env "MASTER_ADDR='': empty" $(with MASTER_ADDR=) 
bad_env "MASTER_PORT='': not set, but RANK is" $(with MASTER_PORT)
bad_env "RANK='': not set, but WORLD_SIZE is" $(with RANK)
bad_env "MOESTASH_RDZV_TIMEOUT='0': must be in" MOESTASH_RDZV_TIMEOUT=0
env "${all[@]}" timeout 20 "${hello[@]}" --gpus 3 >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc = 2 ] && grep -qF "rank 0: moestash ep-hello: --gpus '3': contradicts the launcher's WORLD_SIZE = 2" "$tmp/err"; then ok
else no "--gpus 3 under WORLD_SIZE=2 -> exit $rc (want 2 naming both)"; fi

# hello_ok N FILE: N ranks announced themselves, N equal id hashes
hello_ok() {
  local n=$1 f=$2
  [ "$(grep -cE '^rank [0-9]+ of '"$n"': local rank [0-9]+, pid [0-9]+$' "$f")" = "$n" ] &&
    [ "$(grep -E '^rank [0-9]+: id [0-9a-f]{16}$' "$f" | awk '{print $2}' | sort -u | wc -l)" = "$n" ] &&
    [ "$(grep -E '^rank [0-9]+: id ' "$f" | awk '{print $4}' | sort -u | wc -l)" = 1 ]
}
timeout 60 "${hello[@]}" --gpus 3 >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc = 0 ] && hello_ok 3 "$tmp/out"; then ok; else no "ep-hello --gpus 3 -> exit $rc (want 0, 3 ranks, one id)"; fi

# as torchrun starts them: the variables set, this program once per rank
p=$(port)
pids=()
for r in 0 1 2 3; do
  RANK=$r WORLD_SIZE=4 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$p timeout 60 "${hello[@]}" >"$tmp/out.$r" 2>"$tmp/err.$r" &
  pids+=($!)
done
rcs=""
for pid in "${pids[@]}"; do wait "$pid"; rcs+="$? "; done
cat "$tmp"/out.? >"$tmp/out"; cat "$tmp"/err.? >"$tmp/err"
if [ "$rcs" = "0 0 0 0 " ] && hello_ok 4 "$tmp/out"; then ok; else no "4 ranks from the environment -> exits $rcs (want 0, one id)"; fi

# gone PIDS...: none of these processes is left
gone() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 1; done; return 0; }
rank_pids() { grep -oE '^rank [0-9]+ of [0-9]+: local rank [0-9]+, pid [0-9]+' "$tmp/out" | awk '{print $NF}'; }

# fails RC ENV WANT_STDERR : launcher (--gpus 3 --rounds 6000) exits RC within 20 s naming the rank; every
# rank gone (RC 2 when the rank that failed exited 2: it refused its input)
fails() {
  local want_rc=$1 want=$2; shift 2
  local t0=$SECONDS
  env "$@" timeout 60 "${hello[@]}" --gpus 3 --rounds 6000 >"$tmp/out" 2>"$tmp/err"
  local rc=$? dt=$((SECONDS - t0))
  if [ $rc = "$want_rc" ] && [ $dt -le 20 ] && grep -qF -- "$want" "$tmp/err" && gone $(rank_pids); then ok
  else no "env $* ep-hello --gpus 3 --rounds 6000 -> exit $rc after ${dt} s (want $want_rc within 20 s, \"$want\", no rank left)"; fi
}
fails 1 "moestash ep-hello: rank 1 of 3 failed (exit code 3); stopping the other ranks" MOESTASH_FAIL_RANK=1 MOESTASH_FAIL_AT=start
fails 2 "moestash ep-hello: rank 1 of 3 failed (exit code 2); stopping the other ranks" MOESTASH_FAIL_RANK=1 \
  MOESTASH_FAIL_AT=start MOESTASH_FAIL_CODE=2
fails 1 "moestash ep-hello: rank 2 of 3 failed (killed by signal 6" MOESTASH_FAIL_RANK=2 MOESTASH_FAIL_AT=run
if grep -qF "rank 2: moestash ep-hello: failing on purpose (MOESTASH_FAIL_AT=run)" "$tmp/err"; then ok; else no "the failing rank's own line has no 'rank 2:' prefix"; fi

# killed from outside mid-run (every rank has met the others and holds)
# wait_lines N PATTERN FILE: up to 20 s for N lines
wait_lines() { local i; for i in $(seq 200); do [ "$(grep -cE "$2" "$3")" -ge "$1" ] && return 0; sleep 0.1; done; return 1; }
t0=$SECONDS
timeout 60 "${hello[@]}" --gpus 3 --rounds 6000 >"$tmp/out" 2>"$tmp/err" &
launcher=$!
wait_lines 3 '^rank [0-9]+: id ' "$tmp/out"
victim=$(grep -E '^rank 1 of 3:' "$tmp/out" | awk '{print $NF}')
kill -9 "$victim"
wait "$launcher"; rc=$?; dt=$((SECONDS - t0))
if [ $rc = 1 ] && [ $dt -le 20 ] && grep -qF "rank 1 of 3 failed (killed by signal 9" "$tmp/err" && gone $(rank_pids); then ok
else no "kill -9 of rank 1 mid-run -> launcher exit $rc after ${dt} s (want 1 within 20 s naming rank 1, no rank left)"; fi

# SIGTERM to the launcher alone (no `timeout` between: it would signal the ranks too)
"${hello[@]}" --gpus 2 --rounds 6000 >"$tmp/out" 2>"$tmp/err" &
launcher=$!
wait_lines 2 '^rank [0-9]+: id ' "$tmp/out"
kill -TERM "$launcher"
t0=$SECONDS
wait "$launcher"; rc=$?; dt=$((SECONDS - t0))
if [ $rc = 1 ] && [ $dt -le 10 ] && grep -qF "stopping the 2 ranks" "$tmp/err" && gone $(rank_pids); then ok
else no "SIGTERM to the launcher -> exit $rc after ${dt} s (want 1 within 10 s, no rank left)"; fi

# a rendezvous that never completes: bounded, naming the rank
rdzv() {
  local want=$1; shift
  local t0=$SECONDS
  env MOESTASH_RDZV_TIMEOUT=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(port) "$@" timeout 30 "${hello[@]}" >"$tmp/out" 2>"$tmp/err"
  local rc=$? dt=$((SECONDS - t0))
  if [ $rc = 1 ] && [ $dt -le 5 ] && grep -qF -- "$want" "$tmp/err"; then ok
  else no "rendezvous $* -> exit $rc after ${dt} s (want 1 within 5 s, \"$want\")"; fi
}
rdzv "rank 1: moestash ep-hello: rendezvous: rank 1: no connection to rank 0 at 127.0.0.1:" RANK=1 LOCAL_RANK=0
rdzv "rank 0: moestash ep-hello: rendezvous: rank 0: 1 of 2 ranks joined at 127.0.0.1:" RANK=0 LOCAL_RANK=0
# beside torchrun's agent store (it holds MASTER_PORT): the port after it, or MOESTASH_RDZV_PORT
rdzv "no connection to rank 0 at 127.0.0.1:29501 within 1000 ms" RANK=1 LOCAL_RANK=0 MASTER_PORT=29500 TORCHELASTIC_USE_AGENT_STORE=True
rdzv "no connection to rank 0 at 127.0.0.1:31001 within 1000 ms" RANK=1 LOCAL_RANK=0 MASTER_PORT=29500 TORCHELASTIC_USE_AGENT_STORE=True MOESTASH_RDZV_PORT=31001
bad_env "MOESTASH_RDZV_PORT='0': must be in [1, 65535]" $(with RANK=0) MOESTASH_RDZV_PORT=0

# train reads the same environment
train_bad() { # WANT ENV... -- ARGS...
  local want=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 20 "$bin" train --backend cpu "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines; lines=$(wc -l <"$tmp/err")
  if [ $rc = 2 ] && [ "$lines" = 1 ] && grep -qF -- "$want" "$tmp/err" && [ ! -s "$tmp/out" ]; then ok
  else no "env ${envs[*]} train --backend cpu $* -> exit $rc, $lines stderr lines (want 2, one line \"$want\", no stdout)"; fi
}
train_bad "moestash train: environment MASTER_PORT='0': must be in [1, 65535]" $(with MASTER_PORT=0) --
train_bad "moestash train: environment LOCAL_RANK='': not set, but RANK is" $(with LOCAL_RANK) --
train_bad "rank 0: moestash train: --gpus '4': contradicts the launcher's WORLD_SIZE = 2" "${all[@]}" -- --gpus 4
train_bad "rank 0: moestash train: --backend 'cpu': ranks as processes (RANK, WORLD_SIZE set) need --backend cuda" "${all[@]}" --
# a launched world of one rank trains as one process
env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(port) timeout 120 "$bin" train --backend cpu \
  --steps 2 --quiet >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc = 0 ] && grep -qE '^loss [0-9.]+ -> [0-9.]+ .* in 2 steps' "$tmp/out"; then ok
else no "train as the one rank of WORLD_SIZE=1 -> exit $rc (want 0 and the loss line)"; fi

echo "launch: $passed passed, $failed failed"
[ $failed = 0 ]
