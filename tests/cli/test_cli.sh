#!/usr/bin/env bash
# The CLI test (CTest `cli`, CPU): every bad input of `moestash` gets exit
# code 2, exactly one line on stderr naming the flag (or argument) and its
# value, and nothing on stdout (no work started); then the conventions:
# --flag=value, --version, help COMMAND, bench --help, a --json written.
# usage: test_cli.sh MOESTASH
set -uo pipefail
bin=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkfifo "$tmp/fifo"
failed=0 passed=0

# bad ARGS... : exit 2, one stderr line containing $want, empty stdout
bad() {
  local want=$1; shift
  timeout 20 "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines; lines=$(wc -l <"$tmp/err")
  if [ $rc = 2 ] && [ "$lines" = 1 ] && grep -qF -- "$want" "$tmp/err" && [ ! -s "$tmp/out" ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL: moestash $* -> exit $rc, $lines stderr lines (want exit 2, 1 line naming '$want', no stdout)"
    sed 's/^/  stderr: /' "$tmp/err" | head -5
    sed 's/^/  stdout: /' "$tmp/out" | head -5
  fi
}
# good WANT_STDOUT ARGS... : exit 0, stdout contains WANT_STDOUT
good() {
  local want=$1; shift
  timeout 120 "$bin" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc = 0 ] && grep -qF -- "$want" "$tmp/out"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL: moestash $* -> exit $rc (want 0 and '$want' on stdout)"
    sed 's/^/  /' "$tmp/err" | head -5
  fi
}

# train: files
bad "--data '$tmp'" train --data "$tmp"
bad "--data '$tmp/fifo'" train --data "$tmp/fifo"
bad "--data '$tmp/missing'" train --data "$tmp/missing"
bad "--json '$tmp/no/such/dir.json'" train --json "$tmp/no/such/dir.json"
bad "--json '$tmp'" train --json "$tmp"
bad "--json '$tmp/fifo'" train --json="$tmp/fifo"
if [ "$(id -u)" != 0 ]; then # root reads and writes past the mode bits
  : >"$tmp/unreadable" && chmod 000 "$tmp/unreadable"
  bad "--data '$tmp/unreadable': cannot read: Permission denied" train --data "$tmp/unreadable"
fi
# train: values
bad "--steps 'abc'" train --steps=abc
bad "--steps '10x': expected an integer" train --steps 10x
bad "--seq '8.5': expected an integer" train --seq 8.5
bad "--steps '0'" train --steps 0
bad "--steps ''" train --steps
bad "--hidden '65536" train --hidden 65536 --heads 8
bad "--seq '8192 --batch 16384': needs at least" train --seq 8192 --batch 16384
bad "--resume" train --resume "$tmp/no-checkpoint"
bad "--recompute-granularity 'half'" train --recompute-granularity half
bad "--optimizer-shard 'maybe': expected off or on" train --optimizer-shard maybe
bad "--adam-moments 'fp16': expected fp32 or bf16" train --adam-moments fp16
# train on N ranks
bad "--gpus '0'" train --backend cpu --gpus 0
bad "--ep '3': on --gpus N ranks" train --backend cpu --gpus 2 --ep 3
bad "--gpus '4': the ranks share the 6 experts (--experts)" train --backend cpu --gpus 4 --experts 6
bad "--gpus '3': the ranks share the 8 experts (--experts)" train --backend cpu --gpus 3
# the pipeline grid (--pp P of --gpus N): refused before any work, one line naming --pp
bad "--pp 2: must divide --layers 3" train --backend cpu --pp 2 --gpus 2 --layers 3
bad "--pp 2: must divide --gpus 3" train --backend cpu --pp 2 --gpus 3
bad "--pp 4: must divide --gpus 2" train --backend cpu --pp 4 --gpus 2 --layers 4
bad "--pp 2: the 3 data-parallel ranks of a stage" train --backend cpu --pp 2 --gpus 6
bad "--pp 2: with --schedule interleaved (2 chunks a stage) P x 2 must divide --layers + 1 = 5" train --backend cpu --pp 2 --gpus 2 --schedule interleaved --layers 4
bad "--pp '0'" train --backend cpu --pp 0
bad "--attention 'fast'" train --attention fast
bad "--attention cudnn: backend cpu has no cuDNN attention" train --backend cpu --attention cudnn
bad "--kv-heads 3: must divide --heads 4" train --kv-heads 3
bad "--kv-heads '0'" train --kv-heads 0
bad "--head-dim 7: expected an even number" train --head-dim 7
bad "--head-dim 'x'" train --head-dim x
bad "--rope-theta '0'" train --rope-theta 0
bad "--norm-topk-prob 'maybe'" train --norm-topk-prob maybe
bad "--tie-embeddings 'yes'" train --tie-embeddings yes
bad "--vocab '1'" train --vocab 1
bad "--preset 'qwen3'" train --preset qwen3
bad "--hidden '131072" train --preset qwen3-30b-a3b --hidden 131072
bad "--hidden '2048 (with --ffn 768 --experts 128 --layers 48)': needs at least" train --preset qwen3-30b-a3b --backend cpu
bad "--gpus '3': the ranks share the 128 experts (--experts)" train --preset qwen3-30b-a3b --backend cpu --gpus 3 --layers 2
bad "--save-every '3': needs --save" train --save-every 3
bad "--model" sample --prompt x
bad "--prompt" sample --checkpoint "$tmp"
bad "--lr 'nan'" train --lr nan
bad "--quiet '1'" train --quiet=1
bad "--bogus" train --bogus 1
bad "'stray'" train stray
bad "--backend 'tpu'" train --backend tpu
bad "--schedule 'zigzag'" train --schedule zigzag
bad "--policy 'sometimes'" train --policy sometimes
bad "--policy 'act_input=recompute': policy spec 'act_input=recompute': item 'act_input=recompute': only fc2_input" train --policy act_input=recompute
bad "--recompute 'all'" train --recompute all
bad "--graph 'on'" train --graph on --backend cpu
bad "--force-overflow '5'" train --force-overflow 5 --steps 2
bad "--preset 'a100'" train --preset a100
bad "--eval-fraction '1'" train --eval-fraction=1
bad "--plot '$tmp'" train --plot "$tmp"
bad "--eval-data '$tmp'" train --eval-data "$tmp"
bad "--recompute-granularity 'half'" train --recompute-granularity half
bad "--save-every '3'" train --save-every 3
# train --memory-budget: SIZE, and a budget no plan fits (the smallest peak)
bad "--memory-budget '20XB'" train --memory-budget 20XB
bad "--memory-budget '-5MiB'" train --memory-budget -5MiB
bad "--memory-budget '0'" train --memory-budget 0
bad "--memory-budget '1.5'" train --memory-budget 1.5
bad "--memory-budget 'GiB'" train --memory-budget GiB
bad "--memory-budget '1e400'" train --memory-budget 1e400
bad "--memory-budget '12 GiB'" train --memory-budget "12 GiB"
bad "--memory-budget ''" train --memory-budget
bad "--memory-budget '2GiB': contradicts --policy" train --memory-budget 2GiB --policy stash
bad "--memory-budget '2GiB': contradicts --check-policies" train --memory-budget=2GiB --check-policies
bad "the smallest peak that would is" train --backend cpu --quiet --steps 2 --seq 8 --batch 2 --layers 1 --memory-budget 1KiB
good "memory plan for --memory-budget 64.00 MiB" train --backend cpu --steps 2 --seq 8 --batch 2 --layers 1 \
  --memory-budget 64MiB --json "$tmp/plan.json"
if python3 - "$tmp/plan.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
p = d["plan"]
assert d["config"]["policy"] == "planned" and p["budget"] == 64 << 20, p
assert 0 < p["measured_peak"] <= p["budget"] and abs(p["predicted_peak"] - p["measured_peak"]) <= 0.05 * p["measured_peak"], p
assert len(p["policy"]["fc1_input"]) == 2 and p["granularity"] in ("full", "moe"), p
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --memory-budget --json: no plan"; fi
# train --memory-budget on 2 rank threads: a budget between the all-OFFLOAD and
# the all-KEEP peak (max over the ranks) plans one plan for both ranks (rank 0
# prints it), every rank's peak within it, the losses and weights KEEP's; a
# budget no plan fits: exit 2, one line naming the smallest peak (no rank
# hangs). Pools of 1.5 times the pages counted: no overflow rerun (whose
# measuring step, with the sized pools held, no plan predicts).
r2="--backend cpu --gpus 2 --quiet --steps 3 --seq 32 --batch 4 --layers 2 --hidden 32 --heads 2 --ffn 64 --experts 4
  --microbatches 2 --pool-factor 1.5"
# shellcheck disable=SC2086
bad "rank 0: --memory-budget 1024 (0.00 MiB): no plan fits; the smallest peak that would is" train $r2 --memory-budget 1KiB
# shellcheck disable=SC2086
if timeout 60 "$bin" train $r2 --json "$tmp/keep2.json" >/dev/null 2>&1 &&
  timeout 60 "$bin" train $r2 --policy offload --json "$tmp/off2.json" >/dev/null 2>&1 &&
  budget=$(python3 -c "import json,sys; p=[json.load(open(f))['memory_bytes']['backend_peak_max_over_ranks'] for f in sys.argv[1:]]; assert p[1] < p[0], p; print((p[0] + p[1]) // 2)" "$tmp/keep2.json" "$tmp/off2.json") &&
  timeout 60 "$bin" train $r2 --memory-budget "$budget" --json "$tmp/plan2.json" >"$tmp/plan2.out" 2>&1 &&
  python3 - "$tmp/keep2.json" "$tmp/plan2.json" "$budget" <<'PY'
import json, sys
k, d, budget = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
p = d["plan"]
assert d["ranks"] == 2 and d["config"]["policy"] == "planned" and p["budget"] == budget and d["reruns"] == 0, d
assert len(p["measured_peak_per_rank"]) == 2 and max(p["measured_peak_per_rank"]) == p["measured_peak"] <= budget, p
assert abs(p["predicted_peak"] - p["measured_peak"]) <= 0.05 * p["measured_peak"], p
assert any(x != "keep" for n in p["policy"].values() for x in n), p  # the budget binds
assert d["loss"] == k["loss"] and d["mtp_loss"] == k["mtp_loss"] and d["weights_hash"] == k["weights_hash"], (d["loss"], k["loss"])
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --gpus 2 --memory-budget: see above"; head -5 "$tmp/plan2.out" 2>/dev/null; fi
# train --memory-budget on a pipeline (--pp 2 --gpus 2): each stage plans its
# own layers. A budget no plan of stage 0 fits: exit 2, one line naming the
# budget, the stage and the smallest peak, on every rank alike. A budget
# between the stages' KEEP peaks (as the planner predicts them at a budget
# nothing binds): stage 1 all KEEP, stage 0 not; every rank's peak within it,
# the losses and weights those of the run without a budget; the table shows
# the stage of each layer.
pp2="--backend cpu --pp 2 --gpus 2 --quiet --steps 3 --seq 64 --batch 8 --layers 6 --hidden 32 --heads 2 --ffn 128
  --experts 4 --microbatches 4 --pool-factor 1.5"
# shellcheck disable=SC2086
bad "rank 0: --memory-budget 1024 (0.00 MiB): no plan fits pipeline stage 0 of 2; the smallest peak that would is" train $pp2 --memory-budget 1KiB
# shellcheck disable=SC2086
if timeout 60 "$bin" train $pp2 --json "$tmp/ppkeep.json" >/dev/null 2>&1 &&
  timeout 60 "$bin" train $pp2 --memory-budget 1TiB --json "$tmp/ppbig.json" >/dev/null 2>&1 &&
  budget=$(python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['stages']; k=[x['plan']['keep_peak'] for x in s]; assert k[0] > k[1], k; print((k[0] + k[1]) // 2)" "$tmp/ppbig.json") &&
  timeout 60 "$bin" train ${pp2/--quiet/} --memory-budget "$budget" --json "$tmp/pp.json" >"$tmp/pp.out" 2>&1 &&
  grep -q "each of the 2 pipeline stages planned its own layers" "$tmp/pp.out" && grep -qE "^  stage +0 +0 +0 +1 +1 +1 +1$" "$tmp/pp.out" &&
  python3 - "$tmp/ppkeep.json" "$tmp/pp.json" "$budget" <<'PY'
import json, sys
k, d, budget = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3])
s = d["stages"]
assert d["config"]["policy"] == "planned" and d["plan"]["budget"] == budget and d["reruns"] == 0, d["plan"]
assert [x["plan"]["layers"] for x in s] == [[0, 1, 2], [3, 4, 5, 6]], s
kept = [all(v == "keep" for n in x["plan"]["policy"].values() for v in n) for x in s]
assert kept == [False, True], kept
for x in s:
    assert 0 < x["backend_peak_max"] <= budget, x
    assert abs(x["plan"]["predicted_peak"] - x["backend_peak_max"]) <= 0.05 * x["backend_peak_max"], x
assert d["loss"] == k["loss"] and d["mtp_loss"] == k["mtp_loss"] and d["weights_hash"] == k["weights_hash"], (d["loss"], k["loss"])
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --pp 2 --gpus 2 --memory-budget: see above"; head -5 "$tmp/pp.out" 2>/dev/null; fi
if timeout 300 "$bin" train --check-policies --steps 2 --json "$tmp/cp.json" >/dev/null 2>&1 &&
  python3 -c "import json,sys; d=json.load(open('$tmp/cp.json')); r=d['check_policies']; sys.exit(0 if len(r)==7 and d['all_bit_identical'] and all(x['verdict'] in ('reference','bit-identical') and len(x['loss'])==2 for x in r) else 1)"; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL: train --check-policies --json: no JSON of 7 bit-identical runs"
fi
# the other commands
bad "--model" sample --prompt hi
bad "--tokens 'x'" sample --tokens=x
bad "--bogus" sample --bogus
# sample: a Hugging Face Qwen3-MoE directory made here (random F32 weights,
# the hub's names), vocabulary 300: token ids in and out
mkmodel() { # mkmodel DIR VOCAB
  mkdir -p "$1" && python3 - "$@" <<'PY'
import json, random, struct, sys
d, V = sys.argv[1], int(sys.argv[2])
H, F, NH, KV, D, L, E = 16, 8, 2, 1, 8, 2, 4
json.dump({"model_type": "qwen3_moe", "vocab_size": V, "hidden_size": H, "moe_intermediate_size": F,
           "num_hidden_layers": L, "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": D,
           "num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True, "tie_word_embeddings": False,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0}, open(d + "/config.json", "w"))
t = [("model.embed_tokens.weight", [V, H]), ("model.norm.weight", [H]), ("lm_head.weight", [V, H])]
for l in range(L):
    p = "model.layers.%d." % l
    t += [(p + "input_layernorm.weight", [H]), (p + "post_attention_layernorm.weight", [H]),
          (p + "self_attn.q_proj.weight", [NH * D, H]), (p + "self_attn.k_proj.weight", [KV * D, H]),
          (p + "self_attn.v_proj.weight", [KV * D, H]), (p + "self_attn.o_proj.weight", [H, NH * D]),
          (p + "self_attn.q_norm.weight", [D]), (p + "self_attn.k_norm.weight", [D]), (p + "mlp.gate.weight", [E, H])]
    for e in range(E):
        q = p + "mlp.experts.%d." % e
        t += [(q + "gate_proj.weight", [F, H]), (q + "up_proj.weight", [F, H]), (q + "down_proj.weight", [H, F])]
head, data, at = {}, b"", 0
for name, shape in t:
    n = shape[0] * (shape[1] if len(shape) > 1 else 1)
    data += struct.pack("<%df" % n, *[random.uniform(-0.5, 0.5) + (len(shape) == 1) for _ in range(n)])
    head[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + 4 * n]}
    at += 4 * n
h = json.dumps(head).encode()
h += b" " * (-len(h) % 8)
open(d + "/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + data)
PY
}
mkmodel "$tmp/m300" 300
bad "--prompt-ids '1,,2': expected token ids" sample --model "$tmp/m300" --prompt-ids 1,,2
bad "--prompt-ids '3,300': token 300 is not below the model's vocabulary (300)" sample --model "$tmp/m300" --prompt-ids 3,300
bad "--prompt 'hi': text needs a byte model" sample --model "$tmp/m300" --prompt hi
bad "--prompt-ids '1': contradicts --prompt" sample --model "$tmp/m300" --prompt hi --prompt-ids 1
bad "--model '$tmp': '$tmp/config.json'" sample --model "$tmp" --prompt-ids 1
good "" sample --model "$tmp/m300" --prompt-ids 5,17,299 --tokens 6 --temperature 0 --json "$tmp/s.json"
if [[ $(cat "$tmp/out") =~ ^[0-9]+( [0-9]+){5}$ ]] && python3 - "$tmp/s.json" "$(cat "$tmp/out")" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["prompt_ids"] == [5, 17, 299] and d["ids"] == [int(x) for x in sys.argv[2].split()], d
assert all(0 <= x < 300 for x in d["ids"]), d
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: sample --prompt-ids: not one line of 6 ids, or --json differs"; fi
bad "--bogus" info --bogus
bad "'extra'" info extra
bad "--bogus" selfcheck --bogus
bad "--backend 'tpu'" selfcheck --backend tpu
if "$bin" info | grep -q "^backend cuda: not available"; then
  bad "--backend 'cuda': not available" selfcheck --backend cuda
fi
bad "'nope'" bench nope
bad "--bogus" bench step --bogus
bad "--json '$tmp'" bench step --json "$tmp"
bad "--backend 'tpu'" bench step --backend=tpu
bad "'nope'" help nope
bad "'frob'" frob

# conventions
good "moestash $("$bin" --version | sed -n 's/^moestash \([0-9.]*\).*/\1/p')" --version
good "usage: moestash train" help train
good "usage: moestash train" train --help
good "step" bench --help
good "optim" bench --help
good "usage: moestash bench optim" help bench optim
good "step, bf16 moments" bench optim --backend cpu --params 100003 --reps 1
good "usage: moestash bench step" help bench step
good "selfcheck cpu : grouped linear forward" selfcheck --backend=cpu
good "memory (MiB), max over the ranks" train --backend cpu --gpus 2 --steps 2 --seq 8 --batch 1 --layers 1 \
  --timeline "$tmp/ranks-tl.svg" --plot "$tmp/ranks-loss.svg"
if [ -s "$tmp/ranks-tl.svg" ] && [ -s "$tmp/ranks-tl-keep.svg" ] && [ -s "$tmp/ranks-loss.svg" ] &&
  grep -q "</svg>" "$tmp/ranks-loss.svg"; then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --gpus 2 --timeline/--plot: no SVGs"; fi
good "bit-identical" train --backend cpu --gpus 2 --check-policies --steps 2 --seq 8 --batch 1 --layers 1
# the pipeline grid trains: --pp 2 on 2 and 4 rank threads, 1F1B over 4 microbatches
good "loss 5." train --backend cpu --pp 2 --gpus 2 --steps 3 --seq 8 --batch 1 --microbatches 4 --quiet
good "loss 5." train --backend cpu --pp 2 --gpus 4 --steps 3 --seq 8 --batch 1 --microbatches 4 --quiet
# checkpoints on 2 ranks: one model directory (rank 0 the replicated tensors, each rank its experts, in
# shards of their own, an index); the run resumed from step 2 ends with the losses of steps 3-4 and the
# weights hash of the run that went through; another rank count is refused; sample reads it
r2="--backend cpu --gpus 2 --seq 8 --batch 1 --layers 1 --quiet"
if timeout 120 "$bin" train $r2 --steps 4 --save "$tmp/ck2" --save-every 2 --json "$tmp/ck2-a.json" >/dev/null 2>&1 &&
  [ -s "$tmp/ck2/step-2/model.safetensors.index.json" ] && [ -s "$tmp/ck2/step-2/model-00002-of-00002.safetensors" ] &&
  timeout 120 "$bin" train --backend cpu --gpus 2 --resume "$tmp/ck2/step-2" --quiet --json "$tmp/ck2-b.json" >/dev/null 2>&1 &&
  python3 -c "import json,sys; a=json.load(open('$tmp/ck2-a.json')); b=json.load(open('$tmp/ck2-b.json')); sys.exit(0 if a['loss'][2:]==b['loss'][-2:] and len(b['loss'])>=2 and a['weights_hash']==b['weights_hash'] else 1)"; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  echo "FAIL: train --gpus 2 --save, then --resume step-2: not the losses and weights of the run that went through"
fi
bad "saved by 2 ranks, this run has 1" train --backend cpu --resume "$tmp/ck2/step-2"
bad "saved by 2 ranks, this run has 4" train --backend cpu --gpus 4 --resume "$tmp/ck2/step-2"
good "ab" sample --checkpoint "$tmp/ck2/final" --prompt ab --tokens 2
# token files (llm.c .bin: 256 x int32 header, magic 20240520, version 1,
# count; uint16 tokens): a bad one is refused before any work, naming the
# file and the offset (exit 2, one line, no --json, no --save directory)
mkbin() { # mkbin FILE VERSION COUNT TOKENS... (the tokens as written, any count)
  python3 - "$@" <<'PY'
import struct, sys
f, version, count, toks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(t) for t in sys.argv[4:]]
open(f, "wb").write(struct.pack("<256i", 20240520, version, count, *([0] * 253)) + struct.pack("<%dH" % len(toks), *toks))
PY
}
toks=$(for i in $(seq 300); do echo $(( (i * 37) % 256 )); done)
mkbin "$tmp/good.bin" 1 300 $toks
mkbin "$tmp/version.bin" 2 300 $toks
mkbin "$tmp/short.bin" 1 301 $toks
mkbin "$tmp/vocab.bin" 1 300 $(echo "$toks" | sed '7s/.*/256/')
nothing_written() { # after a bad(): the --json file and --save directory absent
  if [ ! -e "$tmp/tok.json" ] && [ ! -e "$tmp/tok-save" ]; then passed=$((passed + 1))
  else failed=$((failed + 1)); echo "FAIL: a refused token file still wrote --json or --save"; rm -rf "$tmp/tok.json" "$tmp/tok-save"; fi
}
bad "--data '$tmp/version.bin': offset 4: version 2, expected 1" train --backend cpu --data "$tmp/version.bin" --json "$tmp/tok.json" --save "$tmp/tok-save"
nothing_written
bad "--data '$tmp/short.bin': offset 1624: truncated" train --backend cpu --data "$tmp/short.bin" --json "$tmp/tok.json" --save "$tmp/tok-save"
nothing_written
bad "--eval-data '$tmp/vocab.bin': offset 1036: token 256 is not below the vocabulary (256)" train --backend cpu \
  --eval-data "$tmp/vocab.bin" --json "$tmp/tok.json" --save "$tmp/tok-save"
nothing_written
echo "some text, not tokens" >"$tmp/nomagic.bin"
bad "--data '$tmp/nomagic.bin': offset 0: magic" train --backend cpu --data "$tmp/nomagic.bin"
good "eval loss" train --backend cpu --steps 2 --seq 8 --batch 2 --layers 1 --quiet --data "$tmp/good.bin" --eval-data "$tmp/good.bin"
# eval: the model's loss on a token file's windows (through the trainer's forward)
mkbin "$tmp/v300.bin" 1 300 $(echo "$toks" | sed '9s/.*/300/')
bad "--model" eval --data "$tmp/good.bin"
bad "--data" eval --model "$tmp/m300"
bad "--seq '1'" eval --model "$tmp/m300" --data "$tmp/good.bin" --seq 1
bad "--data '$tmp/v300.bin': offset 1040: token 300 is not below the vocabulary (300)" eval --backend cpu --model "$tmp/m300" --data "$tmp/v300.bin" --json "$tmp/e.json"
bad "--windows 34: '$tmp/good.bin' holds 33 windows" eval --backend cpu --model "$tmp/m300" --data "$tmp/good.bin" --seq 8 --windows 34
bad "'$tmp/config.json'" eval --backend cpu --model "$tmp" --data "$tmp/good.bin"
if [ -e "$tmp/e.json" ]; then failed=$((failed + 1)); echo "FAIL: eval refused its data but wrote --json"; fi
good "eval loss" eval --backend cpu --model "$tmp/m300" --data "$tmp/good.bin" --seq 8 --batch 3 --json "$tmp/e.json"
if python3 - "$tmp/e.json" <<'PY'
import json, math, sys
d = json.load(open(sys.argv[1]))
assert d["windows"] == 33 and d["tokens"] == 33 * 8 and d["seq"] == 8 and len(d["window_loss"]) == 33, d
assert math.isfinite(d["loss"]) and abs(sum(d["window_loss"]) / 33 - d["loss"]) < 1e-9 * d["loss"], d
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: eval --json: not 33 windows of 8 with their mean"; fi
good "eval loss" eval --backend cpu --model "$tmp/ck2/final" --data "$tmp/good.bin" --seq 8 # what train --save wrote (2 ranks)
corpus=$tmp/a\"corpus.txt # a quote in the name: escaped in the JSON
for i in $(seq 200); do echo "the quick brown fox jumps over the lazy dog $i"; done >"$corpus"
good "loss" train --backend=cpu --steps=2 --seq=8 --batch=2 --layers=1 --quiet --data="$corpus" --json="$tmp/run.json"
# the JSON: strict (no NaN), the data source and policies by name
if python3 - "$tmp/run.json" "$corpus" <<'PY'
import json, sys
def no_constant(c): raise ValueError("non-finite number " + c)
d = json.load(open(sys.argv[1]), parse_constant=no_constant)
c = d["config"]
assert c["data"] == sys.argv[2] and c["schedule"] == "plain" and c["policy"] == "keep" and c["recompute"] == "none", c
assert None in d["eval_loss"], "no evaluation: eval_loss is null"
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --json=FILE"; fi
# --policy parsed once by the CLI: the run's values, printed in the spec syntax
good "loss" train --backend cpu --steps 2 --seq 8 --batch 2 --layers 1 --quiet --policy act_input=stash --json "$tmp/pol.json"
if python3 -c 'import json, sys; p = json.load(open(sys.argv[1]))["config"]["policy"]
assert p == "fc1_input=keep,act_input=stash,fc2_input=keep,probs=keep", p' "$tmp/pol.json"
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --policy act_input=stash: the JSON's policy"; fi
# progress lines reach a pipe as they are printed: the header shows while
# the run (no step lines before its end) still goes on
"$bin" train --backend cpu --steps 100000 --seq 8 --batch 2 --layers 1 --log-every 100000 >"$tmp/fifo" 2>/dev/null &
pid=$!
exec 3<"$tmp/fifo"
if read -r -t 20 line <&3 && [[ $line == "moestash train on"* ]] && kill -0 $pid 2>/dev/null; then
  passed=$((passed + 1))
else
  failed=$((failed + 1)); echo "FAIL: no progress line through a pipe while the run goes on"
fi
kill $pid 2>/dev/null; wait $pid 2>/dev/null
exec 3<&-

# --init-from: a Hugging Face directory made here from a checkpoint (F32 and F16 tensors train); flags
# that contradict its config.json and damaged directories: exit 2, one line naming the file, nothing written
hf1="--backend cpu --steps 1 --seq 8 --batch 2 --layers 1 --quiet"
# shellcheck disable=SC2086
timeout 60 "$bin" train $hf1 --hidden 64 --save "$tmp/hf0" >/dev/null 2>&1
mkhf() { # mkhf KIND DIR: the model set of $tmp/hf0/final rewritten (KIND: f32 f16 llama missing shape extra gap truncated)
  python3 - "$tmp/hf0/final" "$2" "$1" <<'PY'
import json, os, struct, sys
src, dst, kind = sys.argv[1:4]
b = open(src + "/model.safetensors", "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h, data = json.loads(b[8:8 + n]), b[8 + n:]
ts = [(k, v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in h.items() if k != "__metadata__"]
def conv(r, fmt):  # bf16 bytes -> F32 / F16 bytes
    xs = [struct.unpack("<f", struct.pack("<I", x << 16))[0] for x in struct.unpack("<%dH" % (len(r) // 2), r)]
    return struct.pack("<%d%s" % (len(xs), fmt), *xs)
if kind in ("f32", "f16"):
    ts = [(k, kind.upper(), s, conv(r, "f" if kind == "f32" else "e")) for k, d, s, r in ts]
if kind == "missing":
    ts = [t for t in ts if t[0] != "model.norm.weight"]
if kind == "shape":
    ts = [(k, d, [s[0] // 2], r[:len(r) // 2]) if k == "model.norm.weight" else (k, d, s, r) for k, d, s, r in ts]
if kind == "extra":
    ts.append(("model.layers.0.mlp.shared_expert.weight", "BF16", [2], b"\0" * 4))
hdr, off, out = {}, 0, b""
for i, (k, d, s, r) in enumerate(ts):
    gap = 2 if kind == "gap" and i == 1 else 0
    hdr[k] = {"dtype": d, "shape": s, "data_offsets": [off + gap, off + gap + len(r)]}
    off += gap + len(r)
    out += b"\0" * gap + r
j = json.dumps(hdr).encode()
j += b" " * (-len(j) % 8)
os.makedirs(dst, exist_ok=True)
cfg = json.load(open(src + "/config.json"))
if kind == "llama":
    cfg["model_type"] = "llama"
json.dump(cfg, open(dst + "/config.json", "w"))
f = dst + "/model.safetensors"
open(f, "wb").write(struct.pack("<Q", len(j)) + j + out)
if kind == "truncated":
    os.truncate(f, os.path.getsize(f) - 10)
PY
}
for k in f32 f16 llama missing shape extra gap truncated; do mkhf $k "$tmp/hf-$k"; done
# shellcheck disable=SC2086
good "loss" train $hf1 --init-from "$tmp/hf-f32" --save "$tmp/hf-out"
[ -s "$tmp/hf-out/final/model.safetensors" ] && passed=$((passed + 1)) || { failed=$((failed + 1)); echo "FAIL: --init-from then --save: no model"; }
# --aux-coef is a training choice: it overrides the directory's router_aux_loss_coef (saved in the new config.json)
good "loss" train $hf1 --init-from "$tmp/hf-f32" --aux-coef 0.0123 --save "$tmp/hf-aux"
grep -q '"router_aux_loss_coef": 0.0123' "$tmp/hf-aux/final/config.json" && passed=$((passed + 1)) ||
  { failed=$((failed + 1)); echo "FAIL: --init-from --aux-coef 0.0123: $(grep -o '"router_aux_loss_coef": [^,]*' "$tmp/hf-aux/final/config.json")"; }
# shellcheck disable=SC2086
good "loss" train $hf1 --init-from "$tmp/hf-f16"
good "ab" sample --checkpoint "$tmp/hf-f32" --prompt ab --tokens 2
# shellcheck disable=SC2086
{
  bad "--hidden '128': contradicts hidden_size 64 of $tmp/hf-f32/config.json" train $hf1 --init-from "$tmp/hf-f32" --hidden 128 --save "$tmp/never"
  bad "--experts '4': contradicts num_experts 8" train $hf1 --init-from "$tmp/hf-f32" --experts 4 --save "$tmp/never"
  bad "model_type is 'llama'" train $hf1 --init-from "$tmp/hf-llama" --save "$tmp/never"
  bad "no tensor 'model.norm.weight' (missing)" train $hf1 --init-from "$tmp/hf-missing" --save "$tmp/never"
  bad "$tmp/hf-shape/model.safetensors': tensor 'model.norm.weight' has shape [32], config.json makes it [64]" train $hf1 --init-from "$tmp/hf-shape" --save "$tmp/never"
  bad "tensor 'model.layers.0.mlp.shared_expert.weight' is not a parameter" train $hf1 --init-from "$tmp/hf-extra" --save "$tmp/never"
  bad "$tmp/hf-gap/model.safetensors': data_offsets leave bytes" train $hf1 --init-from "$tmp/hf-gap" --save "$tmp/never"
  bad "$tmp/hf-truncated/model.safetensors': tensor" train $hf1 --init-from "$tmp/hf-truncated" --save "$tmp/never"
  bad "--init-from '$tmp/nothing-here'" train $hf1 --init-from "$tmp/nothing-here" --save "$tmp/never"
  bad "--init-from '$tmp/hf-f32': not with --resume" train --backend cpu --resume "$tmp/hf0/final" --init-from "$tmp/hf-f32" --steps 3
}
[ ! -e "$tmp/never" ] && passed=$((passed + 1)) || { failed=$((failed + 1)); echo "FAIL: a refused --init-from wrote $tmp/never"; }
# --dump-grads: every parameter's main_grad by its hub name (the checkpoint's names, MTP included), the
# step's tokens [M B, T+2], its losses (the first step's of --json) and the main head's logits (their
# cross-entropy is the main loss)
# shellcheck disable=SC2086
if timeout 60 "$bin" train $hf1 --microbatches 2 --dump-grads "$tmp/g.safetensors" --save "$tmp/g" --json "$tmp/g.json" >/dev/null 2>&1 &&
  python3 - "$tmp/g.safetensors" "$tmp/g/final" "$tmp/g.json" <<'PY'
import json, struct, sys
def header(p):
    b = open(p, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]
g, data = header(sys.argv[1])
names = set(header(sys.argv[2] + "/model.safetensors")[0]) | set(header(sys.argv[2] + "/mtp.safetensors")[0])
extra = {"tokens", "loss_main", "loss_mtp", "loss_aux", "logits", "__metadata__"}
assert set(g) - extra == names - {"__metadata__"}, sorted(set(g) ^ names)
assert g["tokens"]["dtype"] == "I32" and g["tokens"]["shape"] == [4, 10], g["tokens"]
val = lambda k: struct.unpack("<f", data[g[k]["data_offsets"][0]:g[k]["data_offsets"][1]])[0]
loss = json.load(open(sys.argv[3]))["loss"][0]
assert val("loss_main") == struct.unpack("<f", struct.pack("<f", loss))[0], (val("loss_main"), loss)
e = g["model.layers.0.mlp.gate.weight"]
w = struct.unpack("<%df" % ((e["data_offsets"][1] - e["data_offsets"][0]) // 4), data[e["data_offsets"][0]:e["data_offsets"][1]])
assert e["dtype"] == "F32" and any(x != 0 for x in w), "the router's gradient is all zeros"
# the logits are the main head's: their cross-entropy against the next tokens is loss_main
import math
e = g["logits"]
V = e["shape"][1]
assert e["shape"] == [4 * 8, V], e["shape"]
lg = struct.unpack("<%df" % (e["shape"][0] * V), data[e["data_offsets"][0]:e["data_offsets"][1]])
tok = struct.unpack("<40i", data[g["tokens"]["data_offsets"][0]:g["tokens"]["data_offsets"][1]])
ce = 0
for r in range(32):
    row, target = lg[r * V:(r + 1) * V], tok[(r // 8) * 10 + r % 8 + 1]
    mx = max(row)
    ce += mx + math.log(sum(math.exp(x - mx) for x in row)) - row[target]
assert abs(ce / 32 / val("loss_main") - 1) < 1e-4, (ce / 32, val("loss_main"))
PY
then passed=$((passed + 1)); else failed=$((failed + 1)); echo "FAIL: --dump-grads: names, tokens or losses"; fi
bad "--dump-grads '$tmp/g2.safetensors': one rank only" train --backend cpu --gpus 2 --dump-grads "$tmp/g2.safetensors"
# a full disk costs no run: a filesystem too small for one checkpoint is refused before any work; one
# with room for one but not two fails at the second, leaving the first whole (it resumes) and no litter
mnt=$tmp/small
mkdir -p "$mnt"
ck="--backend cpu --seq 8 --batch 2 --layers 1 --hidden 128 --ffn 128 --experts 4 --quiet"
if mount -t tmpfs -o size=2m tmpfs "$mnt" 2>/dev/null; then
  # shellcheck disable=SC2086
  bad "--save '$mnt/ck': one checkpoint takes" train $ck --steps 3 --save "$mnt/ck"
  [ ! -e "$mnt/ck" ] && passed=$((passed + 1)) || { failed=$((failed + 1)); echo "FAIL: a refused --save wrote $mnt/ck"; }
  umount "$mnt"
  mount -t tmpfs -o size=12m tmpfs "$mnt"
  # shellcheck disable=SC2086
  timeout 60 "$bin" train $ck --steps 3 --save "$mnt/ck" --save-every 1 >"$tmp/full.out" 2>"$tmp/full.err"
  rc=$?
  # shellcheck disable=SC2086
  if [ $rc = 2 ] && grep -q "No space left on device" "$tmp/full.err" && [ -s "$mnt/ck/step-1/trainer.json" ] &&
    [ -z "$(find "$mnt/ck" -name '*.tmp' -o -name '*.old' -o -name 'step-2*')" ] &&
    timeout 60 "$bin" train --backend cpu --resume "$mnt/ck/step-1" --steps 2 --quiet >/dev/null 2>&1; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1)); echo "FAIL: a checkpoint onto a full disk: exit $rc"; head -3 "$tmp/full.err"; ls -R "$mnt" | head
  fi
  umount "$mnt"
else
  echo "test_cli: tmpfs cases skipped (mount not permitted here)"
fi

echo "test_cli: $passed passed, $failed failed"
[ $failed = 0 ]
