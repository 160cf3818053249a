"""ReparamLargeKernelConv: large depthwise conv-BN plus parallel small / dilated conv-BN branches, mergeable into one
large conv with bias (RepLKNet's ReparamLargeKernelConv, UniRepLKNet's DilatedReparamBlock)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from .branch_convs import BranchConvs
from .conv_bn import conv_bn, lk_conv_bn
from .fuse import merge_branches
from .large_kernel_conv import LargeKernelConv, to_kernel_size

# UniRepLKNet's dilated branches per large kernel size K: (kernel k, dilation r); each is a sparse ((k-1)r+1)^2 kernel.
UNIREPLKNET_DILATED_BRANCHES: dict[int, tuple[tuple[int, int], ...]] = {
    7: ((5, 1), (3, 2), (3, 3)),
    9: ((5, 1), (5, 2), (3, 3), (3, 4)),
    11: ((5, 1), (5, 2), (3, 3), (3, 4), (3, 5)),
    13: ((5, 1), (7, 2), (3, 3), (3, 4), (3, 5)),
    15: ((5, 1), (7, 2), (3, 3), (3, 5), (3, 7)),
    17: ((5, 1), (9, 2), (3, 4), (3, 5), (3, 7)),
}

DilatedBranches = bool | None | Sequence[Sequence[int]]


def resolve_dilated_branches(kernel_size: tuple[int, int], branches: DilatedBranches) -> tuple[tuple[int, int], ...]:
    """False/None -> none; True -> UniRepLKNet's table for this (square) kernel; else explicit (k, r) pairs."""
    if not branches:
        return ()
    if branches is True:
        if kernel_size[0] != kernel_size[1] or kernel_size[0] not in UNIREPLKNET_DILATED_BRANCHES:
            raise ValueError(f"dilated_branches=True uses UniRepLKNet's table, which has no entry for kernel "
                             f"{kernel_size}; tabled sizes: {sorted(UNIREPLKNET_DILATED_BRANCHES)}. "
                             "Pass explicit (kernel, dilation) pairs instead.")
        return UNIREPLKNET_DILATED_BRANCHES[kernel_size[0]]
    pairs = tuple((int(k), int(r)) for k, r in branches)
    for k, r in pairs:
        size = (k - 1) * r + 1
        if k % 2 == 0 or k < 1 or r < 1 or size > min(kernel_size):
            raise ValueError(f"dilated branch (k={k}, r={r}) spans {size}x{size}, which must be odd and fit inside "
                             f"the large kernel {kernel_size}")
    return pairs


class ReparamLargeKernelConv(nn.Module):
    """Depthwise KxK conv-BN (+ small conv-BN) (+ dilated conv-BNs), summed; `reparameterize()` folds it into
    `lkb_reparam`, a LargeKernelConv with bias, exactly the module built with deploy=True."""

    def __init__(self, channels: int, kernel_size: int | tuple[int, int], small_kernel: int | None = 5,
                 dilated_branches: DilatedBranches = False, deploy: bool = False) -> None:
        super().__init__()
        self.channels = channels
        self.kernel_size = to_kernel_size(kernel_size)
        self.small_kernel = to_kernel_size(small_kernel) if small_kernel else None
        if self.small_kernel and any(s > k for s, k in zip(self.small_kernel, self.kernel_size)):
            raise ValueError(f"small_kernel {self.small_kernel} must fit inside the large kernel {self.kernel_size}; "
                             "small_kernel=0 drops the small branch (timm.create_model ignores small_kernel=None)")
        self.dilated_branches = resolve_dilated_branches(self.kernel_size, dilated_branches)
        self.deploy = deploy
        if deploy:
            self.lkb_reparam = LargeKernelConv(channels, self.kernel_size, bias=True)
            return
        self.lkb_origin = lk_conv_bn(channels, self.kernel_size)
        self.small_conv = None
        if self.small_kernel:
            self.small_conv = nn.Sequential()
            self.small_conv.add_module("conv", nn.Conv2d(channels, channels, self.small_kernel, groups=channels,
                                                         padding=tuple(k // 2 for k in self.small_kernel), bias=False))
            self.small_conv.add_module("bn", nn.BatchNorm2d(channels))
        self.dilated = nn.ModuleDict({f"k{k}_r{r}": conv_bn(channels, channels, k, groups=channels, dilation=r)
                                      for k, r in self.dilated_branches})
        small = self.branches()[1:]
        # the small and dilated branches in one call: one pass over x on a GPU (lkcnn.ops.dwconv2d_branches); the
        # op takes square kernels, a rectangular small kernel runs as its own conv
        self.branch_convs = None
        if small and all(b.conv.kernel_size[0] == b.conv.kernel_size[1] for b in small):
            self.branch_convs = BranchConvs([b.conv.kernel_size[0] for b in small],
                                            [b.conv.dilation[0] for b in small])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deploy:
            return self.lkb_reparam(x)
        out = self.lkb_origin(x)
        small = self.branches()[1:]
        if not small:
            return out
        if self.branch_convs is not None:
            ys = self.branch_convs(x, *[b.conv.weight for b in small])
        else:
            ys = [b.conv(x) for b in small]
        for branch, y in zip(small, ys):
            out = out + branch.bn(y)
        return out

    def branches(self) -> list[nn.Sequential]:
        """The conv-BN branches of the training form, large kernel first."""
        small = [self.small_conv] if self.small_conv is not None else []
        return [self.lkb_origin, *small, *self.dilated.values()]

    @torch.no_grad()
    def get_equivalent_kernel_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The single (C,1,kh,kw) kernel and (C,) bias equal to the sum of all BN-folded branches (eval mode)."""
        return merge_branches(((b.conv.weight, b.bn, b.conv.dilation[0], None) for b in self.branches()),
                              self.kernel_size)

    def reparameterize(self) -> None:
        """Merge all branches into `lkb_reparam` in place (timm's convention); a no-op when already deployed."""
        if self.deploy:
            return
        self.lkb_reparam = LargeKernelConv.from_kernel(*self.get_equivalent_kernel_bias())
        del self.lkb_origin, self.small_conv, self.dilated, self.branch_convs
        self.deploy = True

    def training_form(self) -> ReparamLargeKernelConv:
        """A fresh training-form module of this configuration (to read a training checkpoint into a deployed one)."""
        return ReparamLargeKernelConv(self.channels, self.kernel_size, self.small_kernel, self.dilated_branches)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, small_kernel={self.small_kernel}, "
                f"dilated_branches={self.dilated_branches}, deploy={self.deploy}")
