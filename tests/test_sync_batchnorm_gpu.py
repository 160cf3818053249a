"""lkcnn's synchronized BatchNorm (the C++ function) on a GPU against BatchNorm in float64 (one-rank NCCL group, so
the collectives run).

With one rank the synchronized statistics are the local ones, so forward, input/weight/bias gradients and the
running statistics must equal F.batch_norm's; fresh random inputs, fp32 and bf16 inputs, NCHW and channels_last,
with and without affine parameters; and no host synchronization anywhere.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lkcnn.training.sync_batchnorm import sync_batch_norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def group():
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


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
    for name, got, ref in checks:
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.1e} ({what})"


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
