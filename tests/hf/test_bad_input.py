"""Bad input through the CLI: a Hugging Face directory that is not a
Qwen3-MoE, lacks a tensor or has a tensor whose shape contradicts its
config.json, and token files that are not llm.c token files: exit 2, one
line, nothing written (the --save directory is not made)."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle as o

C = o.tiny(vocab=256, tie=False, norm_topk=True)
SEQ, BATCH = 16, 2


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    torch.manual_seed(3)
    o.Qwen3MoeForCausalLM(o.hf_config(C)).save_pretrained(d / "model")
    o.write_tokens(d / "tokens.bin", o.random_corpus(4000, C["vocab"], seed=5))
    return d


def refused(args, out):
    """moestash ARGS exits 2 with one line, and `out` is not made."""
    p = o.run(args, expect=2)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{p.stdout}{p.stderr}"
    assert not os.path.exists(out) or (os.path.isdir(out) and not o.tree_snapshot(out)), f"{out} written"
    print(lines[0])
    return lines[0]


def broken(good_dir, tmp_path, how):
    d = tmp_path / "bad"
    shutil.copytree(good_dir / "model", d)
    cfg_path, st = d / "config.json", d / "model.safetensors"
    cfg = json.loads(cfg_path.read_text())
    if how == "model_type":
        cfg["model_type"] = "llama"
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif how == "config_shape":
        cfg["hidden_size"] = C["hidden"] * 2  # every matrix now contradicts it
    elif how in ("missing", "tensor_shape"):
        t = load_file(str(st))
        name = "model.layers.1.mlp.gate.weight" if how == "missing" else "model.layers.0.self_attn.k_proj.weight"
        if how == "missing":
            del t[name]
        else:
            t[name] = t[name][:-1].contiguous()  # one row short of num_key_value_heads * head_dim
        save_file(t, str(st), metadata={"format": "pt"})
    cfg_path.write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("how", ["model_type", "missing", "tensor_shape", "config_shape"])
def test_init_from_refuses(good_dir, tmp_path, how):
    o.need("train", "--init-from")
    d = broken(good_dir, tmp_path, how)
    out = tmp_path / "save"
    line = refused(["train", "--backend", "cpu", "--init-from", d, "--steps", 1, "--seq", SEQ, "--batch", BATCH,
                    "--data", good_dir / "tokens.bin", "--save", out], out)
    assert "--init-from" in line or str(d) in line, line


@pytest.mark.parametrize("how", ["model_type", "missing", "tensor_shape"])
def test_eval_refuses_model(good_dir, tmp_path, how):
    o.need("eval", "--model", "--data")
    d = broken(good_dir, tmp_path, how)
    refused(["eval", "--model", d, "--data", good_dir / "tokens.bin"], tmp_path / "none")


def bad_tokens(path, how):
    toks = o.random_corpus(2000, C["vocab"], seed=9)
    if how == "magic":
        o.write_tokens(path, toks, header={0: 20240521})
    elif how == "version":
        o.write_tokens(path, toks, header={1: 7})
    elif how == "truncated":
        o.write_tokens(path, toks)
        with open(path, "r+b") as f:
            f.truncate(1024 + 2 * 1000 + 1)  # the header says 2000 tokens
    elif how == "token_id":
        toks[1234] = C["vocab"]  # not below the vocabulary
        o.write_tokens(path, toks)
    elif how == "short_header":
        o.write_tokens(path, toks)
        with open(path, "r+b") as f:
            f.truncate(100)  # the magic, then the file ends inside the header
    return path


@pytest.mark.parametrize("how", ["magic", "version", "truncated", "token_id", "short_header"])
def test_train_refuses_token_file(tmp_path, how):
    o.need("train", "--data", "--vocab")
    f = bad_tokens(tmp_path / "bad.bin", how)
    out = tmp_path / "save"
    line = refused(o.train_args(C, SEQ, BATCH, steps=1) + ["--data", f, "--save", out], out)
    assert str(f) in line or "--data" in line, line
    if how == "token_id":
        off = 1024 + 2 * 1234  # the byte offset of the bad token
        assert str(off) in line or str(C["vocab"]) in line, f"the line names neither the offset nor the value: {line}"


@pytest.mark.parametrize("how", ["magic", "truncated", "token_id"])
def test_eval_refuses_token_file(good_dir, tmp_path, how):
    o.need("eval", "--model", "--data")
    f = bad_tokens(tmp_path / "bad.bin", how)
    line = refused(["eval", "--model", good_dir / "model", "--data", f], tmp_path / "none")
    assert str(f) in line or "--data" in line, line


@pytest.mark.parametrize("how", ["model_type", "missing", "tensor_shape", "config_shape"])
def test_sample_refuses_model(good_dir, tmp_path, how):
    o.need("sample", "--model", "--prompt-ids")
    d = broken(good_dir, tmp_path, how)
    out = tmp_path / "sample.json"
    line = refused(["sample", "--model", d, "--prompt-ids", "1,2,3", "--tokens", 4, "--json", out], out)
    assert "--model" in line or str(d) in line, line
