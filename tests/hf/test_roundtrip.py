"""Both directions: a random Qwen3-MoE made and saved by transformers (fp32
and bf16 save_pretrained) trains 50 steps under `moestash train
--init-from`; the directory it saves loads back in transformers (clean
load report), and transformers' mean loss on held-out token windows equals
`moestash eval`'s within 0.5 %, before the training (the directory
transformers wrote) and after it (the one moestash wrote)."""
import json
import re

import numpy as np
import pytest
import torch

import oracle as o

SEQ, BATCH, STEPS = 32, 4, 50
LOSS_REL = 5e-3


def eval_windows(tokens, T):
    """The windows of `moestash eval`: the file's consecutive, disjoint
    windows of T + 1 tokens from its start (inputs w[0:T], targets
    w[1:T+1]), every full one."""
    n = len(tokens) // (T + 1)
    return torch.tensor(np.stack([tokens[i * (T + 1):(i + 1) * (T + 1)] for i in range(n)]))


def hf_eval(path, tokens, T):
    model = o.load_hf(path, torch.float32)
    w = eval_windows(tokens, T).long()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(w), 16):
            b = w[i:i + 16]
            lg = model(input_ids=b[:, :T]).logits.double()
            total += float(torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), b[:, 1:].reshape(-1),
                                                             reduction="sum"))
            count += b[:, 1:].numel()
    return total / count


def moestash_eval(path, data, T, tmp_path):
    o.need("eval", "--model", "--data", "--json")
    out = tmp_path / "eval.json"
    o.run(["eval", "--backend", "cpu", "--model", path, "--data", data, "--seq", T, "--json", out])
    r = json.loads(out.read_text())
    return float(r["loss"]), int(r["windows"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_to_moestash_and_back(tmp_path, dtype):
    o.need("train", "--init-from", "--save")
    c = o.tiny(vocab=2048, layers=2, tie=False, norm_topk=True)
    torch.manual_seed(13)
    model = o.Qwen3MoeForCausalLM(o.hf_config(c)).to(dtype)
    model.save_pretrained(tmp_path / "init")
    toks = o.random_corpus(44000, c["vocab"], seed=17)
    train = o.write_tokens(tmp_path / "train.bin", toks[:40000])
    held = toks[40000:]
    held_file = o.write_tokens(tmp_path / "eval.bin", held)
    rows = []
    for name, path in (("transformers' init", str(tmp_path / "init")), ("after 50 moestash steps", None)):
        if path is None:
            o.run(["train", "--backend", "cpu", "--init-from", tmp_path / "init", "--data", train, "--steps", STEPS,
                   "--seq", SEQ, "--batch", BATCH, "--lr", 3e-3, "--warmup", 5, "--save", tmp_path / "save",
                   "--quiet"])
            path = o.final_dir(str(tmp_path / "save"))
            cfg = json.load(open(f"{path}/config.json"))
            assert cfg["vocab_size"] == c["vocab"] and cfg["tie_word_embeddings"] is False, cfg
        ref = hf_eval(path, held, SEQ)
        mine, windows = moestash_eval(path, held_file, SEQ, tmp_path)
        assert windows == len(eval_windows(held, SEQ)), (windows, len(eval_windows(held, SEQ)))
        rows.append((name, f"{mine:.5f}", f"{ref:.5f}", f"{abs(mine / ref - 1):.2e}"))
    text = o.table(rows, ("eval loss", "moestash eval", "transformers", "rel. diff"))
    for r in rows:
        assert float(r[3]) < LOSS_REL, text
    assert float(rows[1][2]) < float(rows[0][2]) - 0.1, f"50 steps did not lower the held-out loss:\n{text}"
