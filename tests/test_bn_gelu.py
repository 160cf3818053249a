"""lkcnn.ops.batch_norm_gelu on the CPU: the kernel path's autograd arithmetic (the moments merged between the passes
and the hand-written backward, through the ops' torch implementations, in float32 as the kernels compute) against
autograd of F.gelu(F.batch_norm(...)) in float64, the running statistics against nn.BatchNorm2d's, opcheck of the
registered passes, the dispatch and ConvFFN's use of it, and the four Triton kernels in Triton's interpreter against
float64."""
from __future__ import annotations

import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from conftest import assert_switch_and_conv_policy_gate, eager_and_compiled, run_in_triton_interpreter

from lkcnn.layers import ConvFFN
from lkcnn.ops import bn_gelu as B


def _case(n, c, h, w, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 2 + torch.randn(c, 1, 1, generator=gen)
    x[:, 0] += 300.0  # a channel whose mean is large against its spread
    weight, bias = (torch.randn(c, generator=gen, dtype=torch.float64) for _ in range(2))
    g = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    return x.contiguous(memory_format=torch.channels_last), weight, bias, g


def _reference(x, weight, bias, g, running):
    """out, dx, dweight, dbias of F.gelu(F.batch_norm(...)) in float64 autograd; `running` updated in place."""
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = F.gelu(F.batch_norm(leaves[0], *running, leaves[1], leaves[2], True, 0.1, 1e-5))
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


def _kernel_path(x, weight, bias, g, running, monkeypatch):
    """The same through batch_norm_gelu's kernel path, the registered passes running their CPU implementations."""
    monkeypatch.setattr(B, "uses_kernels", lambda t: True)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    out = B.batch_norm_gelu(leaves[0], leaves[1], leaves[2], *running, 0.1, 1e-5)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_kernel_path_arithmetic_matches_float64_autograd_and_running_statistics(monkeypatch):
    x, weight, bias, g = _case(3, 12, 5, 7, seed=torch.seed() % 2**31)
    running_ref = [torch.randn(12, dtype=torch.float64), torch.rand(12, dtype=torch.float64) + 0.5]
    running = [t.clone() for t in running_ref]
    ref = _reference(x, weight, bias, g, running_ref)
    ours = _kernel_path(x, weight, bias, g, running, monkeypatch)
    # The kernel path computes in float32: centring a channel whose mean is k times its spread loses k float32 ulps
    # of the spread (seen up to 1.1 k eps over 1000 seeds); sums of x and x^2 would lose k^2 (a 150x larger error).
    k = (x.mean((0, 2, 3)).abs() / x.std((0, 2, 3))).max().item()
    for name, a, b in zip(["out", "dx", "dweight", "dbias"], ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) < 4 * torch.finfo(torch.float32).eps * k, name
    assert ours[0].is_contiguous(memory_format=torch.channels_last)
    for a, b in zip(running, running_ref):
        assert _rel(a, b) < 1e-6


def test_registered_passes_pass_opcheck():
    """Schema, fake implementations and dispatch of the four registered passes (their CPU implementations)."""
    x, g = torch.randn(40, 8), torch.randn(40, 8)
    a, b, mean, rstd, c0, c1 = (torch.randn(8) for _ in range(6))
    weight, bias = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    leaf = x.clone().requires_grad_()
    for op, args in [(B.bn_gelu_stats, (x,)), (B.bn_gelu_apply, (leaf, weight, bias, mean, rstd, a, b)),
                     (B.bn_gelu_grad_sums, (g, x, a, b, mean, rstd)),
                     (B.bn_gelu_grad_apply, (g, x, a, b, mean, rstd, c0, c1))]:
        torch.library.opcheck(op, args)


def test_switch_and_conv_policy_gate_the_kernel_path(monkeypatch):
    x = torch.empty(2, 8, 3, 3, device="meta").contiguous(memory_format=torch.channels_last)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert_switch_and_conv_policy_gate(B, x, B.set_bn_gelu_kernels)
    assert not B.uses_kernels(x.contiguous())  # NCHW
    assert not B.uses_kernels(x.to(torch.float64))
    assert not B.uses_kernels(x[:1, :, :1, :1])  # one value a channel: no variance


def test_conv_ffn_takes_the_kernel_path_in_training_only_and_matches_its_modules(monkeypatch):
    torch.manual_seed(torch.seed() % 2**31)
    ffn = ConvFFN(8, 32).double()
    twin = ConvFFN(8, 32).double()
    twin.load_state_dict(ffn.state_dict())
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    calls = []
    monkeypatch.setattr(B, "uses_kernels", lambda t: calls.append(t.shape) or True)
    out = ffn(x)
    out.square().sum().backward()
    assert calls == [(2, 32, 6, 6)]
    monkeypatch.setattr(B, "uses_kernels", lambda t: False)
    ref = twin(x)
    ref.square().sum().backward()
    assert _rel(out, ref) < 1e-5
    scale = torch.cat([q.grad.flatten() for q in twin.parameters()]).norm()
    for (name, p), q in zip(ffn.named_parameters(), twin.parameters()):  # preffn_bn.bias's is ~0: scaled by all
        assert (p.grad - q.grad).norm() < 1e-5 * max(q.grad.norm(), 1e-3 * scale), name
    for (name, b), c in zip(ffn.named_buffers(), twin.buffers()):
        assert torch.allclose(b.double(), c.double(), rtol=1e-6), name
    calls.clear()
    monkeypatch.setattr(B, "uses_kernels", lambda t: calls.append(t.shape) or True)
    with torch.no_grad():
        assert _rel(ffn.eval()(x), twin.eval()(x)) < 1e-6  # running statistics equal to float32 rounding
    assert calls == []  # eval: the modules, running statistics


_INTERPRETED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from lkcnn.ops import bn_gelu as B, bn_gelu_triton as K, triton_tiles as T
    T.sm_count = lambda device: 6  # a small GPU: the rows split over several programs
    seed = torch.seed() % 2**31  # fresh inputs each run, the seed in a failure's message
    torch.manual_seed(seed)
    for r, c, dtype in [(35, 40, torch.float32), (243, 136, torch.bfloat16), (99, 128, torch.float16),
                        (28, 264, torch.bfloat16)]:
        x = torch.randn(r, c) * 3 + torch.randn(c) * 50
        x[:, 1] += 3000.0  # a mean 1000 times the spread: sums of x and x^2 would cancel
        x = x.to(dtype)
        g = torch.randn(r, c).to(dtype)
        a, b, rstd, c0, c1 = torch.randn(c), torch.randn(c), torch.rand(c) + 0.1, torch.randn(c), torch.randn(c)
        mean = x.double().mean(0).float()
        splits, rows = K.reduction_splits(r, c, x.device)
        xd = x.double()
        part = torch.full((3, splits, c), float("nan"))
        K.stats(x, part)
        merged, var = B.merge_moments(part.double(), r)
        checks = {"count": (part[0].double().sum(0), torch.full((c,), float(r), dtype=torch.float64)),
                  "mean": (merged, xd.mean(0)), "var": (var, xd.var(0, unbiased=False))}
        out = torch.full_like(x, float("nan"))
        K.apply(x, a, b, out)
        z = (xd * a.double() + b.double()).requires_grad_()
        checks["out"] = (out, F.gelu(z).detach())
        (dz,) = torch.autograd.grad(F.gelu(z), z, g.double())
        x_hat = (xd - mean.double()) * rstd.double()
        part = torch.full((2, splits, c), float("nan"))
        K.grad_sums(g, x, [a, b, mean, rstd], part)
        checks["sum dz"] = (part[0].sum(0), dz.sum(0))
        checks["sum dz*x_hat"] = (part[1].sum(0), (dz * x_hat).sum(0))
        dx = torch.full_like(x, float("nan"))
        K.grad_apply(g, x, [a, b, mean, rstd, c0, c1], dx)
        checks["dx"] = (dx, a.double() * (dz - c0.double() - x_hat * c1.double()))
        assert_close(checks, dtype, (r, c, dtype, splits, seed))
    print("ok")
""")


def test_triton_kernels_in_the_interpreter_match_float64():
    """The kernels themselves, run by Triton's interpreter on the CPU, outputs NaN before each launch; the GPU runs
    them in tests/test_bn_gelu_gpu.py."""
    run_in_triton_interpreter(_INTERPRETED)


_SWEEP = textwrap.dedent("""
    import sys
    from lkcnn.ops import triton_tiles as T
    T.sm_count = lambda device: 6
    sys.path.insert(0, SCRIPTS)
    import triton_launch_shapes as S
    S.SHAPES = {"bn ffn a": (1, 70, 40, 2), "bn ffn b": (1, 33, 136, 1), "grn a": (3, 21, 40, 2),
                "grn b": (2, 9, 136, 1)}
    configs = {"bn reduce": [(16, 64, 4, 4, 1), (32, 64, 4, 8, 3), (16, 128, 4, 16, 3)],
               "grn reduce": [(8, 64, 2, 4), (16, 128, 4, 8)], "apply": [(8, 64, 2), (16, 128, 2)]}
    rows = S.sweep(list(S.SHAPES), lambda fn: (fn(), 1e-3)[1], peers=False, configs=configs)
    assert len(rows) == 16 and all(ms is not None for row in rows for ms in row["ms"].values()), rows
    assert len(S.report(rows)) == 16 + 8
    print("ok")
""")


def test_launch_shape_sweep_matches_every_candidate_in_the_interpreter():
    """scripts/triton_launch_shapes.py's sweep of the BatchNorm + GELU and GELU + GRN kernels at small shapes in
    Triton's interpreter: each candidate launch shape (tiles, warps, waves, pipelining) computes what the current one
    does, checked as the sweep checks it on a GPU (its outputs NaN-filled first)."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    run_in_triton_interpreter(f"SCRIPTS = {scripts!r}\n" + _SWEEP)


def test_compiled_kernel_path_is_one_graph_that_aot_autograds_cache_keeps(monkeypatch, tmp_path):
    """A ConvFFN on the kernel path (the passes' CPU implementations) compiles with fullgraph (a graph break fails)
    into a graph that AOT autograd's cache stores (an autograd.Function in it makes the cache bypass the graph, and
    the training app's second run compile anew), and computes what eager does."""
    monkeypatch.setattr(B, "uses_kernels", lambda t: True)
    torch.manual_seed(torch.seed() % 2**31)
    ffn = ConvFFN(8, 32).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    eager, compiled, aot = eager_and_compiled(ffn, x, tmp_path)
    assert aot.get("autograd_cache_bypass", 0) == 0 and aot.get("autograd_cache_saved") == 1
    scale = torch.cat([t.flatten() for t in eager[1:]]).norm()
    for a, b in zip(compiled, eager):  # preffn_bn.bias's gradient is ~0: scaled by all
        assert (a - b).norm() < 1e-4 * max(b.norm(), 1e-3 * scale)
