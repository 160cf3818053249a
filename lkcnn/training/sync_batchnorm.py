"""Synchronized BatchNorm that keeps the host ahead of the GPU, and the Lightning plugin that installs it.

Why not torch.nn.SyncBatchNorm as is: a DDP step of RepLKNet-31B runs ~200 BatchNorms, and torch's synchronized
forward and backward are Python around PyTorch's kernels and collectives. That costs host time in every layer (and
its forward also makes the host wait for the GPU once per layer, by boolean indexing: pytorch/pytorch#78549): on
2x H200 it turned 2 GPUs into 0.93x of one, and even without the wait the host needed ~0.7 ms per layer, more per
step than the GPU. lkcnn's version issues the same kernels and collectives from one C++ autograd function
(csrc/sync_batchnorm.cpp, built with the convolution kernels). Eval mode and one process run plain BatchNorm; CPU
tensors, empty inputs, or a machine where the extension cannot be built run torch.nn.SyncBatchNorm's own forward.

Under torch.compile the same C++ passes run as two torch.library ops, `lkcnn::sync_batch_norm_fwd` and
`lkcnn::sync_batch_norm_bwd`, with fake implementations: dynamo traces them without a graph
break, and with `mode="reduce-overhead"` the collectives are captured into the step's CUDA graphs, so a DDP step
needs no host time per layer at all. Eager mode keeps the single C++ autograd function: the ops' Python autograd
wrapper would add host time to every layer.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from torch import Tensor, nn

from lkcnn.ops import build
from lkcnn.ops.dwconv import memory_format_of


def sync_batch_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
                    running_var: Tensor | None, eps: float, momentum: float, group) -> Tensor:
    """Training-mode BatchNorm of x with batch statistics over every rank of `group` (autograd-aware).

    Every rank must pass the same number of samples; running statistics are updated in place. Raises
    lkcnn.ops.build.BuildError where the CUDA extension cannot be built.
    """
    if not torch.compiler.is_compiling():
        return build.load().sync_batch_norm(x, weight, bias, running_mean, running_var, eps, momentum,
                                            group.group_name)
    y, mean, invstd = sync_batch_norm_fwd(x, weight, bias, eps, group.group_name)
    if running_mean is not None:  # the update that batch_norm_gather_stats_with_counts makes in the eager path
        n = x.numel() // x.shape[1] * group.size()
        running_mean.lerp_(mean.to(running_mean.dtype), momentum)
        running_var.lerp_(((invstd.pow(-2) - eps) * (n / (n - 1))).to(running_var.dtype), momentum)
    return y


def _stats_dtype(x: Tensor) -> torch.dtype:
    """The dtype of batch_norm_stats' mean and 1/std: float32 for 16-bit inputs (PyTorch's accumulate type)."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


# A functional op (a torch.library op that mutates its inputs cannot have an autograd formula): the running
# statistics are updated by the caller, in the graph, where inductor fuses the update into one small kernel.
@torch.library.custom_op("lkcnn::sync_batch_norm_fwd", mutates_args=())
def sync_batch_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group_name: str
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """sync_batch_norm's forward as an op: (output, mean, 1/std) with the statistics of every rank of the group."""
    return build.load().sync_batch_norm_forward(x, weight, bias, None, None, eps, 0.0, group_name)


@sync_batch_norm_fwd.register_fake
def _(x, weight, bias, eps, group_name):
    stats = x.new_empty(x.shape[1], dtype=_stats_dtype(x))
    return torch.empty_like(x, memory_format=memory_format_of(x)), stats, torch.empty_like(stats)


@torch.library.custom_op("lkcnn::sync_batch_norm_bwd", mutates_args=())
def sync_batch_norm_bwd(grad_out: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor,
                        group_name: str, need_input: bool, need_weight: bool, need_bias: bool
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """sync_batch_norm's backward as an op: (grad_x, grad_weight, grad_bias), empty where not asked for."""
    grads = build.load().sync_batch_norm_backward(grad_out, x, weight, mean, invstd, group_name, need_input,
                                                  need_weight, need_bias)
    return tuple(x.new_empty(0) if g is None else g for g in grads)  # an op returns tensors, not None


@sync_batch_norm_bwd.register_fake
def _(grad_out, x, weight, mean, invstd, group_name, need_input, need_weight, need_bias):
    param = weight is not None
    return (torch.empty_like(x, memory_format=memory_format_of(x)) if need_input else x.new_empty(0),
            torch.empty_like(weight) if need_weight and param else x.new_empty(0),
            torch.empty_like(weight) if need_bias and param else x.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _, _, group_name = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])  # the statistics only update the running ones
    ctx.group_name = group_name


def _backward(ctx, grad: Tensor, _grad_mean, _grad_invstd):
    x, weight, mean, invstd = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    grads = sync_batch_norm_bwd(grad, x, weight, mean, invstd, ctx.group_name, *need)
    return (*(g if n else None for g, n in zip(grads, need)), None, None)


sync_batch_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


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
