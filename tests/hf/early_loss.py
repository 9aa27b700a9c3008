"""early_loss.py — issue 27 item 6: the first steps' loss of `moestash train`
beside transformers trained from the same weights, on the same batches, with
the same optimizer (not a test: a study, run by hand).

The reference: transformers' Qwen3MoeForCausalLM plus the oracle's MTP
module (oracle.py), float32, trained with moestash's AdamW written out here
(src/trainer/model/optim.c: linear warmup then cosine to min_lr_frac, the
global gradient norm clipped to `clip`, decoupled weight decay on the
matrices, none on the norm weights, betas 0.9 / 0.95, eps 1e-8), on the
windows moestash draws (src/trainer/model/data.c: splitmix64 from seed
* GAMMA + 7, M B windows of T + 2 tokens a step, start = next % (n - T - 1)).
Loss: main + mtp_weight * MTP + aux_coef * (each microbatch's aux over the main
layers plus the MTP layer's own, averaged over the microbatches).

usage: python early_loss.py --init DIR --data FILE [--seq T --batch B
       --micro M --steps N --lr LR --warmup W --total S --mtp-weight W
       --aux A --seed S] [--make-like-moestash CONFIG.json]
  --init DIR   a moestash --save directory of step 0 (train --steps 1 --lr 0)
               or a transformers directory (then the MTP module is made
               here: normal(0, 0.02), like moestash's init)
Prints step, lr, grad norm, main, mtp, aux losses.
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import oracle as o  # noqa: E402

GAMMA = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


class Windows:
    """moestash's data windows (mst_data_batch) over a token array."""

    def __init__(self, tokens, seed):
        self.tok = np.asarray(tokens, dtype=np.int64)
        self.rng = (seed * GAMMA + 7) & MASK

    def batch(self, n, T):
        w, span = T + 2, len(self.tok) - T - 1
        out = []
        for _ in range(n):
            self.rng = (self.rng + GAMMA) & MASK
            s = mix(self.rng) % span
            out.append(self.tok[s:s + w])
        return torch.from_numpy(np.stack(out))


def read_data(path):
    raw = open(path, "rb").read()
    h = np.frombuffer(raw[:1024], dtype=np.int32) if len(raw) >= 1024 else None
    if h is not None and h[0] == o.TOKEN_MAGIC:
        return np.frombuffer(raw[1024:], dtype=np.uint16).astype(np.int64)
    return np.frombuffer(raw, dtype=np.uint8).astype(np.int64)


def lr_at(step, lr, warmup, total, min_frac=0.1):
    if step <= warmup:
        return lr * step / (warmup if warmup > 0 else 1)
    t = min(1.0, (step - warmup) / (total - warmup if total > warmup else 1))
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--total", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--aux", type=float, default=0.001)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cuda: the preset's full size on a GPU")
    ap.add_argument("--bf16-weights", action="store_true",
                    help="as moestash: fp32 master weights, the forward on their bf16 rounding")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = o.load_hf(a.init, torch.float32).to(dt).to(dev).train()
    tensors = o.read_dir_tensors(a.init)
    prefix = o.mtp_prefix(tensors)
    mtp = o.MTP(model.config)
    if prefix is not None:
        mtp.load_hub(tensors, prefix)
    else:
        mtp.init_normal(model.config.initializer_range)
        with torch.no_grad():
            for n, p in mtp.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
    mtp = mtp.to(dt).to(dev).train()
    params = list(model.parameters()) + list(mtp.parameters())
    seen, uniq = set(), []
    for p in params:  # the tied head is the embedding: one parameter
        if id(p) not in seen:
            seen.add(id(p))
            uniq.append(p)
    load_master(a.init, model, mtp, prefix)
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in uniq]
    master = [p.detach().clone() for p in uniq]  # the fp32 weights AdamW updates
    if a.bf16_weights:
        with torch.no_grad():
            for p in uniq:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    data = Windows(read_data(a.data), a.seed)
    T, B, M = a.seq, a.batch, a.micro
    print(f"{'step':>4} {'lr':>9} {'|g|':>9} {'main':>8} {'mtp':>8} {'aux':>8}")
    for step in range(1, a.steps + 1):
        for p in uniq:
            p.grad = None
        lm = lp = la = 0.0
        for _ in range(M):
            w = data.batch(B, T).to(dev)
            r = step_loss(model, mtp, w, T, a.mtp_weight, a.aux)
            (r["total"] / M).backward()
            lm, lp, la = lm + r["main"] / M, lp + r["mtp"] / M, la + r["aux"] / M
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in uniq if p.grad is not None))
        gs = a.clip / norm if norm > a.clip else 1.0
        lr = lr_at(step, a.lr, a.warmup, a.total)
        b1, b2, eps = 0.9, 0.95, 1e-8
        with torch.no_grad():
            for p, w, (m, v) in zip(uniq, master, state):
                if p.grad is None:
                    continue
                g = p.grad * gs
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if p.dim() >= 2:
                    w.mul_(1 - lr * a.wd)
                w.sub_(lr * (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps))
                p.copy_(w.to(torch.bfloat16).to(p.dtype) if a.bf16_weights else w)
        print(f"{step:>4} {lr:>9.3e} {norm:>9.3e} {lm:>8.4f} {lp:>8.4f} {la:>8.4f}", flush=True)


def load_master(path, model, mtp, prefix):
    """moestash's fp32 master weights (optimizer.safetensors' master.NAME,
    where the directory has them) over the bf16 ones of model.safetensors."""
    f = os.path.join(path, "optimizer.safetensors")
    if not os.path.exists(f):
        return
    t = o.read_safetensors(f)
    views = dict(o.hub_params(model))
    if prefix is not None:
        params = dict(mtp.named_parameters())
        views.update({prefix + hub: params[mine] for hub, mine in o.MTP.NAMES.items()})
        views.update({prefix + k: v for k, v in o.hub_params(mtp.layer).items()})
    n = 0
    with torch.no_grad():
        for name, v in views.items():
            if "master." + name in t:
                v.copy_(t["master." + name].to(v.dtype))
                n += 1
    print(f"master weights: {n} tensors from {f}")


def step_loss(model, mtp, w, T, mtp_weight, aux_coef):
    w = w.long()
    inp, tgt, tgt2 = w[:, :T], w[:, 1:T + 1], w[:, 2:T + 2]
    last = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, i, out: last.append(out))
    try:
        out = model(input_ids=inp, output_router_logits=True, use_cache=False)
    finally:
        hook.remove()
    V = out.logits.shape[-1]
    main = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, V), tgt.reshape(-1))
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    aux = o.qm.load_balancing_loss_func(tuple(out.router_logits), E, k)
    ml, mr = mtp(model, tgt, last[0])
    mloss = torch.nn.functional.cross_entropy(ml.float().reshape(-1, V), tgt2.reshape(-1))
    aux = aux + o.qm.load_balancing_loss_func((mr,), E, k)  # the MTP layer balances its own loads
    total = main + mtp_weight * mloss + aux_coef * aux
    return dict(total=total, main=float(main), mtp=float(mloss), aux=float(aux))


if __name__ == "__main__":
    main()
