"""lkcnn's synchronized BatchNorm (the C++ function) on a GPU against BatchNorm in float64 (one-rank NCCL group, so
the collectives run).

With one rank the synchronized statistics are the local ones, so forward, input/weight/bias gradients and the
running statistics must equal F.batch_norm's; fresh random inputs, fp32 and bf16 inputs, NCHW and channels_last,
with and without affine parameters; and no host synchronization anywhere. Compiled (traceable_sync_batch_norm, also
captured into CUDA graphs by mode="reduce-overhead"), with its exchanges on NCCL and on lkcnn's NVLink kernels, with
and without affine parameters, the same must hold step after step; opcheck checks the exchange ops. The NVLink
exchange's bounded waits, with fake ranks on this one GPU: a peer that never answers fails the call within its limit
with outputs NaN and ExchangeError on the host, later calls fail at once, and a peer's poisoned words or another
exchange at the same call fail it at once.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lkcnn.ops import build
from lkcnn.ops import sync_batchnorm
from lkcnn.ops.sync_batchnorm import (
    ExchangeError,
    all_reduce_sum,
    check_nvlink_exchange,
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
    lkcnn.layers.sync_batchnorm.SyncBatchNorm skips): buffers and parameters as torch.compile sees them in a network."""

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
    torch._dynamo.reset()  # each case compiles one forward for a new module: past 8, dynamo's recompile limit fails
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


def _fake_ranks(world: int, timeout_s: float) -> list[sync_batchnorm._Exchange]:
    """The exchanges of `world` fake ranks on this GPU, each with its own workspace and failure word, all in one
    process: what enable_nvlink_exchange sets up per process, without the rendezvous."""
    ext = build.load()
    workspaces = [torch.zeros(ext.exchange_workspace_bytes(world), dtype=torch.uint8, device="cuda")
                  for _ in range(world)]
    peers = [w.data_ptr() for w in workspaces]
    return [sync_batchnorm._Exchange(workspaces[r], peers, r, ext.exchange_max_channels(), ext.exchange_max_values(),
                                     ext.exchange_status_word(), timeout_s) for r in range(world)]


def _sum(exchange: sync_batchnorm._Exchange, t: torch.Tensor) -> torch.Tensor:
    """exchange_sum of t through `exchange`, on the current stream (the kernel itself: a fake rank's call)."""
    out = torch.empty_like(t)
    build.load().exchange_sum(t, out, exchange.peers, exchange.rank, exchange.status.data_ptr(), exchange.timeout_s)
    return out


def _timed(fn):
    """fn()'s result and the seconds until the GPU has finished it."""
    torch.cuda.synchronize()
    start = time.monotonic()
    result = fn()
    torch.cuda.synchronize()
    return result, time.monotonic() - start


def _data_words(exchange: sync_batchnorm._Exchange) -> torch.Tensor:
    """A fake rank's workspace after its header, as int64 words: [parity][from rank][block][region]."""
    words = exchange.workspace.view(torch.int64)
    max_values = build.load().exchange_max_values()  # the words of one rank's slot
    return words[words.numel() - 2 * len(exchange.peers) * max_values:].view(2, len(exchange.peers), max_values)


def test_exchange_without_an_answer_fails_within_the_limit(monkeypatch):
    """Rank 1 of a fake world of two never runs: rank 0's exchange gives up after its limit instead of spinning
    forever, its outputs are NaN, the host raises the clear error, every word it sends to rank 1 is poisoned, and
    every later call (of either kind) fails at once, leaving the running statistics as they were."""
    limit = 0.5
    ranks = _fake_ranks(2, limit)
    monkeypatch.setattr(sync_batchnorm, "_exchanges", {"fake": ranks[0]})
    monkeypatch.setattr(sync_batchnorm, "_raised", set())
    t = torch.randn(1000, device="cuda")
    out, seconds = _timed(lambda: all_reduce_sum(t, "fake"))
    assert limit * 0.9 <= seconds < limit + 5, seconds
    assert out.isnan().all()
    with pytest.raises(ExchangeError, match=r"\(gradient sums of 1000 values, call 1\) failed on rank 0: rank 1 did "
                                            r"not answer within 0.5 s.*Set module.sync_bn_exchange=torch"):
        check_nvlink_exchange()
    # what rank 0 sends to rank 1, in both halves and every block's region: the poison bit alone (1 << 63)
    assert (_data_words(ranks[1])[:, 0] == torch.iinfo(torch.int64).min).all()

    mean, var = torch.randn(300, device="cuda"), torch.rand(300, device="cuda") + 0.1
    running = [torch.randn(300, device="cuda"), torch.rand(300, device="cuda") + 0.5]
    before = [r.clone() for r in running]
    (mean_out, invstd_out), seconds = _timed(
        lambda: exchange_batch_norm_stats(mean, var, *running, 0.1, 1e-5, 50, "fake"))
    assert seconds < limit / 2, seconds
    assert mean_out.isnan().all() and invstd_out.isnan().all()
    assert all(torch.equal(r, b) for r, b in zip(running, before))
    assert _timed(lambda: all_reduce_sum(t, "fake"))[0].isnan().all()


def _on_streams(*calls):
    """Each call on a stream of its own, so that fake ranks' kernels run side by side and can answer each other;
    their results once the GPU has finished, and the seconds that took."""
    streams = [torch.cuda.Stream() for _ in calls]
    results = []

    def run():
        for stream, call in zip(streams, calls):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                results.append(call())
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        return results

    return _timed(run)


def test_fake_ranks_exchange_then_fail_fast_on_divergence_and_poison():
    """Two fake ranks on two streams answer each other: the sums are right, call after call (the tags' call numbers
    and signature). Then rank 1 makes another exchange (48 values) than rank 0 (1000) at the same call: both fail at
    once, long before their limit, each naming the other. A third rank pair: rank 1 gives up alone (short limit), and
    rank 0's next call, with a long limit, fails at once on rank 1's poisoned words."""
    ranks = _fake_ranks(2, 20.0)
    xs = [torch.randn(1000, device="cuda") for _ in ranks]
    for _ in range(3):  # both halves of the workspace, and back to the first
        outs, _ = _on_streams(*(lambda r=r: _sum(r, xs[r.rank]) for r in ranks))
        for out in outs:
            torch.testing.assert_close(out, xs[0] + xs[1], rtol=0, atol=0)
    assert all(int(r.status[0]) == 0 for r in ranks)

    small = torch.randn(48, device="cuda")
    outs, seconds = _on_streams(lambda: _sum(ranks[0], xs[0]), lambda: _sum(ranks[1], small))
    assert seconds < 5, seconds  # not the 20 s limit
    assert outs[0].isnan().all() and outs[1].isnan().all()
    for r in ranks:
        message = sync_batchnorm.exchange_failure_message(int(r.status[0]), r.rank, r.timeout_s)
        assert f"failed on rank {r.rank}: rank {1 - r.rank} " in message, message
        # the one that noticed first says "made another exchange"; the other may have read its poison first
        assert "made another exchange" in message or "gave up on an exchange of its own" in message, message

    ranks = _fake_ranks(2, 20.0)
    ranks[1] = ranks[1]._replace(timeout_s=0.3)
    out, seconds = _timed(lambda: _sum(ranks[1], xs[1]))
    assert out.isnan().all() and 0.25 <= seconds < 5, seconds
    out, seconds = _timed(lambda: _sum(ranks[0], xs[0]))
    assert out.isnan().all() and seconds < 5, seconds
    message = sync_batchnorm.exchange_failure_message(int(ranks[0].status[0]), 0, 20.0)
    assert "failed on rank 0: rank 1 gave up on an exchange of its own first" in message, message
