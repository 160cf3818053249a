"""Synchronized BatchNorm without a host synchronization per layer, and the Lightning plugin that installs it.

Why not torch.nn.SyncBatchNorm as is: its forward drops the statistics of ranks with an empty batch by boolean
indexing (`count_all[mask]`, pytorch/pytorch#78549), which makes the CPU wait for the GPU once per BatchNorm layer.
RepLKNet-31B has ~100 BatchNorms, so the CPU can never run ahead of the GPU: on 2x H200 that turned 2 GPUs into 0.93x
of one (docs/performance.md, "Multi-GPU"). Training batches are never empty on any rank (Lightning's distributed
sampler gives every rank the same number of samples), so this version keeps PyTorch's fused kernels and collectives
and leaves the mask out; everything else (eval mode, CPU tensors, one process, empty inputs) is
torch.nn.SyncBatchNorm's own forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn


class _SyncBatchNormFn(torch.autograd.Function):
    """Training-mode BatchNorm over the whole process group: one all_gather forward, one all_reduce backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                running_var: Tensor | None, eps: float, momentum: float, group, world_size: int) -> Tensor:
        memory_format = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) \
            else torch.contiguous_format
        x = x.contiguous(memory_format=memory_format)
        channels = x.shape[1]
        mean, invstd = torch.batch_norm_stats(x, eps)
        count = torch.full((1,), x.numel() // channels, dtype=mean.dtype, device=mean.device)
        gathered = torch.empty(world_size, 2 * channels + 1, dtype=mean.dtype, device=mean.device)
        dist.all_gather_into_tensor(gathered, torch.cat([mean, invstd, count]), group=group)
        mean_all, invstd_all, count_all = gathered.split([channels, channels, 1], dim=1)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            x, mean_all, invstd_all, running_mean, running_var, momentum, eps, count_all.view(-1))
        ctx.save_for_backward(x, weight, mean, invstd, count_all.view(-1).to(torch.int32))
        ctx.group, ctx.memory_format = group, memory_format
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, mean, invstd, count = ctx.saved_tensors
        grad = grad.contiguous(memory_format=ctx.memory_format)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
            grad, x, mean, invstd, weight, need_x, need_w and weight is not None, need_b and weight is not None)
        grad_x = None
        if need_x:
            channels = x.shape[1]
            combined = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(combined, group=ctx.group)
            sum_dy, sum_dy_xmu = combined.split(channels)
            grad_x = torch.batch_norm_backward_elemt(grad, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count)
        return (grad_x, grad_weight if need_w else None, grad_bias if need_b else None,
                None, None, None, None, None, None)


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch.nn.SyncBatchNorm whose distributed training forward does not wait for the GPU (module docstring)."""

    def forward(self, input: Tensor) -> Tensor:
        group = self.process_group or dist.group.WORLD
        world_size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if not (self.training and world_size > 1 and input.is_cuda and input.numel() > 0 and self.track_running_stats
                and self.momentum is not None):
            return super().forward(input)
        self._check_input_dim(input)
        self.num_batches_tracked.add_(1)
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                      self.momentum, group, world_size)


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's `sync_batchnorm` plugin, converting to lkcnn's SyncBatchNorm (reverting like Lightning's)."""

    def apply(self, model: nn.Module) -> nn.Module:
        model = super().apply(model)  # torch.nn.SyncBatchNorm modules with the BatchNorms' state
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = SyncBatchNorm  # a subclass with no state of its own: only forward changes
        return model
