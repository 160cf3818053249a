"""lkcnn.layers.training_fold: RepLKNet's pre-block BatchNorm folded into the next 1x1 conv while compiling a training
step gives the plain modules' outputs, gradients and running statistics (float64, CPU; the speed is a GPU benchmark,
docs/performance.md)."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn as nn

from lkcnn.layers import training_fold
from lkcnn.layers.blocks import ConvFFN, RepLKBlock

BLOCKS = {"ConvFFN": lambda: ConvFFN(8, 32), "RepLKBlock": lambda: RepLKBlock(8, 16, 7, 3)}


def _randomized(block: nn.Module, dtype: torch.dtype = torch.float64) -> nn.Module:
    """Non-trivial BatchNorm parameters and running statistics, in `dtype`."""
    torch.manual_seed(1)
    block = block.to(dtype)
    for m in block.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_()
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return block


def _step(block: nn.Module, x: torch.Tensor, probe: torch.Tensor,
          folded: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of one training step; `folded` stands in for torch.compile's is_compiling()."""
    x = x.clone().requires_grad_()
    with mock.patch.object(torch.compiler, "is_compiling", lambda: folded) if folded is not None else nullcontext():
        out = block(x)
    (out * probe).sum().backward()
    return out, x.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("name", BLOCKS)
def test_folded_block_equals_the_plain_modules(name, dtype, tol):
    plain = _randomized(BLOCKS[name](), dtype).train()
    folded = copy.deepcopy(plain)
    torch.manual_seed(2)
    x = (torch.randn(3, 8, 9, 9, dtype=dtype) * 2 + 1).contiguous(memory_format=torch.channels_last)
    probe = torch.randn(3, 8, 9, 9, dtype=dtype)
    calls = []
    real = training_fold._BatchStats.apply
    with mock.patch.object(training_fold._BatchStats, "apply", lambda t: calls.append(1) or real(t)):
        out_f, dx_f = _step(folded, x, probe, folded=True)
    assert len(calls) == 2  # the fold ran: BN1's and BN2's statistics
    out_p, dx_p = _step(plain, x, probe, folded=False)
    torch.testing.assert_close(out_f, out_p, rtol=tol, atol=tol)
    torch.testing.assert_close(dx_f, dx_p, rtol=tol, atol=tol * dx_p.abs().max().item())
    pre_bias = "prelkb_bn.bias" if name == "RepLKBlock" else "preffn_bn.bias"
    for (key, p), (_, q) in zip(plain.named_parameters(), folded.named_parameters()):
        assert q.grad is not None, key  # every parameter takes part (DDP requires it)
        if key == pre_bias:  # the next BatchNorm removes any shift: no gradient, exactly (the plain one's is rounding)
            assert torch.count_nonzero(q.grad) == 0 and p.grad.abs().max() <= tol * 10 * probe.numel()
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=tol * 10, atol=tol * p.grad.abs().max().item(), msg=key)
    for (key, a), (_, b) in zip(plain.named_buffers(), folded.named_buffers()):
        torch.testing.assert_close(b, a, rtol=tol, atol=tol, msg=key)  # running statistics and counts
    plain.eval()
    folded.eval()
    torch.testing.assert_close(folded(x), plain(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("why", ["eager", "eval", "sync_batchnorm", "cumulative_average", "nchw"])
def test_the_plain_modules_run_where_the_fold_does_not_apply(why):
    block = ConvFFN(8, 32).train()
    x = torch.randn(2, 8, 5, 5)
    if why == "eval":
        block.eval()
    elif why == "sync_batchnorm":
        block.preffn_bn = nn.SyncBatchNorm(8)
    elif why == "cumulative_average":
        block.pw1.bn.momentum = None
    with mock.patch.object(training_fold._BatchStats, "apply", side_effect=AssertionError("folded")), \
            mock.patch.object(torch.compiler, "is_compiling", lambda: why != "eager"), \
            mock.patch.object(nn.SyncBatchNorm, "forward", lambda self, x: x):  # needs a process group otherwise
        block(x if why == "nchw" else x.contiguous(memory_format=torch.channels_last))


def test_compiled_training_step_equals_eager():
    """torch.compile (inductor on the CPU) takes the folded form and matches the eager modules."""
    plain = _randomized(ConvFFN(8, 32)).train()
    compiled = copy.deepcopy(plain)
    compiled.compile()
    x = torch.randn(2, 8, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    probe = torch.randn(2, 8, 6, 6, dtype=torch.float64)
    torch._dynamo.reset()
    out_c, dx_c = _step(compiled, x, probe)  # torch's own is_compiling(): True while the graph is traced
    out_p, dx_p = _step(plain, x, probe)
    torch._dynamo.reset()
    torch.testing.assert_close(out_c, out_p, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dx_c, dx_p, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(compiled.pw1.bn.running_mean, plain.pw1.bn.running_mean, rtol=1e-9, atol=1e-9)
    # exactly zero only where the fold ran (the plain modules' is rounding noise)
    assert torch.count_nonzero(compiled.preffn_bn.bias.grad) == 0 and torch.count_nonzero(plain.preffn_bn.bias.grad)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _errors_in_bf16(block: nn.Module, x: torch.Tensor, probe: torch.Tensor, device: str, compiled: bool) -> dict:
    """Relative errors of a bf16-autocast training step (eager, or compiled and so folded) against the float64
    step of the same block, for the output, the input gradient and each parameter's gradient but BN1's bias (no
    gradient where the fold runs)."""
    ref = copy.deepcopy(block).double()
    out_r, dx_r = _step(ref, x.double(), probe.double(), folded=False)
    run = copy.deepcopy(block).float().to(device)
    if compiled:
        run.compile(fullgraph=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        out, dx = _step(run, x.float().to(device), probe.float().to(device))
    torch._dynamo.reset()
    errors = {"out": _rel_err(out.cpu(), out_r), "dx": _rel_err(dx.cpu(), dx_r)}
    errors.update({key: _rel_err(q.grad.cpu(), p.grad) for (key, p), (_, q)
                   in zip(ref.named_parameters(), run.named_parameters()) if key not in ("prelkb_bn.bias", "preffn_bn.bias")})
    return errors


def _stream(shape: tuple[int, ...], mean_over_std: float) -> torch.Tensor:
    """A residual stream as a bf16 network carries it: channels_last, bf16 values, channel means far from zero."""
    x = torch.randn(shape, dtype=torch.float64) * 2 + 2 * mean_over_std * torch.rand(shape[1], 1, 1)
    return x.bfloat16().double().contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("name", BLOCKS)
def test_the_fold_in_bf16_is_as_accurate_as_the_plain_modules(name):
    """With the stream's channel means 10x its spread, the fold's bf16 step is no further from float64 than the
    plain modules' (the GEMM epilogue centres the conv's output; the weight gradient is that of the centred input)."""
    torch.manual_seed(3)
    block = _randomized({"ConvFFN": lambda: ConvFFN(32, 128), "RepLKBlock": lambda: RepLKBlock(32, 32, 7, 3)}[name]())
    x, probe = _stream((8, 32, 28, 28), 10.0), torch.randn(8, 32, 28, 28, dtype=torch.float64)
    with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
        folded = _errors_in_bf16(block, x, probe, "cpu", compiled=False)
    plain = _errors_in_bf16(block, x, probe, "cpu", compiled=False)
    for key, err in folded.items():
        assert err <= 1.5 * plain[key] + 1e-3, (key, err, plain[key])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_block_on_the_gpu_equals_eager():
    """A RepLKBlock (lkcnn's large-kernel kernels) compiled for training on the GPU, channels_last, takes the fold and
    matches the eager modules in fp32: outputs, gradients and running statistics (TF32 off: it rounds the two
    differently composed convolutions differently)."""
    plain = _randomized(RepLKBlock(64, 64, 13, 5), torch.float32).cuda().to(memory_format=torch.channels_last).train()
    compiled = copy.deepcopy(plain)
    compiled.compile(fullgraph=True)  # one graph: nothing in the fold breaks the GPU's torch's trace
    x = _stream((4, 64, 14, 14), 2.0).float().cuda()
    probe = torch.randn_like(x)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        out_c, dx_c = _step(compiled, x, probe)
        out_p, dx_p = _step(plain, x, probe)
    torch._dynamo.reset()
    assert _rel_err(out_c, out_p) <= 1e-4 and _rel_err(dx_c, dx_p) <= 1e-4
    for (key, p), (_, q) in zip(plain.named_parameters(), compiled.named_parameters()):
        if key == "prelkb_bn.bias":  # exactly zero where the fold ran
            assert torch.count_nonzero(q.grad) == 0
        else:
            assert _rel_err(q.grad, p.grad) <= 1e-3, key
    for key in ("prelkb_bn.running_mean", "prelkb_bn.running_var", "pw1.bn.running_mean", "pw1.bn.running_var"):
        assert _rel_err(compiled.get_buffer(key), plain.get_buffer(key)) <= 1e-4, key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_block_on_the_gpu_in_bf16_is_as_accurate_as_eager():
    """The same block under bf16 autocast: the compiled (folded) step is no further from float64 than eager's."""
    torch.manual_seed(4)
    block = _randomized(RepLKBlock(64, 64, 13, 5), torch.float32).train()
    x, probe = _stream((4, 64, 14, 14), 10.0), torch.randn(4, 64, 14, 14, dtype=torch.float64)
    compiled = _errors_in_bf16(block, x, probe, "cuda", compiled=True)
    eager = _errors_in_bf16(block, x, probe, "cuda", compiled=False)
    for key, err in compiled.items():
        assert err <= 1.5 * eager[key] + 1e-3, (key, err, eager[key])
