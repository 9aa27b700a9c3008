# Sourced by scripts/ep-train-check.sh and scripts/pp-train-check.sh: the
# preamble of a multi-GPU measurement and its train runs. Expects bin (the
# moestash binary) and run_timeout (the seconds one train run may take);
# sets n (the GPUs; exits 77 below 2), tmp (removed at exit, its runs' output
# copied to $OUT/train-runs when OUT is set) and bad (1 once
# a run failed).
n=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$n" -ge 2 ] || { echo "skipped: $n GPUs"; exit 77; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT
tmp=$(mktemp -d)
# the runs' output kept under $OUT/train-runs (the device tool's folder) when
# set, so a run cut by a call's limit still says how far it got
keep_runs() {
  [ -n "${OUT:-}" ] && mkdir -p "$OUT/train-runs" && cp "$tmp"/*.out "$tmp"/*.err "$OUT/train-runs/" 2>/dev/null
  rm -rf "$tmp"
}
trap keep_runs EXIT
trap 'exit 143' TERM
bad=0
run() { # name, args...: a train run, its JSON in $tmp/name.json
  local name=$1
  shift
  if ! timeout "$run_timeout" "$bin" train --backend cuda "$@" --json "$tmp/$name.json" >"$tmp/$name.out" 2>"$tmp/$name.err"; then
    echo "FAILED: train $* (exit $?)"
    tail -5 "$tmp/$name.err"
    bad=1
    return 1
  fi
}
