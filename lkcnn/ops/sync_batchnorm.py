"""Synchronized BatchNorm's ops: the C++ autograd function, its traceable form, and the statistics exchanges.

Why not torch.nn.SyncBatchNorm as is: a DDP step of RepLKNet-31B runs ~200 BatchNorms, and torch's synchronized
forward and backward are Python around PyTorch's kernels and collectives. That costs host time in every layer (and
its forward also makes the host wait for the GPU once per layer, by boolean indexing: pytorch/pytorch#78549): on
2x H200 it turned 2 GPUs into 0.93x of one, and even without the wait the host needed ~0.7 ms per layer, more per
step than the GPU. lkcnn's version issues the same kernels and collectives from one C++ autograd function
(csrc/sync_bn/sync_batchnorm.cpp, built with the convolution kernels). Eval mode and one process run plain BatchNorm; CPU
tensors, empty inputs, or a machine where the extension cannot be built run torch.nn.SyncBatchNorm's own forward.
The module is lkcnn.layers.SyncBatchNorm; the Lightning plugin that installs it is in lkcnn.training.distributed.

Under torch.compile, `traceable_sync_batch_norm` runs instead: the same arithmetic as tensor ops, which inductor
fuses with the layers around them as it fuses BatchNorm on one GPU, around one exchange of the ranks' statistics in
the forward and one all-reduce of the gradient's sums in the backward, which is written out as torch.nn.SyncBatchNorm's
is (autograd through var_mean made seven reductions of the gradient, against two). The exchanges are torch.library
ops, so that dynamo keeps them in the graph whichever path they take. With `mode="reduce-overhead"` the whole step,
collectives included, is replayed as CUDA graphs, so a DDP step needs no host time per layer. The exchanges go
through NCCL, or, where `enable_nvlink_exchange` has set up symmetric memory on the GPUs of one machine (the training
module does for compiled runs there unless `module.sync_bn_exchange=torch`), through lkcnn's own kernels
(csrc/sync_bn/sync_exchange.cu): one kernel per exchange that pushes the values to the other GPUs over NVLink and,
in the forward, also combines the statistics and updates the running ones. Per 8 KB in a CUDA graph on 2x H200 that
takes 2.7-3.5 us, against NCCL's 16-18 us and
symmetric memory's one-shot all-reduce's 6.4 us plus the kernels around it (scripts/allreduce_bw.py,
docs/performance.md); a step makes two per BatchNorm. Each of its waits for a peer is bounded (`ExchangeError`).
Eager mode keeps the single C++ autograd function: Python ops would cost host time in every layer.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lkcnn.errors import UserError

from . import build


def sync_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                    running_var: Tensor | None, eps: float, momentum: float, group) -> Tensor:
    """Training-mode BatchNorm of x with batch statistics over every rank of `group` (autograd-aware).

    Every rank must pass the same number of samples; running statistics are updated in place. Raises
    lkcnn.ops.build.BuildError where the CUDA extension cannot be built.
    """
    if torch.compiler.is_compiling():
        return traceable_sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum, group)
    return build.load().sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum, group.group_name)


def traceable_sync_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                              running_var: Tensor | None, eps: float, momentum: float, group) -> Tensor:
    """sync_batch_norm as torch.compile runs it (module docstring), on any device and backend (gloo too)."""
    count = x.numel() // x.shape[1] * group.size()  # samples per channel over all ranks (each holds the same number)
    with torch.no_grad():  # the statistics' share of the input gradient is in _Normalize.backward
        mean, invstd = _global_statistics(x, running_mean, running_var, eps, momentum, count, group)
    return _Normalize.apply(x, mean, invstd, weight, bias, group.group_name, count)


def _global_statistics(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None, eps: float,
                       momentum: float, count: int, group) -> tuple[Tensor, Tensor]:
    """The mean and 1/std of x over every rank (float32, per channel); the running statistics updated in place."""
    local_var, local_mean = torch.var_mean(x.float(), dim=_channel_axes(x)[1], correction=0)
    if _exchange_takes(group.group_name, x, running_mean, running_var):
        return exchange_batch_norm_stats(local_mean, local_var, running_mean, running_var, momentum, eps, count,
                                         group.group_name)
    # An all-gather of every rank's (mean, variance), made of the all-reduce: each rank's pair in its own slot, by a
    # one-hot mask, so that every rank's graph has the same shapes and so its collectives in the same order.
    # Combined exactly (equal counts per rank), as exchange_batch_norm_stats's kernel does: the variance is the ranks'
    # mean variance plus the spread of their means, which keeps its precision where E[x^2] - E[x]^2 would not
    # (activations far from zero).
    world = group.size()
    slot = (torch.arange(world, device=x.device) == group.rank()).float().view(world, 1, 1)
    means, variances = all_reduce_sum(slot * torch.stack([local_mean, local_var]), group.group_name).unbind(1)
    mean = means.mean(0)
    var = (variances + (means - mean).square()).mean(0)
    if running_mean is not None:
        update_running_stats(running_mean, running_var, mean, var, count, momentum)
    return mean, torch.rsqrt(var + eps)


def update_running_stats(running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, count: int,
                         momentum: float) -> None:
    """BatchNorm's exponential running estimates, in place, from a batch's mean and biased variance over `count`
    values per channel: as torch's BatchNorm, the unbiased variance goes into the running estimate."""
    running_mean.lerp_(mean.to(running_mean.dtype), momentum)
    running_var.lerp_((var * (count / max(count - 1, 1))).to(running_var.dtype), momentum)


def _channel_axes(x: Tensor) -> tuple[tuple[int, ...], list[int]]:
    """The shape that broadcasts a per-channel vector over x, and the dimensions BatchNorm reduces over."""
    return (1, -1) + (1,) * (x.dim() - 2), [0, *range(2, x.dim())]


class _Normalize(torch.autograd.Function):
    """x normalized with the ranks' statistics, then scaled and shifted. Its backward is written out (as
    torch.nn.SyncBatchNorm's is) rather than left to autograd through var_mean and the exchange: one fused reduction of
    (sum dy, sum dy * x_hat), one all-reduce of the pair, one elementwise pass. Autograd's version took seven reductions,
    one of them recomputing the local mean: ~8 ms per RepLKNet-31B step on 2x H200 (2x H200, docs/training_multigpu.md)."""

    @staticmethod
    def forward(ctx, x: Tensor, mean: Tensor, invstd: Tensor, weight: Tensor | None, bias: Tensor | None,
                group_name: str, count: int) -> Tensor:
        shape = _channel_axes(x)[0]
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.group_name, ctx.count = group_name, count
        ctx.bias_dtype = None if bias is None else bias.dtype
        # x * scale + shift, not (x - mean) * scale + bias: with the latter, the forward and the backward's x_hat share
        # the float32 x - mean, and AOT's partitioner saved that (or x_hat) for the backward instead of x itself: one
        # more pass per layer writing twice x's bytes, ~3 ms per RepLKNet-31B step (2x H200, docs/training_multigpu.md).
        # The rounding differs by ~|mean| / std float32 ulps, far below a bfloat16 input's own.
        y = x.float() * scale.view(shape) + shift.view(shape)
        # not y.to(x.dtype) when that is y itself: with torch 2.11, dynamo then passes a zero gradient to backward
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, mean, invstd, weight = ctx.saved_tensors
        shape, dims = _channel_axes(x)
        scale = invstd if weight is None else invstd * weight
        dy = dy.float()
        x_hat = (x.float() - mean.view(shape)) * invstd.view(shape)
        sum_dy, sum_dy_x_hat = dy.sum(dims), (dy * x_hat).sum(dims)
        # every rank's dy reaches every rank's input through the shared statistics: sum them over the ranks
        total_dy, total_dy_x_hat = all_reduce_sum(torch.stack([sum_dy, sum_dy_x_hat]), ctx.group_name).unbind(0)
        mean_dy, mean_dy_x_hat = total_dy / ctx.count, total_dy_x_hat / ctx.count
        grad_x = (dy - mean_dy.view(shape) - x_hat * mean_dy_x_hat.view(shape)) * scale.view(shape)
        # weight and bias gradients are this rank's share: DDP all-reduces them with the other parameters
        grad_weight = None if weight is None else sum_dy_x_hat.to(weight.dtype)
        grad_bias = None if ctx.bias_dtype is None else sum_dy.to(ctx.bias_dtype)
        return grad_x.to(x.dtype), None, None, grad_weight, grad_bias, None, None


# How long an NVLink exchange waits for a peer. A peer is late for host reasons too: the ranks compile the first
# steps (about 3 minutes on the H200 machine) and load data at their own pace, and only the gradient all-reduce at
# each step's end evens them out. A few seconds would fail healthy runs; a minute still ends a dead peer's run
# long before NCCL's own timeout (30 minutes under Lightning).
DEFAULT_EXCHANGE_TIMEOUT_S = 60.0
# After a failure, how long the watchdog leaves the training loop to raise ExchangeError and the process to end
_WATCHDOG_GRACE_S = 15.0


# The failure record's fields (csrc/sync_bn/sync_exchange.cu): bits 60-63, 56-59, 52-55, 32-51, 0-31.
_REASONS = {1: "timeout", 2: "peer failed", 3: "diverged"}
_KINDS = {1: "sum", 2: "stats"}


class ExchangeError(UserError, RuntimeError):
    """An NVLink exchange of SyncBatchNorm gave up waiting for a peer (exchange_failure_message says which)."""


def exchange_failure_message(record: int, rank: int, timeout_s: float) -> str:
    """The one-line message for a failure record written by the exchange kernels of `rank`."""
    reason, kind = _REASONS.get(record >> 60, "unknown"), _KINDS.get((record >> 56) & 0xF, "unknown")
    peer, size, call = (record >> 52) & 0xF, (record >> 32) & 0xFFFFF, record & 0xFFFFFFFF
    what = (f"batch statistics of {size} channels" if kind == "stats" else
            f"gradient sums of {size} values" if kind == "sum" else "values")
    cause = {"timeout": f"rank {peer} did not answer within {timeout_s:g} s (it died, ran out of memory or skipped "
                        "an exchange; a slow host can also be late)",
             "peer failed": f"rank {peer} gave up on an exchange of its own first",
             "diverged": f"rank {peer} made another exchange at this call (the ranks' BatchNorm calls diverged)"}
    return (f"SyncBatchNorm's NVLink exchange ({what}, call {call}) failed on rank {rank}: "
            f"{cause.get(reason, f'unknown failure record {record:#x}')}. Set module.sync_bn_exchange=torch to "
            f"exchange through NCCL, or raise module.sync_bn_exchange_timeout_s (now {timeout_s:g}) if rank {peer} is "
            "only slow.")


class _Exchange(NamedTuple):
    workspace: Tensor  # this rank's symmetric-memory workspace (kept alive here)
    peers: list[int]  # every rank's workspace, mapped into this process, in rank order
    rank: int
    max_channels: int  # the kernels' limits, kept here so that dynamo need not call into the extension
    max_values: int
    status: Tensor  # exchange_status_word(): the kernels' failure record, in mapped host memory
    timeout_s: float


# group name -> the exchange set up by enable_nvlink_exchange
_exchanges: dict[str, _Exchange] = {}
_raised: set[str] = set()  # groups whose failure check_nvlink_exchange has raised


def _failure(exchange: _Exchange) -> int:
    """The exchange's failure record, 0 for none: a load from mapped host memory, no synchronization with the GPU."""
    return int(exchange.status.numpy()[0])


def check_nvlink_exchange() -> None:
    """Raise ExchangeError if an NVLink exchange has failed on this rank.

    Called after every training step (ClassificationModule.on_train_batch_end). Reading the kernels' record costs no
    synchronization, so the host, running ahead of the GPU, learns of a failure a step or two late. That is safe:
    a failed exchange's outputs, and every later one's, are NaN, so no step trains on stale statistics meanwhile.
    Where the host blocks before it gets here (in a collective that waits for the same dead rank), the watchdog
    thread of enable_nvlink_exchange ends the process instead.
    """
    for name, exchange in _exchanges.items():
        record = _failure(exchange)
        if record:
            _raised.add(name)
            raise ExchangeError(exchange_failure_message(record, exchange.rank, exchange.timeout_s))


def _watchdog(name: str, exchange: _Exchange) -> None:
    """Polls the failure record; once set, gives the training loop _WATCHDOG_GRACE_S to raise and the process to end,
    then prints the message and exits: the DDP gradient all-reduce that follows the failed step waits for the same
    dead rank in NCCL, and the host may block behind it before any check runs."""
    while not _failure(exchange):
        time.sleep(0.1)
    time.sleep(_WATCHDOG_GRACE_S)
    message = exchange_failure_message(_failure(exchange), exchange.rank, exchange.timeout_s)
    if name in _raised:
        message = f"(exiting: the process did not end within {_WATCHDOG_GRACE_S:g} s of: {message})"
    print(f"Error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def enable_nvlink_exchange(group, timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S) -> None:
    """Run SyncBatchNorm's exchanges over `group` (under torch.compile) through lkcnn's NVLink kernels on symmetric
    memory instead of NCCL. Every rank must call it, with every rank's GPU reachable from every other (one machine).
    Each wait for a peer gives up after `timeout_s` seconds: check_nvlink_exchange then raises ExchangeError, and a
    watchdog thread ends a process that blocks instead. Raises RuntimeError, on every rank, where that cannot be set
    up on any of them."""
    if not timeout_s > 0:
        raise ValueError(f"module.sync_bn_exchange_timeout_s={timeout_s!r}: use a positive number of seconds")
    if group.group_name in _exchanges:
        return
    try:
        import torch.distributed._symmetric_memory as symm_mem  # here: only runs that set it up load it

        ext = build.load()
        size = ext.exchange_workspace_bytes(group.size())  # raises for more ranks than one machine has
        workspace = symm_mem.empty(size, dtype=torch.uint8, device=torch.cuda.current_device())
        workspace.zero_()  # counters, failure record and call tags start at 0, before any peer can reach them
        status = ext.exchange_status_word()
        torch.cuda.synchronize()
        error = None
    except (ImportError, RuntimeError) as err:  # e.g. out of GPU memory, or no compiler, on this rank only
        error = f"rank {group.rank()}: {err}"
    # The ranks agree before the rendezvous, a collective that would wait forever for a rank that failed here.
    errors = [None] * group.size()
    dist.all_gather_object(errors, error, group=group)
    if any(errors):
        raise RuntimeError("; ".join(e for e in errors if e))
    handle = symm_mem.rendezvous(workspace, group.group_name)  # maps every rank's workspace into this process
    offset = workspace.data_ptr() - handle.buffer_ptrs[handle.rank]
    exchange = _Exchange(workspace, [p + offset for p in handle.buffer_ptrs], handle.rank,
                         ext.exchange_max_channels(), ext.exchange_max_values(), status, float(timeout_s))
    _exchanges[group.group_name] = exchange
    threading.Thread(target=_watchdog, args=(group.group_name, exchange), name="lkcnn-exchange-watchdog",
                     daemon=True).start()


def _exchange_takes(group_name: str, x: Tensor, running_mean: Tensor | None, running_var: Tensor | None) -> bool:
    """Whether exchange_batch_norm_stats serves this layer (else the statistics travel through all_reduce_sum)."""
    exchange = _exchanges.get(group_name)
    return (exchange is not None and x.shape[1] <= exchange.max_channels and running_mean is not None
            and running_var is not None and running_mean.dtype == running_var.dtype == torch.float32)


@torch.library.custom_op("lkcnn::exchange_batch_norm_stats", mutates_args=("running_mean", "running_var"))
def exchange_batch_norm_stats(mean: Tensor, var: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float,
                              eps: float, count: int, group_name: str) -> tuple[Tensor, Tensor]:
    """The global batch mean and 1/sqrt(var + eps) from every rank's (mean, biased variance) over `count` samples per
    channel in all, the running statistics updated in place; one kernel (float32, enable_nvlink_exchange first).
    Where a peer does not answer in time the outputs are NaN (check_nvlink_exchange raises)."""
    exchange = _exchanges.get(group_name)
    if exchange is None:
        raise RuntimeError(f"lkcnn::exchange_batch_norm_stats: call enable_nvlink_exchange on group {group_name} "
                           "(every rank) first")
    mean_out, invstd_out = torch.empty_like(mean), torch.empty_like(mean)
    build.load().exchange_batch_norm_stats(mean.contiguous(), var.contiguous(), running_mean, running_var, mean_out,
                                           invstd_out, momentum, eps, count, exchange.peers, exchange.rank,
                                           exchange.status.data_ptr(), exchange.timeout_s)
    return mean_out, invstd_out


@exchange_batch_norm_stats.register_fake
def _(mean, var, running_mean, running_var, momentum, eps, count, group_name):
    return torch.empty_like(mean), torch.empty_like(mean)


@torch.library.custom_op("lkcnn::all_reduce_sum", mutates_args=())
def all_reduce_sum(t: Tensor, group_name: str) -> Tensor:
    """The sum of t over the ranks of the group, on every rank (float32, contiguous)."""
    exchange = _exchanges.get(group_name)
    if exchange is not None and t.is_cuda and t.dtype == torch.float32 and t.numel() <= exchange.max_values:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        build.load().exchange_sum(t.contiguous(), out, exchange.peers, exchange.rank, exchange.status.data_ptr(),
                                  exchange.timeout_s)
        return out
    out = torch.ops._c10d_functional.all_reduce(t.contiguous(), "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


@all_reduce_sum.register_fake
def _(t, group_name):
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)
