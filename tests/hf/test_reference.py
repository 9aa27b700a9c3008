"""The oracle's own pieces against transformers itself, before any moestash
run: the loss over the T positions of a window equals transformers'
labels= loss on w[0:T+1]; the load-balancing loss is what its docstring
says (counts of top-k choices and mean router probabilities, pooled over the
layers); the MTP module is causal and reaches the shared embedding and head;
hub_params names are save_pretrained's names."""
import torch

import oracle as o


def _model(c, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    m = o.Qwen3MoeForCausalLM(o.hf_config(c)).to(dtype)
    return m.eval()


def test_main_loss_is_transformers_labels_loss():
    c = o.tiny(tie=False)
    m = _model(c)
    T, g = 24, torch.Generator().manual_seed(1)
    w = torch.randint(0, c["vocab"], (3, T + 2), generator=g)
    ref = o.reference_step(m, None, w, T, aux_coef=0.0, mtp_weight=0.0)
    with torch.no_grad():
        hf = m(input_ids=w[:, :T + 1], labels=w[:, :T + 1]).loss
    # its loss_function casts the logits to float32
    assert abs(ref["loss_main"] - float(hf)) < 1e-6 * abs(float(hf)), (ref["loss_main"], float(hf))


def test_aux_loss_definition():
    """E * sum_e f_e P_e, f_e: top-k choices of expert e over every layer's
    tokens / (layers * tokens), P_e: its mean probability over the same."""
    c = o.tiny(layers=3)
    m = _model(c, seed=2)
    T, g = 16, torch.Generator().manual_seed(3)
    w = torch.randint(0, c["vocab"], (2, T + 2), generator=g)
    with torch.no_grad():
        out = m(input_ids=w[:, :T], output_router_logits=True)
    E, k = c["experts"], c["top_k"]
    counts, probs, rows = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64), 0
    for r in out.router_logits:
        p = torch.softmax(r.double(), -1)
        for e in torch.topk(p, k, -1).indices.reshape(-1).tolist():
            counts[e] += 1
        probs += p.sum(0)
        rows += p.shape[0]
    mine = float(E * ((counts / rows) * (probs / rows)).sum())
    ref = float(o.qm.load_balancing_loss_func(tuple(out.router_logits), E, k))
    assert abs(mine - ref) < 1e-6 * ref, (mine, ref)  # it sums in float32


def test_mtp_module_causal_and_shared():
    c = o.tiny(tie=True)
    m = _model(c, seed=4)
    torch.manual_seed(5)
    mtp = o.MTP(m.config).double().init_normal(0.02)
    T, g = 12, torch.Generator().manual_seed(6)
    w = torch.randint(0, c["vocab"], (2, T + 2), generator=g)
    ref = o.reference_step(m, mtp, w, T, aux_coef=0.01, mtp_weight=0.5)
    assert ref["loss_mtp"] > 0
    assert m.model.embed_tokens.weight.grad is not None and mtp.eh_proj.weight.grad.abs().sum() > 0
    w2 = w.clone()
    w2[:, T - 1:] = (w2[:, T - 1:] + 1) % c["vocab"]  # change the last input and the targets after it
    with torch.no_grad():
        h = []
        hk = m.model.layers[-1].register_forward_hook(lambda mod, i, out: h.append(out))
        m(input_ids=w[:, :T])
        m(input_ids=w2[:, :T])
        hk.remove()
        a, _ = mtp(m, w[:, 1:T + 1], h[0])
        b, _ = mtp(m, w2[:, 1:T + 1], h[1])
    # next tokens at positions >= T-2 changed: positions before stay
    assert torch.equal(a[:, :T - 2], b[:, :T - 2])
    assert not torch.equal(a[:, T - 2:], b[:, T - 2:])


def test_hub_names_are_save_pretrained_names(tmp_path):
    for tie in (True, False):
        c = o.tiny(tie=tie)
        m = _model(c, dtype=torch.float32)
        m.save_pretrained(tmp_path / str(tie))
        saved = set(o.read_dir_tensors(str(tmp_path / str(tie))))
        mine = set(o.hub_params(m))
        if tie:
            mine.discard("lm_head.weight")
        assert saved == mine, (saved ^ mine)


def test_engineered_model_round_trip(tmp_path):
    """save_engineered's directory read back (transformers + mtp.safetensors)
    gives the in-memory model's step bit for bit, and its routers keep
    every margin wide."""
    c = o.tiny(vocab=256, tie=False, norm_topk=True)
    o.save_engineered(c, 5, str(tmp_path / "m"))
    model, mtp = o.engineered(c, 5)
    model, mtp = model.double(), mtp.double()
    back = o.load_hf(str(tmp_path / "m"), torch.float32).double()
    tensors = o.read_dir_tensors(str(tmp_path / "m"))
    prefix = o.mtp_prefix(tensors)
    assert prefix == f"model.layers.{c['layers']}."
    assert f"{prefix}mlp.experts.7.up_proj.weight" in tensors  # the hub's names, one expert each
    mtp2 = o.MTP(back.config).double()
    mtp2.load_hub(tensors, prefix)
    w = torch.randint(0, c["vocab"], (2, 18), generator=torch.Generator().manual_seed(1))
    a = o.reference_step(model, mtp, w, 16, aux_coef=0.01, mtp_weight=0.3)
    b = o.reference_step(back, mtp2, w, 16, aux_coef=0.01, mtp_weight=0.3)
    assert (a["loss_main"], a["loss_mtp"], a["loss_aux"]) == (b["loss_main"], b["loss_mtp"], b["loss_aux"])
    ga, gb = o.hub_grads(model), o.hub_grads(back)
    ga.update(mtp.hub_grads(prefix))
    gb.update(mtp2.hub_grads(prefix))
    assert set(ga) == set(gb) and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert min(float(m.min()) for m in b["margins"]) > 0.2
