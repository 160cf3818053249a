"""BN folding and kernel merging: the one place where re-parameterization math lives."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def fuse_bn(weight: torch.Tensor, bn: nn.BatchNorm2d,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold an eval-mode BatchNorm into the conv before it: returns (weight * g/s, beta + (bias - mean) * g/s).

    s = sqrt(running_var + eps). Works for any conv weight (out_channels first) and is used for every branch
    of ReparamLargeKernelConv and for plain conv-BN pairs.
    """
    std = (bn.running_var + bn.eps).sqrt()
    gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(std)
    scale = gamma / std
    mean_shift = bn.running_mean if bias is None else bn.running_mean - bias
    return weight * scale.reshape(-1, *([1] * (weight.dim() - 1))), beta - mean_shift * scale


def merge_branches(branches, kernel_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The one (C,1,kh,kw) kernel and (C,) bias equal to the sum of BN-folded depthwise branches (eval mode).

    `branches` yields (weight, bn, dilation, conv_bias or None); each branch is dilated to its dense kernel and
    centred in `kernel_size`. Every multi-branch block (RepLKNet's, UniRepLKNet's) merges through here.
    """
    kernel, bias = 0, 0
    for weight, bn, dilation, conv_bias in branches:
        w, b = fuse_bn(weight, bn, conv_bias)
        kernel = kernel + pad_to(dilate_kernel(w, dilation), kernel_size)
        bias = bias + b
    return kernel, bias


def dilate_kernel(weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """A kxk kernel with dilation r as the equivalent dense ((k-1)r+1)^2 kernel (zeros between taps)."""
    if dilation == 1:
        return weight
    kh, kw = weight.shape[-2:]
    dense = weight.new_zeros(*weight.shape[:-2], (kh - 1) * dilation + 1, (kw - 1) * dilation + 1)
    dense[..., ::dilation, ::dilation] = weight
    return dense


def pad_to(weight: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Zero-pad a (.., kh, kw) kernel symmetrically to (.., *size); both sizes odd so the centres line up."""
    dh, dw = size[0] - weight.shape[-2], size[1] - weight.shape[-1]
    if dh < 0 or dw < 0 or dh % 2 or dw % 2:
        raise ValueError(f"cannot centre a {tuple(weight.shape[-2:])} kernel inside {tuple(size)}: "
                         "branch kernels must be odd and no larger than the large kernel")
    return F.pad(weight, [dw // 2, dw // 2, dh // 2, dh // 2])
