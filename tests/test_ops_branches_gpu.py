"""GPU correctness of lkcnn's small-branch kernels (csrc/dwconv/dwconv_branches.cu, and dwconv_branches_tc.cu for the
forward and input gradient of one 16-bit dilation-1 branch on maps taller than 8 rows; the undilated branches'
weight gradients are cuDNN's, the dilated ones' the branch kernel's) against a float64 reference:
every branch set the models use, every dtype, channels_last (the kernels' layout) and NCHW (PyTorch's path). Fresh
random inputs each run (the seed is in the failure message), outputs poisoned with NaN before each launch."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from lkcnn.ops import dwconv2d_branches
from lkcnn.ops.dwconv_branches import uses_kernels
from lkcnn.layers.reparam_conv import UNIREPLKNET_DILATED_BRANCHES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
BRANCH_SETS = {
    "replknet 5x5": [(5, 1)],
    "3x3": [(3, 1)],
    "7x7": [(7, 1)],
    **{f"unireplknet k{k}": list(pairs) for k, pairs in UNIREPLKNET_DILATED_BRANCHES.items()},
}
# (N, C, H, W): RepLKNet-31B's stage 3 and 4 maps, a map narrower than a thread's 4 columns, odd sizes, a map
# smaller than the dilated branches' span, many channel groups per pixel, a map of several tiles each way with a
# partly filled last channel block (5 bf16 / 10 fp32 channel groups), and channel counts whose groups do not divide
# the weight gradient's 256 threads (UniRepLKNet-S's 192 and 384: 24 and 48 bf16 groups, 48 and 96 fp32 groups).
# The tensor-core kernel (maps taller than 8 rows) meets a 16-row tile with 14, 13 and 9 rows filled, two row tiles
# (19 rows), columns that end inside an 8-column block (14, 11, 37) and 64-channel blocks filled by 24 or 40.
SHAPES = [(4, 64, 14, 14), (3, 32, 7, 7), (2, 16, 5, 3), (2, 24, 13, 11), (2, 8, 3, 4), (1, 2048, 6, 9),
          (2, 40, 19, 37), (2, 192, 9, 8), (2, 384, 7, 7)]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("LKCNN_DEBUG_POISON", "1")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaNs: some element was never written"
    return ((out.double() - ref).norm() / max(ref.norm().item(), 1e-30)).item()


def run_case(shape, pairs, dtype, channels_last, seed=None):
    seed = random.randrange(2**31) if seed is None else seed
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, c, h, w = shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype).contiguous(memory_format=fmt)
    ws = [(torch.randn(c, 1, k, k, device="cuda", generator=gen) / k).to(dtype) for k, _ in pairs]
    dys = [torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype).contiguous(memory_format=fmt)
           for _ in pairs]
    rs = [r for _, r in pairs]
    what = f"seed={seed} shape={shape} branches={pairs} {dtype} channels_last={channels_last}"
    assert uses_kernels(x, [k for k, _ in pairs], rs) == channels_last, what

    xs, wss = x.detach().requires_grad_(), [wt.detach().requires_grad_() for wt in ws]
    ys = dwconv2d_branches(xs, wss, rs)
    torch.autograd.backward(ys, dys)
    torch.cuda.synchronize()

    x64 = x.double().requires_grad_()
    w64 = [wt.double().requires_grad_() for wt in ws]
    ref = [F.conv2d(x64, wt, padding=r * (k // 2), dilation=r, groups=c) for wt, (k, r) in zip(w64, pairs)]
    torch.autograd.backward(ref, [d.double() for d in dys])

    tol = TOL[dtype]
    for b, (y, y64) in enumerate(zip(ys, ref)):
        assert y.is_contiguous(memory_format=fmt), what
        assert rel_err(y, y64.detach()) <= tol, f"branch {b} output: {what}"
        assert rel_err(wss[b].grad, w64[b].grad) <= tol, f"branch {b} weight gradient: {what}"
    assert rel_err(xs.grad, x64.grad) <= tol, f"input gradient: {what}"


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("branches", BRANCH_SETS, ids=str)
def test_branch_kernels_match_float64(branches, dtype):
    for shape in SHAPES:
        run_case(shape, BRANCH_SETS[branches], dtype, channels_last=True)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_nchw_and_odd_channel_counts_take_pytorchs_path(dtype):
    run_case((2, 16, 9, 9), BRANCH_SETS["unireplknet k13"], dtype, channels_last=False)
    # a thread's 16 bytes are 4 fp32 or 8 16-bit channels: 10 channels fit neither
    x = torch.randn(2, 10, 9, 9, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    assert not uses_kernels(x, [5], [1])
    xs, w = x.detach().requires_grad_(), torch.randn(10, 1, 5, 5, device="cuda", dtype=dtype, requires_grad=True)
    y = dwconv2d_branches(xs, [w], [1])[0]
    assert rel_err(y, F.conv2d(x.double(), w.double(), padding=2, groups=10)) <= TOL[dtype]


def test_replknet31b_stage_shapes_in_bf16():
    """RepLKNet-31B's 5x5 branch at batch 64 on every stage map (the sizes the benchmark times)."""
    for shape in [(64, 128, 56, 56), (64, 256, 28, 28), (64, 512, 14, 14), (64, 1024, 7, 7)]:
        run_case(shape, [(5, 1)], torch.bfloat16, channels_last=True)


def test_a_branch_the_loss_ignores_gets_a_zero_gradient():
    x = torch.randn(2, 16, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last).requires_grad_()
    ws = [torch.randn(16, 1, 5, 5, device="cuda", requires_grad=True),
          torch.randn(16, 1, 3, 3, device="cuda", requires_grad=True)]
    ys = dwconv2d_branches(x, ws, [1, 3])
    ys[0].sum().backward()
    assert torch.count_nonzero(ws[1].grad) == 0 and torch.count_nonzero(ws[0].grad) > 0
    ref = torch.autograd.grad(F.conv2d(x, ws[0], padding=2, groups=16).sum(), x)[0]
    assert rel_err(x.grad, ref.double()) <= 1e-5


def test_compiled_block_matches_eager():
    """UniRepLKNet's DilatedReparamBlock through torch.compile (one graph) gives the eager outputs and gradients."""
    from lkcnn.layers.unireplknet_blocks import DilatedReparamBlock

    block = DilatedReparamBlock(64, 13).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(8, 64, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last)
    # a random projection as the loss: every parameter's gradient is far from zero (a sum of squares would give
    # the BatchNorm shifts exact zeros, compared as rounding noise)
    probe = torch.randn_like(x)
    eager_x, comp_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = block(eager_x)
    (eager * probe).sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True)(comp_x)
    (compiled * probe).sum().backward()
    assert rel_err(compiled, eager.double()) <= 1e-5
    assert rel_err(comp_x.grad, eager_x.grad.double()) <= 1e-5
    for p, g in zip(block.parameters(), eager_grads):
        assert rel_err(p.grad, g.double()) <= 1e-4
