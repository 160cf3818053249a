"""GPU correctness of lkcnn.ops.gelu_grn's Triton kernels (run on the GPU machine; skipped elsewhere): output and
every gradient against autograd of the official composition in float64, fresh random inputs each run, outputs and
partial sums poisoned with NaN (LKCNN_DEBUG_POISON), every dtype, at UniRepLKNet's stage shapes and at edges (channels
not a multiple of the tile, rows split over programs); then compiled in one graph, and a block under autocast."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import autocast_runs, written_rel_err

from lkcnn.ops import grn as G

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("poison")]

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (N, H, W, C): UniRepLKNet-B's four stages (4C wide) at a small batch, and edges
SHAPES = [(2, 56, 56, 512), (2, 28, 28, 1024), (4, 14, 14, 2048), (3, 7, 7, 4096), (2, 5, 9, 40), (1, 33, 3, 264)]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_float64(shape, dtype, bias):
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    g = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    gamma = torch.randn(1, 1, 1, shape[-1], generator=gen, device="cuda")
    beta = torch.randn(1, 1, 1, shape[-1], generator=gen, device="cuda") if bias else None
    assert G.uses_kernels(h)
    leaves = [t.clone().requires_grad_() for t in (h, gamma, beta) if t is not None]
    out = G.gelu_grn(leaves[0], leaves[1], leaves[2] if bias else None)
    out.backward(g)
    ref_leaves = [t.double().requires_grad_() for t in (h, gamma, beta) if t is not None]
    ref = G.grn(F.gelu(ref_leaves[0]), ref_leaves[1], ref_leaves[2] if bias else None)
    ref.backward(g.double())
    assert out.dtype == dtype
    for name, a, b in [("out", out, ref)] + [(f"grad {i}", x.grad, y.grad)
                                              for i, (x, y) in enumerate(zip(leaves, ref_leaves))]:
        assert written_rel_err(a, b) < TOL[dtype], (name, seed)


def test_compiled_in_one_graph_under_autocast_matches_eager():
    """Linear -> GELU + GRN -> Linear compiled with fullgraph (a graph break fails) in bf16 autocast: the same
    outputs and gradients as eager, and as the torch-ops path."""
    from lkcnn.layers.unireplknet_blocks import GELUGRN

    torch.manual_seed(random.randrange(2**31))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), GELUGRN(256), torch.nn.Linear(256, 64)).cuda()
    with torch.no_grad():
        model[1][1].gamma.normal_()
        model[1][1].beta.normal_()
    eager, compiled, torch_ops = autocast_runs(model, torch.randn(4, 14, 14, 64, device="cuda"), G.set_grn_kernels)
    for a, b, c in zip(compiled, eager, torch_ops):
        assert written_rel_err(a, b.double()) < 2e-2 and written_rel_err(b, c.double()) < 2e-2
