"""Independent float64 references and random ragged problems."""
import torch

# counts patterns over E groups: zero-size groups, skew, all rows in one group
PATTERNS = ("ragged", "skew", "one", "padded")


def make_counts(E, R, pattern, gen):
    """int32 [E] counts summing to R (pattern 'padded': to R - R // 4, the
    rest are padding rows); zero groups in every pattern but 'one'."""
    n = R - R // 4 if pattern == "padded" else R
    if pattern == "one":
        c = torch.zeros(E, dtype=torch.int64)
        c[E // 2] = n
    else:
        w = torch.rand(E, generator=gen) ** (4 if pattern == "skew" else 1)
        w[torch.randperm(E, generator=gen)[: max(1, E // 3)]] = 0  # zero-size groups
        c = torch.floor(w / w.sum() * n).long()
        c[int(torch.argmax(w))] += n - int(c.sum())
    assert int(c.sum()) == n and (c >= 0).all()
    return c.to(torch.int32)


def rand(shape, gen, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def groups(counts):
    """[(group, start, end)] of the row ranges."""
    off = [0]
    for c in counts.tolist():
        off.append(off[-1] + c)
    return [(g, off[g], off[g + 1]) for g in range(len(off) - 1)]


def linear(x, w, counts, bias=None, s=None):
    """float64 y [n, O] over the n = sum(counts) valid rows."""
    x, w = x.double(), w.double()
    out = []
    for g, a, b in groups(counts):
        y = x[a:b] @ w[g].T
        if bias is not None:
            y = y + bias.double()[g] * (s.double()[a:b, None] if s is not None else 1.0)
        out.append(y)
    return torch.cat(out)


def act(h, p, activation, limit=7.0, alpha=1.702):
    F = h.shape[1] // 2
    a, b = h[:, :F], h[:, F:]
    if activation == "swiglu":
        z = torch.nn.functional.silu(a) * b
    else:
        a = a.clamp(max=limit)
        b = b.clamp(-limit, limit)
        z = a * torch.sigmoid(alpha * a) * (b + 1)
    return z * p[:, None]


def bf16_round(t):
    """Rounds to bf16 in the forward, the identity in the backward: the MLP's
    act_input and fc2_input are bf16 tensors by contract (a clamp's edge
    moves with that rounding)."""
    return t + (t.to(torch.bfloat16).double() - t).detach()


def far_from_clamps(x, w1, counts, b1, limit=7.0, margin=0.1):
    """bool [n]: rows whose fc1 outputs all lie more than `margin` from the
    clamped SwiGLU's edges (a = L, b = +-L). Its gradient jumps there, so a
    one-ulp difference in h between the library and the reference flips a
    whole row's gradient; tests send no gradient through such rows."""
    h = linear(x, w1, counts, b1)
    F = h.shape[1] // 2
    a, b = h[:, :F], h[:, F:]
    near = ((a - limit).abs() < margin) | ((b.abs() - limit).abs() < margin)
    return ~near.any(1)


def mlp(x, w1, w2, counts, p, activation, b1=None, b2=None):
    """float64 grouped MLP over the valid rows."""
    n = int(counts.sum())
    h = bf16_round(linear(x, w1, counts, b1))
    z = bf16_round(act(h, p.double()[:n], activation))
    return linear(z, w2, counts, b2, p[:n])


def assert_close(got, ref, what):
    """bf16 outputs against a float64 reference: relative to the reference's scale."""
    got, ref = got.double().cpu(), ref.double().cpu()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-30
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    assert err <= 2e-2 * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"
