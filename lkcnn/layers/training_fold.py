"""A training-mode BatchNorm folded into the 1x1 conv after it, where another BatchNorm follows that conv: RepLKNet's
`prelkb_bn -> pw1` and `preffn_bn -> pw1` in compiled training.

BN1(x) = s * (x - mean) + beta1 with s = gamma1 / std per channel, so conv(BN1(x)) = conv_{W * s}(x) + W (beta1 - s *
mean): the conv runs on x with BN1's scale in its weights, and the constant it leaves out is removed by the training
BatchNorm after the conv, which subtracts its batch mean. Nothing reads or writes BN1's output: in the compiled step
that is one store of it in the forward and, in the backward, BN1's pass over the conv's input gradient and x for its
two per-channel sums; the sum that remains, the gradient of BN1's scale, comes out of the conv's weight gradient
(sum over the output channels of W * dW'). The left-out constant goes into BN2's running mean, so the running
statistics and the eval-mode network are those of the plain pair (docs/performance.md, "The current code against
ConvNeXt-B", has the A/B).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lkcnn.ops.sync_batchnorm import update_running_stats


class _BatchStats(torch.autograd.Function):
    """Per-channel biased variance and mean over (N, H, W). Autograd's var_mean backward computes the mean again
    (a pass over x in the backward); this one keeps the forward's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        var, mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        ctx.save_for_backward(x, mean)
        return var, mean

    @staticmethod
    def backward(ctx, dvar: torch.Tensor, dmean: torch.Tensor) -> torch.Tensor:
        x, mean = ctx.saved_tensors
        count = x.numel() // x.shape[1]
        return (x - mean[:, None, None]) * (2 * dvar / count)[:, None, None] + (dmean / count)[:, None, None]


class _CentredGemm(torch.autograd.Function):
    """`x @ w + centre` for the conv on BN1's input x. Its weight gradient `x.T @ dz` holds `mean ⊗ sum(dz)`: zero in
    exact arithmetic (BN2 makes dz sum to zero) but, through x's mean, the rounding of a 16-bit dz made large. The
    backward GEMM subtracts it in its fp32 accumulator, which makes the weight gradient that of the centred input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, centre: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, mean)
        return torch.addmm(centre, x, w)

    @staticmethod
    def backward(ctx, dz: torch.Tensor):
        x, w, mean = ctx.saved_tensors
        offset = torch.outer(mean, dz.sum(0, dtype=mean.dtype)).to(x.dtype)
        return dz @ w.t(), torch.addmm(offset, x.t(), dz, beta=-1), None, None


def _foldable(bn: nn.Module) -> bool:
    """A plain training-mode BatchNorm2d with an exponential running average (SyncBatchNorm and the cumulative
    average keep their own forward)."""
    return (type(bn) is nn.BatchNorm2d and bn.training and bn.affine and bn.track_running_stats
            and bn.momentum is not None)


def _update_running(bn: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
    with torch.no_grad():
        bn.num_batches_tracked.add_(1)
        update_running_stats(bn.running_mean, bn.running_var, mean, var, count, bn.momentum)


def bn_conv_bn(x: torch.Tensor, bn1: nn.Module, conv_bn: nn.Sequential) -> torch.Tensor:
    """`conv_bn(bn1(x))` for `conv_bn` = bias-free 1x1 conv -> BatchNorm2d (-> `nonlinear`), folded while compiling
    a channels_last training step (torch.compile: inductor fuses what is left into its neighbours' passes); eager,
    eval, NCHW and other norms run the modules as they are."""
    conv, bn2 = conv_bn.conv, conv_bn.bn
    if not (torch.compiler.is_compiling() and _foldable(bn1) and _foldable(bn2) and conv.kernel_size == (1, 1)
            and conv.stride == (1, 1) and conv.padding == (0, 0) and conv.groups == 1 and conv.bias is None
            and x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)):
        return conv_bn(bn1(x))
    n, c, h, w = x.shape
    count = x.numel() // c
    stats = torch.promote_types(x.dtype, torch.float32)
    var, mean = _BatchStats.apply(x.to(stats))
    scale = bn1.weight * torch.rsqrt(var + bn1.eps)
    weight = conv.weight.reshape(conv.out_channels, c).to(stats) * scale
    # The conv runs on x, not on BN1's centred output, so its output carries the constant weight @ (scale * mean),
    # which can be large next to the signal. Stored in 16 bits it would cost the signal that much precision, so the
    # GEMM's epilogue subtracts it in fp32 (a bias, detached: BN2 removes any constant, so it has no gradient). The
    # 1x1 conv is a GEMM on the channels_last view, where cuBLAS applies the bias in its epilogue. The weight
    # gradient has the same trouble, and _CentredGemm's backward the same remedy.
    # (torch.amp.is_autocast_available would break torch 2.11's graph: its dynamo cannot trace it)
    amp = x.device.type in ("cuda", "cpu") and torch.is_autocast_enabled(x.device.type)
    gemm = torch.get_autocast_dtype(x.device.type) if amp else x.dtype
    centre = -(weight @ mean).detach()
    z = _CentredGemm.apply(x.permute(0, 2, 3, 1).reshape(count, c).to(gemm), weight.t().to(gemm), centre.to(gemm),
                           mean.detach())
    z = z.reshape(n, h, w, -1).permute(0, 3, 1, 2)
    var2, mean2 = _BatchStats.apply(z.to(stats))
    # What the conv of BN1's output adds to every position, and BN2 subtracts. beta1 has no other effect on a
    # training-mode output; through this zero-weighted term it keeps its (zero) gradient, so DDP and the optimizer
    # see every parameter take part in the step.
    shift = conv.weight.reshape(conv.out_channels, c).to(stats) @ bn1.bias
    _update_running(bn1, mean, var, count)
    _update_running(bn2, mean2 + shift.detach() + (centre - centre.to(gemm).to(stats)), var2, count)
    scale2 = bn2.weight * torch.rsqrt(var2 + bn2.eps)
    bias2 = bn2.bias + 0 * shift
    y = ((z.to(stats) - mean2[:, None, None]) * scale2[:, None, None] + bias2[:, None, None]).to(z.dtype)
    return conv_bn.nonlinear(y) if hasattr(conv_bn, "nonlinear") else y
