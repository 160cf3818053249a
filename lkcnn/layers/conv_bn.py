"""conv-BN(-ReLU) as an nn.Sequential, so state-dict keys are `conv.weight`, `bn.*` as in official RepLKNet."""
from __future__ import annotations

import torch.nn as nn

from .image_conv import PAD_CHANNELS, ImageConv2d
from .large_kernel_conv import LargeKernelConv


def conv_bn(in_chs: int, out_chs: int, kernel_size: int, stride: int = 1, groups: int = 1, dilation: int = 1,
            act: bool = False) -> nn.Sequential:
    """Bias-free conv ('same' padding for stride 1) -> BatchNorm2d (-> ReLU as `nonlinear` when act); an
    ImageConv2d where it reads an image (fewer than 16 input channels)."""
    conv = ImageConv2d if groups == 1 and in_chs < PAD_CHANNELS else nn.Conv2d
    seq = nn.Sequential()
    seq.add_module("conv", conv(in_chs, out_chs, kernel_size, stride=stride, padding=dilation * (kernel_size // 2),
                                     dilation=dilation, groups=groups, bias=False))
    seq.add_module("bn", nn.BatchNorm2d(out_chs))
    if act:
        seq.add_module("nonlinear", nn.ReLU())
    return seq


def lk_conv_bn(channels: int, kernel_size: int | tuple[int, int]) -> nn.Sequential:
    """Depthwise LargeKernelConv (no bias, 'same' padding) -> BatchNorm2d: a branch of the re-parameterizable layers."""
    seq = nn.Sequential()
    seq.add_module("conv", LargeKernelConv(channels, kernel_size))
    seq.add_module("bn", nn.BatchNorm2d(channels))
    return seq
