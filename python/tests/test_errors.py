"""Bad tensors raise before any work: the library's own message (naming the
argument and its value) for dtype and shape, ours for what only torch knows
(device, layout)."""
import pytest
import torch

import moestash
import moestash.torch as mt

E, R, I, O = 4, 16, 8, 8


def args(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(R, I, generator=g).bfloat16().to(device)
    w = torch.randn(E, O, I, generator=g).bfloat16().to(device)
    c = torch.tensor([4, 0, 8, 4], dtype=torch.int32, device=device)
    return x, w, c


def test_wrong_dtype_carries_the_library_message(device):
    x, w, c = args(device)
    with pytest.raises(moestash.InvalidArgument, match=r"x\.dtype is fp32, expected bf16"):
        mt.grouped_linear(x.float(), w, c)
    with pytest.raises(moestash.InvalidArgument, match=r"counts\.dtype is bf16, expected int32"):
        mt.grouped_linear(x, w, c.bfloat16())


def test_dtype_the_library_has_no_name_for(device):
    x, w, c = args(device)
    with pytest.raises(TypeError, match=r"x\.dtype is torch\.float16"):
        mt.grouped_linear(x.half(), w, c)


def test_wrong_shape_carries_the_library_message(device):
    x, w, c = args(device)
    with pytest.raises(moestash.InvalidArgument, match=r"w has 9 columns, expected in = 8"):
        mt.grouped_linear(x, torch.cat([w, w[..., :1]], dim=2).contiguous(), c)
    with pytest.raises(moestash.InvalidArgument, match=r"scale has shape \[15, 1\], expected \[16, 1\]"):
        mt.grouped_linear(x, w, c, torch.zeros(E, O, dtype=torch.bfloat16, device=device),
                          torch.ones(R - 1, device=device))


def test_non_contiguous_raises(device):
    x, w, c = args(device)
    with pytest.raises(ValueError, match=r"weight is not contiguous"):
        mt.grouped_linear(x, w.transpose(1, 2), c)


def test_wrong_device_raises(cuda):
    x, w, c = args(cuda)
    with pytest.raises(ValueError, match=r"counts is on cpu, expected cuda"):
        mt.grouped_linear(x, w, c.cpu())


def test_mlp_bad_activation_and_policy(device):
    x, w, c = args(device)
    w1 = torch.randn(E, 2 * 8, I).bfloat16().to(device)
    w2 = torch.randn(E, I, 8).bfloat16().to(device)
    p = torch.rand(R, generator=torch.Generator().manual_seed(4)).to(device)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        mt.grouped_mlp(x, w1, w2, c, p, activation="gelu")
    with pytest.raises(ValueError, match="recompute of act_input"):
        mt.Binding("act_input=recompute")
    with pytest.raises(ValueError, match="StashManager"):
        mt.Binding("stash")
    with pytest.raises(moestash.InvalidArgument, match=r"probs has shape \[8, 1\], expected \[16, 1\]"):
        mt.grouped_mlp(x, w1, w2, c, p[:8])
