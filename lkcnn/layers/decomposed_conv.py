"""DecomposedLargeKernelConv: SLaK's decomposed large kernel (Liu et al., "More ConvNets in the 2020s: Scaling up
Kernels Beyond 51x51 using Sparsity", ICLR 2023; github VITA-Group/SLaK, `models/SLaK.py`).

A K x K depthwise kernel costs K^2 multiply-adds per output; SLaK replaces it by a K x N and an N x K kernel (its
"Decom": 51x5 + 5x51 at N = 5), 2KN, so a stage can see 51 pixels across for about a fifth of a 51x51's work.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .conv_bn import lk_conv_bn
from .fuse import fuse_bn, merge_branches
from .large_kernel_conv import LargeKernelConv, to_kernel_size


class DecomposedLargeKernelConv(nn.Module):
    """Depthwise (K x N) conv-BN + (N x K) conv-BN (+ small s x s conv-BN), summed; every conv a LargeKernelConv.

    State-dict keys are those of SLaK's ReparamLargeKernelConv with Decom=True: `LoRA1.conv.weight` (C,1,K,N),
    `LoRA2.conv.weight` (C,1,N,K), `small_conv.conv.weight` (C,1,s,s), each with its `.bn.*`. SLaK's blocks hold the
    module as `large_kernel`, timm's ConvNeXt as `conv_dw`; lkcnn's checkpoint filter renames the one to the other.

    `reparameterize()` folds each BN into its conv and the small kernel into the K x N one (it must fit: s <= N),
    leaving `LoRA1_reparam` (K x N, with the bias of all branches) and `LoRA2_reparam` (N x K, no bias), exactly the
    module built with deploy=True. The pair stays two convolutions: one K x K kernel would be exact as well but cost
    K / 2N times the work. SLaK merges no decomposed pair, so the deploy names are lkcnn's.
    """

    def __init__(self, channels: int, kernel_size: int, width: int, small_kernel: int | None = 5,
                 deploy: bool = False) -> None:
        super().__init__()
        if not isinstance(kernel_size, int):
            raise ValueError(f"a decomposed kernel takes one int K (it becomes K x width + width x K), got "
                             f"{kernel_size!r}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.width = width
        self.small_kernel = to_kernel_size(small_kernel) if small_kernel else None
        long, wide = to_kernel_size((kernel_size, width)), to_kernel_size((width, kernel_size))
        if self.small_kernel and any(s > k for s, k in zip(self.small_kernel, long)):
            raise ValueError(f"small_kernel {self.small_kernel} must fit inside the {kernel_size}x{width} kernel it "
                             f"merges into: raise the width or pass small_kernel=0 (no small branch)")
        self.deploy = deploy
        if deploy:
            self.LoRA1_reparam = LargeKernelConv(channels, long, bias=True)
            self.LoRA2_reparam = LargeKernelConv(channels, wide)
            return
        self.LoRA1 = lk_conv_bn(channels, long)
        self.LoRA2 = lk_conv_bn(channels, wide)
        self.small_conv = lk_conv_bn(channels, self.small_kernel) if self.small_kernel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deploy:
            return self.LoRA1_reparam(x) + self.LoRA2_reparam(x)
        out = self.LoRA1(x) + self.LoRA2(x)
        if self.small_conv is not None:
            out = out + self.small_conv(x)
        return out

    @torch.no_grad()
    def get_equivalent_kernels_bias(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K x N kernel with the small one merged, N x K kernel, (C,) bias of all branches), eval-mode BN folded."""
        small = [self.small_conv] if self.small_conv is not None else []
        long, bias = merge_branches(((b.conv.weight, b.bn, 1, None) for b in (self.LoRA1, *small)),
                                    self.LoRA1.conv.kernel_size)
        wide, wide_bias = fuse_bn(self.LoRA2.conv.weight, self.LoRA2.bn)
        return long, wide, bias + wide_bias

    def reparameterize(self) -> None:
        """Merge into `LoRA1_reparam` + `LoRA2_reparam` in place (timm's convention); a no-op when already deployed."""
        if self.deploy:
            return
        long, wide, bias = self.get_equivalent_kernels_bias()
        self.LoRA1_reparam = LargeKernelConv.from_kernel(long, bias)
        self.LoRA2_reparam = LargeKernelConv.from_kernel(wide, None)
        del self.LoRA1, self.LoRA2, self.small_conv
        self.deploy = True

    def training_form(self) -> DecomposedLargeKernelConv:
        """A fresh training-form module of this configuration (to read a training checkpoint into a deployed one)."""
        return DecomposedLargeKernelConv(self.channels, self.kernel_size, self.width, self.small_kernel)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, width={self.width}, "
                f"small_kernel={self.small_kernel}, deploy={self.deploy}")
