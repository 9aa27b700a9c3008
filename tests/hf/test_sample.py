"""Greedy sampling: `moestash sample --temperature 0` continues a prompt by
32 tokens exactly as transformers' generate(do_sample=False) from the same
directory, both in fp32 on the CPU: a model trained by moestash (so that the
continuation is not one token repeated) and a random model made by
transformers (save_pretrained in fp32, read by the sampler directly)."""
import json

import pytest
import torch

import oracle as o

NEW = 32
STEPS = 60


def greedy_both(path, prompt, tmp_path):
    o.need("sample", "--model", "--prompt-ids", "--json")
    out = tmp_path / "sample.json"
    o.run(["sample", "--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--tokens", NEW,
           "--temperature", 0, "--json", out])
    mine = json.loads(out.read_text())["ids"]
    model = o.load_hf(path, torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # the mask given: generate() would infer it from pad_token_id and mask the prompt's 0s
        g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                           min_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    ref = g[0, len(prompt):].tolist()
    first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
    print(f"\nmoestash:     {mine}\ntransformers: {ref}")
    assert mine == ref, f"the continuations differ from token {first} on"
    return mine


@pytest.mark.parametrize("case", ["v256-tied-norm", "v3000-untied-nonorm"])
def test_sample_trained_by_moestash(tmp_path, case):
    o.need("train", "--save", "--vocab", "--kv-heads", "config.json")  # --save writes a Hugging Face directory
    vocab = 256 if case.startswith("v256") else 3000
    c = o.tiny(vocab=vocab, tie="tied" in case, norm_topk=case.endswith("-norm"))
    toks = o.cycle_corpus(30000, vocab, 48, seed=21)
    data = o.write_tokens(tmp_path / "train.bin", toks)
    o.run(o.train_args(c, 32, 4) + ["--steps", STEPS, "--seed", 3, "--lr", 3e-3, "--warmup", 5, "--data", data,
                                    "--save", tmp_path / "save", "--quiet"])
    path = o.final_dir(str(tmp_path / "save"))
    prompt = toks[1000:1012].tolist()
    ids = greedy_both(path, prompt, tmp_path)
    assert len(set(ids)) > 2, f"a degenerate continuation tells little: {ids}"


def test_sample_made_by_transformers(tmp_path):
    c = o.tiny(vocab=512, tie=False, norm_topk=True, layers=3)
    torch.manual_seed(8)
    m = o.Qwen3MoeForCausalLM(o.hf_config(c))
    with torch.no_grad():  # logits of a larger spread than the 0.02 init: distinct greedy tokens
        m.lm_head.weight.mul_(20)
    m.save_pretrained(tmp_path / "model")
    greedy_both(str(tmp_path / "model"), [5, 17, 300, 2, 99, 511, 0], tmp_path)
