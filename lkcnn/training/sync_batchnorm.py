"""Synchronized BatchNorm that keeps the host ahead of the GPU, and the Lightning plugin that installs it.

Why not torch.nn.SyncBatchNorm as is: a DDP step of RepLKNet-31B runs ~200 BatchNorms, and torch's synchronized
forward and backward are Python around PyTorch's kernels and collectives. That costs host time in every layer (and
its forward also makes the host wait for the GPU once per layer, by boolean indexing: pytorch/pytorch#78549): on
2x H200 it turned 2 GPUs into 0.93x of one, and even without the wait the host needed ~0.7 ms per layer, more per
step than the GPU. lkcnn's version issues the same kernels and collectives from one C++ autograd function
(csrc/sync_batchnorm.cpp, built with the convolution kernels). Eval mode and one process run plain BatchNorm; CPU
tensors, empty inputs, or a machine where the extension cannot be built run torch.nn.SyncBatchNorm's own forward.
"""
from __future__ import annotations

import warnings

import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn

from lkcnn.ops import build


def sync_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                    running_var: Tensor | None, eps: float, momentum: float, group) -> Tensor:
    """Training-mode BatchNorm of x with batch statistics over every rank of `group` (autograd-aware).

    Every rank must pass the same number of samples; running statistics are updated in place. Raises
    lkcnn.ops.build.BuildError where the CUDA extension cannot be built.
    """
    return build.load().sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum, group.group_name)


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch.nn.SyncBatchNorm whose distributed training forward and backward run in C++ (module docstring)."""

    def forward(self, input: Tensor) -> Tensor:
        # group.size(), not dist.get_world_size(group): this runs ~200 times per step, and the latter's Python (and
        # torch.nn.SyncBatchNorm.forward asking again) took ~12 ms per step under cProfile on one GPU (session 4)
        group = (self.process_group or dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None
        if not (self.training and group is not None and group.size() > 1):
            return nn.modules.batchnorm._BatchNorm.forward(self, input)  # nothing to synchronize: plain BatchNorm
        if not (input.is_cuda and input.numel() > 0 and self.track_running_stats and self.momentum is not None):
            return super().forward(input)
        self._check_input_dim(input)
        try:
            out = sync_batch_norm(input, self.weight, self.bias, self.running_mean, self.running_var, self.eps,
                                  self.momentum, group)
        except build.BuildError as err:
            warnings.warn(f"lkcnn SyncBatchNorm falls back to torch.nn.SyncBatchNorm (slower): {err}", stacklevel=2)
            return super().forward(input)
        self.num_batches_tracked.add_(1)
        return out


class SyncBatchNormPlugin(TorchSyncBatchNorm):
    """Lightning's `sync_batchnorm` plugin, converting to lkcnn's SyncBatchNorm (reverting like Lightning's)."""

    def apply(self, model: nn.Module) -> nn.Module:
        model = super().apply(model)  # torch.nn.SyncBatchNorm modules with the BatchNorms' state
        for module in model.modules():
            if type(module) is nn.SyncBatchNorm:
                module.__class__ = SyncBatchNorm  # a subclass with no state of its own: only forward changes
        return model
