"""lkcnn.ops.gelu_grn on the CPU: the kernel path's autograd arithmetic (the per-image terms between the passes and
the hand-written backward, through the ops' torch implementations, in float32 as the kernels compute) against
autograd of the official composition in float64, opcheck of the registered passes, the dispatch, and the four Triton
kernels in Triton's interpreter against float64."""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_switch_and_conv_policy_gate, eager_and_compiled, run_in_triton_interpreter

from lkcnn.layers.unireplknet_blocks import GELUGRN
from lkcnn.ops import grn as G


def _case(n, h, w, c, seed, zero_channel=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, w, c, generator=gen, dtype=torch.float64)
    if zero_channel:  # GELU(-60) is 0 in float64: a channel whose norm is 0 (the norm's gradient there is 0)
        x[0, :, :, 1] = -60.0
    gamma = torch.randn(1, 1, 1, c, generator=gen, dtype=torch.float64)
    beta = torch.randn(1, 1, 1, c, generator=gen, dtype=torch.float64)
    return x, gamma, beta, torch.randn(n, h, w, c, generator=gen, dtype=torch.float64)


def _grads(fn, x, gamma, beta, g):
    leaves = [t.clone().requires_grad_() for t in (x, gamma) + (() if beta is None else (beta,))]
    out = fn(leaves[0], leaves[1], leaves[2] if beta is not None else None)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zero_channel", [False, True])
def test_kernel_path_arithmetic_matches_the_official_composition_in_float64(bias, zero_channel, monkeypatch):
    x, gamma, beta, g = _case(3, 5, 7, 12, seed=torch.seed() % 2**31, zero_channel=zero_channel)
    beta = beta if bias else None
    monkeypatch.setattr(G, "uses_kernels", lambda t: True)  # the passes run their CPU implementations
    ours = _grads(G.gelu_grn, x, gamma, beta, g)
    monkeypatch.undo()
    ref = _grads(lambda a, b, c: G.grn(F.gelu(a), b, c), x, gamma, beta, g)
    for name, a, b in zip(["out", "dx", "dgamma", "dbeta"], ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert ((a - b).norm() / b.norm()).item() < 2e-6, name  # the kernel path computes in float32


def test_registered_passes_pass_opcheck():
    """Schema, fake implementations and dispatch of the four registered passes (their CPU implementations)."""
    h, gamma, beta, g = (t.float() for t in _case(2, 3, 5, 8, seed=torch.seed() % 2**31))
    rows, g_rows = h.reshape(2, -1, 8), g.reshape(2, -1, 8)
    scale, t = torch.randn(2, 8), torch.randn(2, 8)
    gx = F.gelu(rows).norm(dim=1)
    leaves = [t.clone().requires_grad_() for t in (rows, gamma, beta)]
    for op, args in [(G.gelu_grn_sumsq, (rows,)), (G.gelu_grn_apply, (*leaves, gx, G._terms(gx, gamma)[2])),
                     (G.gelu_grn_apply, (*leaves[:2], None, gx, G._terms(gx, gamma)[2])),
                     (G.gelu_grn_grad_sums, (g_rows, rows)),
                     (G.gelu_grn_grad_apply, (g_rows, rows, scale, t))]:
        torch.library.opcheck(op, args)


def test_module_keeps_the_official_keys_and_runs_torch_ops_on_the_cpu():
    module = GELUGRN(8)
    assert list(module.state_dict()) == ["1.gamma", "1.beta"]
    assert list(GELUGRN(8, use_bias=False).state_dict()) == ["1.gamma"]
    x = torch.randn(2, 3, 3, 8)
    assert not G.uses_kernels(x)
    with torch.no_grad():
        module[1].gamma.normal_()
        module[1].beta.normal_()
        assert torch.allclose(module(x), module[1](module[0](x)))


def test_grn_kernels_switch_and_conv_policy_gate_the_kernel_path(monkeypatch):
    x = torch.empty(2, 3, 3, 8, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert_switch_and_conv_policy_gate(G, x, G.set_grn_kernels)
    assert not G.uses_kernels(x.permute(0, 3, 1, 2))  # not contiguous NHWC
    assert not G.uses_kernels(x.to(torch.float64))


_INTERPRETED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from lkcnn.ops import grn_triton as K, triton_tiles as T
    T.sm_count = lambda device: 6  # a small GPU: images' rows split over several programs
    seed = torch.seed() % 2**31  # fresh inputs each run, the seed in a failure's message
    torch.manual_seed(seed)
    for n, r, c, dtype in [(2, 35, 40, torch.float32), (3, 81, 136, torch.bfloat16), (1, 99, 128, torch.float16),
                           (4, 7, 264, torch.bfloat16)]:
        h, g = torch.randn(n, r, c).to(dtype), torch.randn(n, r, c).to(dtype)
        scale, t, beta = torch.randn(n, c), torch.randn(n, c), torch.randn(c)
        splits, rows = K.reduction_splits(n, r, c, h.device)
        x = F.gelu(h.double())
        part = torch.full((n, splits, c), float("nan"))
        K.sumsq(h, part)
        checks = {"sumsq": (part.sum(1), x.square().sum(1))}
        part = torch.full((2, n, splits, c), float("nan"))
        K.grad_sums(g, h, part)
        checks["sum g*x"] = (part[0].sum(1), (g.double() * x).sum(1))
        checks["sum g"] = (part[1].sum(1), g.double().sum(1))
        out = torch.full_like(h, float("nan"))
        K.apply(h, scale, beta, out)
        checks["out"] = (out, x * scale[:, None].double() + beta.double())
        hd = h.double().requires_grad_()
        (dh_ref,) = torch.autograd.grad(F.gelu(hd), hd, g.double() * scale[:, None] + x * t[:, None])
        dh = torch.full_like(h, float("nan"))
        K.grad_apply(g, h, scale, t, dh)
        checks["dh"] = (dh, dh_ref)
        assert_close(checks, dtype, (n, r, c, dtype, splits, seed))
    print("ok")
""")


def test_triton_kernels_in_the_interpreter_match_float64():
    """The kernels themselves, run by Triton's interpreter on the CPU, outputs NaN before each launch; the GPU runs
    them in tests/test_gelu_grn_gpu.py."""
    run_in_triton_interpreter(_INTERPRETED)


def test_compiled_kernel_path_is_one_graph_that_aot_autograds_cache_keeps(monkeypatch, tmp_path):
    """Linear -> GELU + GRN -> Linear on the kernel path (the passes' CPU implementations) compiles with fullgraph
    into a graph that AOT autograd's cache stores (an autograd.Function in it makes the cache bypass the graph, and
    the training app's second run compile anew), and computes what eager does."""
    monkeypatch.setattr(G, "uses_kernels", lambda t: True)
    torch.manual_seed(torch.seed() % 2**31)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), GELUGRN(32), torch.nn.Linear(32, 8))
    with torch.no_grad():
        model[1][1].gamma.normal_()
        model[1][1].beta.normal_()
    eager, compiled, aot = eager_and_compiled(model, torch.randn(2, 5, 5, 8), tmp_path)
    assert aot.get("autograd_cache_bypass", 0) == 0 and aot.get("autograd_cache_saved") == 1
    for a, b in zip(compiled, eager):
        assert ((a - b).norm() / b.norm()).item() < 1e-4
