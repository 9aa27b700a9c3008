"""oracle.py — Hugging Face transformers as the independent reference of the
trainer's Qwen3-MoE (issue 27, "How it is checked").

What is here: running the `moestash` program (path in $MST_MOESTASH), the
llm.c token files, tiny Qwen3-MoE configurations as both transformers and the
CLI spell them, loading a directory in transformers with a clean load report,
and the reference of one training step in float64 from transformers' own
modules: the main loss over the T positions of each window, the
load-balancing loss by transformers' load_balancing_loss_func, and the
DeepSeek-V3 MTP module built from Qwen3MoeDecoderLayer and Qwen3MoeRMSNorm.

Token alignment of a moestash window w of T + 2 tokens: inputs w[0:T], main
targets w[1:T+1], MTP targets w[2:T+2]. Losses are means over all B T tokens
of the batch, computed here from the logits (transformers' labels= shift
would drop a position and change the aux loss's token count).
"""
import json
import math
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

# ---- the program -------------------------------------------------------------


def binary():
    path = os.environ.get("MST_MOESTASH")
    if not path or not os.path.exists(path):
        pytest.fail("set MST_MOESTASH to the built moestash program (CTest's hf_oracle does)")
    return path


def run(args, expect=0, timeout=600):
    """Runs `moestash ARGS`; asserts its exit code; returns the process."""
    p = subprocess.run([binary()] + [str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2")))
    if expect is not None and p.returncode != expect:
        raise AssertionError(f"moestash {' '.join(map(str, args))}: exit {p.returncode}, expected {expect}\n"
                             f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p


_help = {}


def help_text(cmd):
    if cmd not in _help:
        p = subprocess.run([binary(), cmd, "--help"], capture_output=True, text=True, timeout=60)
        _help[cmd] = p.stdout + p.stderr if p.returncode == 0 else ""
    return _help[cmd]


def need(cmd, *flags):
    """Skips the test (naming what is missing) until `moestash CMD` has FLAGS.
    MST_HF_STRICT=1 makes it a failure (once every feature has landed)."""
    text = help_text(cmd)
    missing = [f for f in flags if not re.search(re.escape(f) + r"\b", text)] if text else ["command"]
    if missing:
        msg = f"moestash {cmd}: " + ("no such command yet" if missing == ["command"] else f"no {', '.join(missing)} yet")
        if os.environ.get("MST_HF_STRICT") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


def switch(flag, on):
    """A boolean flag's value as `moestash train --help` spells it."""
    line = next((l for l in help_text("train").splitlines() if flag in l), "")
    return ("on" if on else "off") if "on|off" in line else ("1" if on else "0")


# ---- token files (llm.c / nanoGPT: 256 x int32 header, uint16 tokens) --------

TOKEN_MAGIC, TOKEN_VERSION = 20240520, 1


def write_tokens(path, tokens, header=None):
    tokens = np.asarray(tokens)
    h = np.zeros(256, dtype=np.int32)
    h[0], h[1], h[2] = TOKEN_MAGIC, TOKEN_VERSION, len(tokens)
    if header:
        for i, v in header.items():
            h[i] = v
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    return path


def random_corpus(n, vocab, seed):
    """A learnable token stream: a random first-order Markov chain over the
    vocabulary (each token has 4 likely successors), not uniform noise."""
    g = np.random.default_rng(seed)
    succ = g.integers(0, vocab, size=(vocab, 4))
    out = np.empty(n, dtype=np.int64)
    out[0] = g.integers(0, vocab)
    pick, noise = g.integers(0, 4, size=n), g.random(n)
    rand = g.integers(0, vocab, size=n)
    for i in range(1, n):
        out[i] = rand[i] if noise[i] < 0.1 else succ[out[i - 1], pick[i]]
    return out


def cycle_corpus(n, vocab, period, seed, noise=0.03):
    """A fixed random sequence of `period` distinct tokens, repeated, a few
    tokens replaced at random: each token has one likely successor, which a
    tiny model learns in tens of steps."""
    g = np.random.default_rng(seed)
    cycle = g.choice(vocab, size=period, replace=False)
    out = cycle[np.arange(n) % period].astype(np.int64)
    flip = g.random(n) < noise
    out[flip] = g.integers(0, vocab, size=int(flip.sum()))
    return out


# ---- configurations ----------------------------------------------------------

def tiny(vocab=256, layers=2, tie=True, norm_topk=True, hidden=64, ffn=32, experts=8, top_k=2, heads=4,
         kv_heads=2, head_dim=16, rope_theta=10000.0, eps=1e-6):
    """The tiny Qwen3-MoE of the oracle tests, as a dict of its fields."""
    return dict(vocab=vocab, layers=layers, tie=tie, norm_topk=norm_topk, hidden=hidden, ffn=ffn, experts=experts,
                top_k=top_k, heads=heads, kv_heads=kv_heads, head_dim=head_dim, rope_theta=rope_theta, eps=eps)


# the plain loops of transformers: its grouped_mm experts take no float64
EAGER = dict(attn_implementation="eager", experts_implementation="eager")


def hf_config(c, **extra):
    return Qwen3MoeConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], num_hidden_layers=c["layers"],
                          num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                          moe_intermediate_size=c["ffn"], num_experts=c["experts"], num_experts_per_tok=c["top_k"],
                          norm_topk_prob=c["norm_topk"], tie_word_embeddings=c["tie"], rms_norm_eps=c["eps"],
                          rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                          max_position_embeddings=4096, **EAGER, **extra)


def train_args(c, seq, batch, **kw):
    """`moestash train` flags of config c (a model made by moestash)."""
    a = ["train", "--backend", "cpu", "--vocab", c["vocab"], "--layers", c["layers"], "--hidden", c["hidden"],
         "--ffn", c["ffn"], "--experts", c["experts"], "--top-k", c["top_k"], "--heads", c["heads"],
         "--kv-heads", c["kv_heads"], "--head-dim", c["head_dim"], "--rope-theta", c["rope_theta"],
         "--norm-topk-prob", switch("--norm-topk-prob", c["norm_topk"]),
         "--tie-embeddings", switch("--tie-embeddings", c["tie"]), "--seq", seq, "--batch", batch, "--ep", 1]
    for k, v in kw.items():
        a += ["--" + k.replace("_", "-"), v]
    return a


# ---- transformers side -------------------------------------------------------

def load_hf(path, dtype):
    """AutoModelForCausalLM on a directory; the load report must be clean."""
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True, **EAGER)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"transformers' load report of {path}: {bad}"
    assert isinstance(model, Qwen3MoeForCausalLM), type(model)
    return model.eval()


def hub_tensors(model, of, prefix=""):
    """of(p) for each parameter p of the model under the hub's names (experts
    one by one: gate_proj is the first half of the fused gate_up_proj rows)."""
    out = {}
    for name, p in model.named_parameters():
        t = of(p)
        m = re.fullmatch(r"((?:.*\.)?mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if not m:
            out[prefix + name] = t
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{prefix}{m.group(1)}.{e}.down_proj.weight"] = t[e]
            else:
                f = t.shape[1] // 2
                out[f"{prefix}{m.group(1)}.{e}.gate_proj.weight"] = t[e, :f]
                out[f"{prefix}{m.group(1)}.{e}.up_proj.weight"] = t[e, f:]
    return out


def hub_params(model):
    """The model's parameters under the hub's names (hub_tensors)."""
    return hub_tensors(model, lambda p: p)


def hub_grads(model, prefix=""):
    """The parameters' gradients (zeros where none) under the hub's names."""
    return hub_tensors(model, lambda p: p.grad if p.grad is not None else torch.zeros_like(p), prefix)


def causal_mask(T, dtype, device=None):
    m = torch.full((T, T), float("-inf"), dtype=dtype, device=device).triu(1)
    return m[None, None]


class MTP(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction module from transformers' parts:
    h' = layer(eh_proj([enorm(emb(next)) ; hnorm(h)])), logits =
    head(shared_head.norm(h')); the embedding and the head are the main
    model's (shared)."""

    def __init__(self, config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = qm.Qwen3MoeRMSNorm(H, eps)
        self.hnorm = qm.Qwen3MoeRMSNorm(H, eps)
        self.eh_proj = torch.nn.Linear(2 * H, H, bias=False)
        self.layer = qm.Qwen3MoeDecoderLayer(config, config.num_hidden_layers)
        self.norm = qm.Qwen3MoeRMSNorm(H, eps)

    def init_normal(self, std):
        """Random weights (the layer's experts start as torch.empty): normal
        matrices, norm weights near 1."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, std)
        return self

    # the hub names of its tensors under the module's prefix
    NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "shared_head.norm.weight": "norm.weight"}

    def forward(self, main, next_tokens, h):
        """main: the Qwen3MoeForCausalLM; next_tokens [B, T]; h [B, T, H] the
        last main layer's output (before the final norm). Returns the logits
        [B, T, V] and the MTP layer's router logits [B T, E]."""
        e = main.model.embed_tokens(next_tokens)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))
        T = x.shape[1]
        pos = torch.arange(T, device=x.device)[None]
        rope = main.model.rotary_emb(x, position_ids=pos)
        router = []
        hook = self.layer.mlp.gate.register_forward_hook(lambda mod, i, o: router.append(o[0]))
        try:
            x = self.layer(x, attention_mask=causal_mask(T, x.dtype, x.device), position_ids=pos, position_embeddings=rope)
        finally:
            hook.remove()
        return main.lm_head(self.norm(x)), router[0]

    def load_hub(self, tensors, prefix):
        """Copies the module's tensors (hub names under prefix) into it."""
        sd = {}
        for hub, mine in self.NAMES.items():
            sd[mine] = tensors[prefix + hub]
        layer = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)
                 and k[len(prefix):] not in self.NAMES}
        experts = {}
        for k, v in layer.items():
            m = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", k)
            if m:
                experts.setdefault(m.group(2), {})[int(m.group(1))] = v
            else:
                sd["layer." + k] = v
        E = self.layer.mlp.experts.num_experts
        if experts:
            sd["layer.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]]) for e in range(E)])
            sd["layer.mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(E)])
        missing, unexpected = self.load_state_dict({k: v.to(torch.float64) for k, v in sd.items()}, strict=False)
        assert not missing and not unexpected, f"MTP tensors under '{prefix}': missing {missing}, unexpected {unexpected}"

    def hub_grads(self, prefix):
        out = {}
        params = dict(self.named_parameters())
        for hub, mine in self.NAMES.items():
            g = params[mine].grad
            out[prefix + hub] = g if g is not None else torch.zeros_like(params[mine])
        for k, g in hub_grads(self.layer).items():
            out[prefix + k] = g
        return out


MTP_SUFFIX = "enorm.weight"


def mtp_prefix(names):
    """The hub prefix of the MTP module among tensor names (the one whose
    name ends in enorm.weight), or None."""
    hits = [n[: -len(MTP_SUFFIX)] for n in names if n.endswith(MTP_SUFFIX)]
    assert len(hits) <= 1, f"more than one MTP module: {hits}"
    return hits[0] if hits else None


def read_dir_tensors(path):
    """Every tensor of every .safetensors file in a model directory except
    the optimizer's (name -> fp32/fp64-able tensor)."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors") and "optim" not in f:
            with safe_open(os.path.join(path, f), "pt") as s:
                for k in s.keys():
                    assert k not in out, f"{k} twice in {path}"
                    out[k] = s.get_tensor(k)
    return out


def read_safetensors(path):
    with safe_open(path, "pt") as s:
        return {k: s.get_tensor(k) for k in s.keys()}


# ---- the reference step ------------------------------------------------------

def reference_step(model, mtp, tokens, T, aux_coef, mtp_weight, mtp_aux=False):
    """Forward and backward of one moestash step in the model's dtype (use
    float64): tokens [B, T+2]. Returns the losses (floats), the logits
    [B, T, V] of the main head (detached) and the routers' top-k margins."""
    tokens = tokens.long()
    inp, tgt, tgt2 = tokens[:, :T], tokens[:, 1:T + 1], tokens[:, 2:T + 2]
    model.zero_grad(set_to_none=True)
    if mtp is not None:
        mtp.zero_grad(set_to_none=True)
    last = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, i, o: last.append(o[0] if isinstance(o, tuple) else o))
    try:
        out = model(input_ids=inp, output_router_logits=True, use_cache=False)
    finally:
        hook.remove()
    V = out.logits.shape[-1]
    loss_main = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), tgt.reshape(-1))
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    routers = list(out.router_logits)
    aux = qm.load_balancing_loss_func(tuple(routers), E, k)
    total = loss_main + aux_coef * aux
    loss_mtp = torch.zeros(())
    if mtp is not None:
        mlogits, mrouter = mtp(model, tgt, last[0])
        loss_mtp = torch.nn.functional.cross_entropy(mlogits.reshape(-1, V), tgt2.reshape(-1))
        total = total + mtp_weight * loss_mtp
        routers.append(mrouter)
        if mtp_aux:
            maux = qm.load_balancing_loss_func((mrouter,), E, k)
            total = total + aux_coef * maux
            aux = aux + maux
    total.backward()
    margins = [router_margin(r, k) for r in routers]
    return dict(loss_main=loss_main.item(), loss_mtp=loss_mtp.item(), loss_aux=float(aux.detach()),
                logits=out.logits.detach(), margins=margins)


def router_margin(logits, k):
    """Per token: (p_k - p_{k+1}) / p_k of the softmax, the relative gap
    between the last chosen and the first left-out expert (small: a near
    tie whose choice bf16 rounding may flip)."""
    p = torch.softmax(logits.detach().double(), dim=-1)
    top = torch.topk(p, k + 1, dim=-1).values
    return ((top[:, k - 1] - top[:, k]) / top[:, k - 1]).float()


def rel_fro(a, ref):
    a, ref = a.double(), ref.double()
    d = (a - ref).norm()
    n = ref.norm()
    return float(d / n) if n > 0 else float(d)


def table(rows, header):
    """rows: list of tuples; prints an aligned table (pytest -s shows it;
    the failure message carries it too)."""
    w = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).ljust(w[i]) for i, v in enumerate(r))
    text = "\n".join([line(header)] + [line(r) for r in rows])
    print("\n" + text)
    return text


def final_dir(save):
    """The directory of the last checkpoint under train --save DIR."""
    for cand in ("final",):
        p = os.path.join(save, cand)
        if os.path.isdir(p):
            return p
    steps = sorted((d for d in os.listdir(save) if d.startswith("step-")), key=lambda d: int(d[5:]))
    assert steps, f"no checkpoint under {save}: {os.listdir(save)}"
    return os.path.join(save, steps[-1])


def tree_snapshot(path):
    """Relative paths of every file under path (for 'nothing written')."""
    out = set()
    for root, _, files in os.walk(path):
        for f in files:
            out.add(os.path.relpath(os.path.join(root, f), path))
    return out


# ---- a model whose routing has no near tie ----------------------------------
#
# At the usual init (router weights of std 0.02) the softmax over the experts
# is almost flat: the k-th and (k+1)-th probabilities of a token differ by a
# few per cent, and bf16 rounding (about 1 % of a router logit) flips the
# choice of about one token in fifty. A flipped token changes its experts'
# gradients by a large fraction (a few dozen rows each), so no bound can
# separate a flip from a bug. The oracle's own model makes the choice
# robust: token t belongs to group g = t mod G (G = E / k); its embedding
# carries BETA along hidden dim g, the residual stream's largest component;
# every router (the MTP layer's too) scores expert e on dim g by
# ALPHA * SCORE(g, e): group g's own k experts high and apart, the rest at
# least GAP lower. The rest of the weights are random, so attention, RoPE,
# the norms and the per-token router probabilities stay generic.

BETA, ALPHA = 1.5, 0.5


def _scores(G, E, k):
    s = torch.full((G, E), 0.0, dtype=torch.float64)
    for g in range(G):
        for j in range(E):
            own = (j - g * k) % E  # group g's experts first
            s[g, j] = 1.0 - 0.25 * own if own < k else -0.2 - 0.05 * own
    return s


def engineered(c, seed, aux_coef=0.001):
    """(model [float32], mtp module [float32]) for config c."""
    torch.manual_seed(seed)
    cfg = hf_config(c, router_aux_loss_coef=aux_coef)
    model = Qwen3MoeForCausalLM(cfg).float()
    mtp = MTP(cfg).float().init_normal(0.02)
    E, k, H = c["experts"], c["top_k"], c["hidden"]
    G = E // k
    s = _scores(G, E, k).float()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + [("mtp." + n, p) for n, p in mtp.named_parameters()]:
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))  # norm weights near 1, not 1
            else:
                p.normal_(0.0, 0.05 if "self_attn" in name else 0.02)
        emb = model.model.embed_tokens.weight
        for g in range(G):
            emb[g::G, g] += BETA
        routers = [l.mlp.gate.weight for l in model.model.layers] + [mtp.layer.mlp.gate.weight]
        for w in routers:
            w[:, :G] += ALPHA * s.T
        mtp.eh_proj.weight[:, :H] += torch.eye(H)  # the next token's group reaches the MTP router
    return model, mtp


def save_engineered(c, seed, path, dtype=torch.float32, aux_coef=0.001):
    """Writes the engineered model as transformers does (save_pretrained)
    and its MTP module beside it (mtp.safetensors, DeepSeek-V3 names under
    model.layers.{L}.)."""
    from safetensors.torch import save_file
    model, mtp = engineered(c, seed, aux_coef)
    model.to(dtype).save_pretrained(path)
    prefix = f"model.layers.{c['layers']}."
    out = {}
    for hub, mine in MTP.NAMES.items():
        out[prefix + hub] = dict(mtp.named_parameters())[mine]
    for k, v in hub_params(mtp.layer).items():
        out[prefix + k] = v
    save_file({k: v.detach().to(dtype).contiguous() for k, v in out.items()}, os.path.join(path, "mtp.safetensors"),
              metadata={"format": "pt"})
    return path
