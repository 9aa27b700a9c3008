"""torch.compile(fullgraph=True) of modules using the ops: no graph break, and
the compiled forward and backward give the eager bits."""
import pytest
import torch

import moestash.torch as mt
import ref

E, R, H, F = 4, 64, 32, 16


class Block(torch.nn.Module):
    """A little model around the ops: linear, MLP, linear with row scale."""

    def __init__(self, device, policy="keep", manager=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp = mt.GroupedLinear(E, H, H, bias=True, device=device)
        self.mlp = mt.GroupedMLP(E, H, F, bias=True, policy=policy, stash_manager=manager, device=device)

    def forward(self, x, counts, probs):
        # relu between the ops, exact under eager and inductor alike: with silu here, y came out 1 bf16
        # ulp apart under inductor on an H100 (silu compiled alone matched eager); this test asks for
        # the bits of the ops, not of torch's
        h = self.inp(x, counts, probs)
        return self.mlp(torch.relu(h), counts, probs) + h


@pytest.mark.parametrize("policy", ["keep", "fc1_input=stash,act_input=stash,fc2_input=recompute,probs=offload"])
def test_compile_fullgraph_matches_eager(device, policy):
    manager = mt.StashManager(page_rows=8)
    block = Block(device, policy, manager)
    g = torch.Generator().manual_seed(1)
    counts = ref.make_counts(E, R, "ragged", g).to(device)
    x = ref.rand((R, H), g).to(device)
    p = torch.rand(R, generator=g).to(device)
    # inductor on the GPU; on the CPU aot_eager (same tracing, no C++ build on a 2-core CI machine)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    outs = []
    for fn in (block, compiled):
        xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        manager.step_begin()
        y = fn(xx, counts, pp)
        y.float().square().sum().backward()
        assert manager.step_check()
        outs.append([y.detach(), xx.grad, pp.grad] + [q.grad.clone() for q in block.parameters()])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_no_graph_break():
    explain = torch._dynamo.explain(Block("cpu"))
    g = torch.Generator().manual_seed(2)
    out = explain(ref.rand((R, H), g), ref.make_counts(E, R, "skew", g), torch.rand(R, generator=g))
    assert out.graph_break_count == 0, out.break_reasons
