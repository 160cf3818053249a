"""GPU correctness of lkcnn.ops.batch_norm_gelu's Triton kernels (run on the GPU machine; skipped elsewhere): output,
every gradient and the running statistics against F.gelu(F.batch_norm(...)) in float64, fresh random inputs each
run, outputs and partial results poisoned with NaN (LKCNN_DEBUG_POISON), every dtype, at RepLKNet-31B's FFN shapes
and at edges (channels not a multiple of the tile, a channel whose mean is large against its spread); then a ConvFFN
compiled in one graph under autocast."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import autocast_runs, written_rel_err

from lkcnn.ops import bn_gelu as B

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("poison")]

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (N, C, H, W): RepLKNet-31B's four FFN hidden layers (4x the stage's channels) at a small batch, and edges
SHAPES = [(2, 512, 56, 56), (2, 1024, 28, 28), (4, 2048, 14, 14), (3, 4096, 7, 7), (2, 40, 5, 9), (1, 264, 33, 3)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_float64(shape, dtype):
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c = shape[1]
    x = torch.randn(shape, generator=gen, device="cuda") * 2 + torch.randn(c, 1, 1, generator=gen, device="cuda")
    x[:, 0] += 100.0
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    g = torch.randn(shape, generator=gen, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
    weight, bias = (torch.randn(c, generator=gen, device="cuda") for _ in range(2))
    running = [torch.randn(c, generator=gen, device="cuda"), torch.rand(c, generator=gen, device="cuda") + 0.5]
    running_ref = [t.double() for t in running]
    assert B.uses_kernels(x)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = B.batch_norm_gelu(leaves[0], leaves[1], leaves[2], *running, 0.1, 1e-5)
    out.backward(g)
    ref_leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = F.gelu(F.batch_norm(ref_leaves[0], *running_ref, ref_leaves[1], ref_leaves[2], True, 0.1, 1e-5))
    ref.backward(g.double())
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    for name, a, b in [("out", out, ref)] + [(f"grad {i}", p.grad, q.grad)
                                              for i, (p, q) in enumerate(zip(leaves, ref_leaves))]:
        assert written_rel_err(a, b) < TOL[dtype], (name, seed)
    for a, b in zip(running, running_ref):
        assert written_rel_err(a, b) < 1e-5, seed


def test_conv_ffn_compiled_in_one_graph_under_autocast_matches_eager():
    """A ConvFFN compiled with fullgraph (a graph break fails) in bf16 autocast, channels_last: the same outputs,
    gradients and running statistics as eager, and as the modules' path (BatchNorm2d, then GELU)."""
    from lkcnn.layers import ConvFFN

    torch.manual_seed(random.randrange(2**31))
    model = ConvFFN(64, 256).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(4, 64, 14, 14, device="cuda").contiguous(memory_format=torch.channels_last)
    eager, compiled, modules = autocast_runs(model, x, B.set_bn_gelu_kernels,
                                             lambda: [model.pw1.bn.running_var.clone()])
    scale = max(t.norm() for t in modules)  # preffn_bn.bias's gradient is ~0 (pw1's BatchNorm removes a shift)
    for a, b, c in zip(compiled, eager, modules):
        for u, v in [(a, b), (b, c)]:
            assert (u - v).norm() < 2e-2 * max(v.norm(), 1e-3 * scale)
        assert not (torch.isnan(a).any() or torch.isnan(b).any())
