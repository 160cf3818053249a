"""SyncBatchNorm: torch.nn.SyncBatchNorm whose distributed training step runs lkcnn's synchronized BatchNorm op."""
from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import Tensor, nn

from lkcnn.ops import build
from lkcnn.ops.sync_batchnorm import sync_batch_norm


class SyncBatchNorm(nn.SyncBatchNorm):
    """torch.nn.SyncBatchNorm whose distributed training forward and backward run in C++ (lkcnn.ops.sync_batchnorm)."""

    def forward(self, input: Tensor) -> Tensor:
        # group.size(), not dist.get_world_size(group): this runs ~200 times per step, and the latter's Python (and
        # torch.nn.SyncBatchNorm.forward asking again) took ~12 ms per step under cProfile on one GPU
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
