"""`lkcnn.ops.dwconv2d_branches` on the CPU (PyTorch's path): the registered ops' schema, fake and autograd
(`opcheck`), outputs and gradients against per-branch `F.conv2d` in float64, the blocks that call it, and one-line
errors for bad arguments. The CUDA kernels are checked in tests/test_ops_branches_gpu.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from lkcnn.layers.reparam_conv import UNIREPLKNET_DILATED_BRANCHES, ReparamLargeKernelConv
from lkcnn.ops import dwconv2d_branches, use_conv_impl
from lkcnn.ops.dwconv_branches import uses_kernels

PAIRS = list(UNIREPLKNET_DILATED_BRANCHES[13])


def _case(c=6, h=11, w=9, pairs=PAIRS, dtype=torch.float64):
    x = torch.randn(2, c, h, w, dtype=dtype, requires_grad=True)
    ws = [torch.randn(c, 1, k, k, dtype=dtype, requires_grad=True) for k, _ in pairs]
    return x, ws, [r for _, r in pairs]


def test_outputs_and_gradients_equal_per_branch_dilated_convs():
    x, ws, rs = _case()
    ys = dwconv2d_branches(x, ws, rs)
    refs = [F.conv2d(x, wt, padding=r * (wt.shape[-1] // 2), dilation=r, groups=x.shape[1]) for wt, r in zip(ws, rs)]
    dys = [torch.randn_like(y) for y in ys]
    got = torch.autograd.grad(ys, [x, *ws], dys)
    want = torch.autograd.grad(refs, [x, *ws], dys)
    for y, ref in zip(ys, refs):
        torch.testing.assert_close(y, ref)
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref)


def test_gradcheck_and_opcheck():
    x, ws, rs = _case(c=3, h=7, w=6, pairs=[(5, 1), (3, 3)])
    assert torch.autograd.gradcheck(lambda x, *w: dwconv2d_branches(x, list(w), rs), (x, *ws))
    for op in (torch.ops.lkcnn.dwconv2d_branches_fwd,):
        torch.library.opcheck(op, (x.detach().float().requires_grad_(), [w.detach().float() for w in ws], rs))


def test_a_weight_without_grad_gets_none_and_x_still_gets_its_gradient():
    x, ws, rs = _case(pairs=[(5, 1), (7, 2)])
    ws[1].requires_grad_(False)
    sum(y.sum() for y in dwconv2d_branches(x, ws, rs)).backward()
    assert x.grad is not None and ws[0].grad is not None and ws[1].grad is None


def test_cpu_and_torch_policy_never_take_the_kernels():
    x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    assert not uses_kernels(x, [5], [1])
    with use_conv_impl("torch"):
        assert not uses_kernels(x, [5], [1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_weight_gradient_dispatch_sends_undilated_branches_to_cudnn(monkeypatch, dtype):
    # Where the branch kernels apply, the op computes some weight gradients on the kernel and the rest with PyTorch's
    # convolution (cuDNN on a GPU), and must put each branch's gradient back in its place. A stand-in for the
    # extension computes the kernel's (taps, C) table with PyTorch, so this runs on the CPU.
    from lkcnn.ops import build, dwconv_branches, reference

    pairs = [(5, 1), (7, 2), (3, 3)]
    kernel_branches = [1, 2]  # the dilated ones
    c, calls = 8, []

    class Kernels:
        @staticmethod
        def branches_wgrad(grads, x, ks, rs):
            calls.append((list(ks), list(rs)))
            return torch.cat([reference.grad_weight(g.float(), x.float(), [k, k], [r * (k // 2)] * 2, r)
                              .reshape(c, k * k).t() for g, k, r in zip(grads, ks, rs)])

    monkeypatch.setattr(dwconv_branches, "uses_kernels", lambda *args: True)
    monkeypatch.setattr(build, "load", lambda: Kernels)
    x = torch.randn(2, c, 9, 10, dtype=dtype).contiguous(memory_format=torch.channels_last)
    dys = [torch.randn_like(x) for _ in pairs]
    got = torch.ops.lkcnn.dwconv2d_branches_bwd_weight(dys, x, [k for k, _ in pairs], [r for _, r in pairs])
    assert calls == [([pairs[b][0] for b in kernel_branches], [pairs[b][1] for b in kernel_branches])]
    for g, dy, (k, r) in zip(got, dys, pairs):
        want = reference.grad_weight(dy.double(), x.double(), [k, k], [r * (k // 2)] * 2, r)
        assert g.shape == (c, 1, k, k) and g.dtype == dtype
        torch.testing.assert_close(g.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_flops_count_only_the_real_taps():
    x, ws, rs = _case(c=4, h=8, w=8)
    with FlopCounterMode(display=False) as counter:
        dwconv2d_branches(x.detach(), [w.detach() for w in ws], rs)
    assert counter.get_total_flops() == 2 * x.numel() * sum(k * k for k, _ in PAIRS)


def test_channels_last_input_gives_channels_last_outputs():
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    ys = dwconv2d_branches(x, [torch.randn(8, 1, 3, 3)], [2])
    assert ys[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("args,message", [
    ((torch.randn(8, 5, 5), [torch.randn(8, 1, 3, 3)], [1]), "expects x of shape"),
    ((torch.randn(1, 8, 5, 5), [torch.randn(8, 1, 4, 4)], [1]), "square odd"),
    ((torch.randn(1, 8, 5, 5), [torch.randn(8, 1, 3, 3)], [1, 2]), "one dilation each"),
    ((torch.randn(1, 8, 5, 5), [torch.randn(8, 1, 3, 3)], [0]), "dilations must be >= 1"),
    ((torch.randn(1, 8, 5, 5), [torch.randn(8, 1, 3, 3, dtype=torch.float64)], [1]), "cast them to one dtype"),
])
def test_bad_arguments_are_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message):
        dwconv2d_branches(*args)


def test_replknet_block_runs_its_small_branch_through_the_op(monkeypatch):
    """The training block sends its 5x5 branch through dwconv2d_branches, and its output is the branches' sum."""
    import lkcnn.layers.branch_convs as branch_convs

    calls = []
    real = branch_convs.dwconv2d_branches
    monkeypatch.setattr(branch_convs, "dwconv2d_branches", lambda *a: calls.append(a) or real(*a))
    block = ReparamLargeKernelConv(8, 13, small_kernel=5).double().eval()
    for bn in (block.lkb_origin.bn, block.small_conv.bn):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 8, 10, 10, dtype=torch.float64)
    with torch.no_grad():
        out = block(x)
        expected = block.lkb_origin(x) + block.small_conv(x)
    assert len(calls) == 1 and [w.shape[-1] for w in calls[0][1]] == [5]
    torch.testing.assert_close(out, expected)
