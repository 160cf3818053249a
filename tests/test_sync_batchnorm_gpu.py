"""lkcnn's synchronized BatchNorm (the C++ function) on a GPU against BatchNorm in float64 (one-rank NCCL group, so
the collectives run).

With one rank the synchronized statistics are the local ones, so forward, input/weight/bias gradients and the
running statistics must equal F.batch_norm's; fresh random inputs, fp32 and bf16 inputs, NCHW and channels_last,
with and without affine parameters; and no host synchronization anywhere. Compiled (traceable_sync_batch_norm, also
captured into CUDA graphs by mode="reduce-overhead"), with its exchanges on NCCL and on lkcnn's NVLink kernels, with
and without affine parameters, the same must hold step after step; opcheck checks the exchange ops.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lkcnn.training import sync_batchnorm
from lkcnn.training.sync_batchnorm import (
    all_reduce_sum,
    enable_nvlink_exchange,
    exchange_batch_norm_stats,
    sync_batch_norm,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def group():
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(params=["nccl", "nvlink"])
def exchange(request, group, monkeypatch):
    """Where SyncBatchNorm's exchanges run: NCCL, or lkcnn's NVLink kernels set up for this test only."""
    monkeypatch.setattr(sync_batchnorm, "_exchanges", {})
    if request.param == "nvlink":
        enable_nvlink_exchange(group)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_batchnorm(group, dtype, channels_last, affine):
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, c, h, w = 6, 24, 9, 7
    x = (torch.randn(n, c, h, w, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c, device="cuda", generator=gen) + 1
    bias = torch.randn(c, device="cuda", generator=gen)
    grad = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype)
    running = [torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")]
    ref_running = [r.double() for r in running]

    xs, ws, bs = (t.detach().requires_grad_() for t in (x, weight, bias))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    params, params64 = ((ws, bs), (w64, b64)) if affine else ((None, None), (None, None))
    y = sync_batch_norm(xs, *params, running[0], running[1], 1e-5, 0.1, group)
    y.backward(grad)
    y64 = F.batch_norm(x64, ref_running[0], ref_running[1], *params64, training=True, momentum=0.1, eps=1e-5)
    y64.backward(grad.double())

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    what = f"seed={seed} {dtype} channels_last={channels_last} affine={affine}"
    assert y.dtype == dtype, what
    checks = [("out", y, y64), ("grad_x", xs.grad, x64.grad), ("running_mean", running[0], ref_running[0]),
              ("running_var", running[1], ref_running[1])]
    if affine:
        checks += [("grad_w", ws.grad, w64.grad), ("grad_b", bs.grad, b64.grad)]
    else:
        assert ws.grad is None and bs.grad is None, what
    _assert_close(checks, tol, what)


def _assert_close(checks, tol: float, what: str) -> None:
    for name, got, ref in checks:
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.1e} ({what})"


class _Synced(nn.BatchNorm2d):
    """BatchNorm2d whose training forward is sync_batch_norm over `group`, even a one-rank group (which
    lkcnn.training.SyncBatchNorm skips): buffers and parameters as torch.compile sees them in a network."""

    def __init__(self, channels: int, group, affine: bool = True) -> None:
        super().__init__(channels, affine=affine)
        self.group = group

    def forward(self, x):
        return sync_batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                               self.momentum, self.group)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("dtype,channels_last", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["float32-nchw", "bfloat16-channels_last"])
@pytest.mark.parametrize("affine", [True, False])
def test_compiled_matches_batchnorm(group, exchange, mode, dtype, channels_last, affine):
    seed = random.randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, c, h, w = 6, 24, 9, 7
    bn = _Synced(c, group, affine).cuda()
    w64 = b64 = None
    if affine:
        with torch.no_grad():
            bn.weight.copy_(torch.randn(c, device="cuda", generator=gen) + 1)
            bn.bias.copy_(torch.randn(c, device="cuda", generator=gen))
        w64, b64 = (p.detach().double().requires_grad_() for p in (bn.weight, bn.bias))
    running64 = [torch.zeros(c, device="cuda", dtype=torch.float64), torch.ones(c, device="cuda", dtype=torch.float64)]
    compiled = torch.compile(bn, fullgraph=True, mode=None if mode == "default" else mode)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    for step in range(3):  # CUDA graph trees warm up, record, then replay
        x = (torch.randn(n, c, h, w, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
        x = x.contiguous(memory_format=memory_format).requires_grad_()
        dy = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype).contiguous(memory_format=memory_format)
        torch.compiler.cudagraph_mark_step_begin()
        y = compiled(x)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        y64 = F.batch_norm(x64, *running64, w64, b64, training=True, momentum=0.1, eps=1e-5)
        y64.backward(dy.double())
        checks = [("out", y, y64), ("grad_x", x.grad, x64.grad), ("running_mean", bn.running_mean, running64[0]),
                  ("running_var", bn.running_var, running64[1])]
        if affine:
            checks += [("grad_w", bn.weight.grad, w64.grad), ("grad_b", bn.bias.grad, b64.grad)]
            w64.grad = b64.grad = None
        what = f"seed={seed} {mode} {exchange} {dtype} affine={affine} step {step}"
        _assert_close(checks, 1e-4 if dtype == torch.float32 else 2e-2, what)
        assert y.dtype == dtype and y.is_contiguous(memory_format=memory_format)
        bn.zero_grad(set_to_none=True)


def test_all_reduce_sum_opcheck(group, exchange):
    t = torch.randn(2, 48, device="cuda")  # no autograd formula: SyncBatchNorm's backward calls the op itself
    torch.library.opcheck(all_reduce_sum, (t, group.group_name))
    torch.testing.assert_close(all_reduce_sum(t, group.group_name), t, rtol=0, atol=0)  # one rank: the sum is t


def test_exchange_batch_norm_stats_opcheck(group, monkeypatch):
    """One rank: the global statistics are the local ones, and the running statistics move towards them."""
    monkeypatch.setattr(sync_batchnorm, "_exchanges", {})
    enable_nvlink_exchange(group)
    mean, var = torch.randn(300, device="cuda"), torch.rand(300, device="cuda") + 0.1
    running = [torch.randn(300, device="cuda"), torch.rand(300, device="cuda") + 0.5]
    torch.library.opcheck(exchange_batch_norm_stats, (mean, var, running[0].clone(), running[1].clone(), 0.1, 1e-5,
                                                      50, group.group_name))
    expected = [running[0].lerp(mean, 0.1), running[1].lerp(var * 50 / 49, 0.1)]
    out = exchange_batch_norm_stats(mean, var, *running, 0.1, 1e-5, 50, group.group_name)
    torch.testing.assert_close(out, (mean, torch.rsqrt(var + 1e-5)))
    torch.testing.assert_close(running, expected)


def test_no_host_synchronization(group):
    """The point of lkcnn's SyncBatchNorm: forward and backward never make the host wait for the GPU."""
    x = torch.randn(4, 8, 5, 5, device="cuda", requires_grad=True)
    weight, bias = torch.ones(8, device="cuda", requires_grad=True), torch.zeros(8, device="cuda", requires_grad=True)
    running = [torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")]
    sync_batch_norm(x, weight, bias, *running, 1e-5, 0.1, group)  # loads the extension before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = sync_batch_norm(x, weight, bias, running[0], running[1], 1e-5, 0.1, group)
        y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
